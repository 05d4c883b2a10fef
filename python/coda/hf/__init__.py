"""One call runs a Hugging Face causal LM on coda's fused ops, and one gives it back.

    import coda
    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    coda.hf.patch(model)           # or coda.patch(model)
    loss = model(input_ids, labels=input_ids).loss
    coda.hf.unpatch(model)         # the original modules, with the trained weights

transformers is an optional dependency of coda: it is only needed by a model that
already is a transformers model.
"""

from .patch import is_patched, patch, unpatch

__all__ = ["patch", "unpatch", "is_patched"]
