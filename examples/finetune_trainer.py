"""Fine-tune a coda-patched causal LM with transformers' Trainer on packed sequences.

    python examples/finetune_trainer.py                          # a tiny LLaMA from a config, CPU or GPU
    python examples/finetune_trainer.py --model PATH --steps 200 # a local checkpoint (LLaMA, Mistral, Qwen2/3, Phi-3, GPT-2)
    python examples/finetune_trainer.py --compare                # the unpatched model too, same seed: both loss curves

What coda adds to an ordinary Trainer script is two lines:

    model = coda.patch(model)                                    # before the Trainer builds its optimizer
    collator = DataCollatorWithFlattening()                      # packing: documents back to back, no padding

The collator packs each batch's documents into one row with position_ids restarting at
0 at every document, and the patched model attends within each document only (the
block-diagonal causal mask transformers builds for packed rows), as the unpatched model
does. The data are synthetic documents of random lengths that count through part of the
vocabulary from a random start with a random stride: learnable, and nothing to download.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from typing import Dict, List

import torch
import transformers

import coda


def documents(n: int, vocab: int, seed: int, shortest: int = 16, longest: int = 96) -> List[Dict[str, List[int]]]:
    """n documents of random lengths; each counts through vocab/8 tokens from a random start by a random stride."""
    g = torch.Generator().manual_seed(seed)
    span = max(vocab // 8, 2)
    out = []
    for _ in range(n):
        length = int(torch.randint(shortest, longest + 1, (1,), generator=g))
        start, stride = int(torch.randint(0, span, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        out.append({"input_ids": [3 + (start + i * stride) % span for i in range(length)]})
    return out


def tiny_llama(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


def finetune(model, docs, steps: int, seed: int = 0, batch_size: int = 8, lr: float = 1e-3, bf16: bool = False,
             use_cpu: bool = False, output_dir: str = None) -> List[float]:
    """Train `model` with Trainer on `docs`, packed; returns the logged loss of every step."""
    args = transformers.TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(prefix="coda-trainer-"), max_steps=steps,
        per_device_train_batch_size=batch_size, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[], seed=seed, data_seed=seed, bf16=bf16,
        use_cpu=use_cpu, dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=docs,
                                   data_collator=transformers.DataCollatorWithFlattening())
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local checkpoint directory (default: a tiny LLaMA from a config)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8, help="documents per packed row")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true", help="also train the unpatched model from the same weights")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    model = (transformers.AutoModelForCausalLM.from_pretrained(a.model) if a.model else tiny_llama(a.seed))
    docs = documents(a.steps * a.batch_size, model.config.vocab_size, a.seed)
    runs = {"coda": coda.patch(copy.deepcopy(model) if a.compare else model)}
    if a.compare:
        runs["unpatched"] = model
    curves = {name: finetune(m, docs, a.steps, a.seed, a.batch_size, a.lr, bf16=cuda, use_cpu=not cuda)
              for name, m in runs.items()}
    for step in range(a.steps):
        print(f"step {step:4d} " + "  ".join(f"{name} {curve[step]:.4f}" for name, curve in curves.items()))


if __name__ == "__main__":
    main()
