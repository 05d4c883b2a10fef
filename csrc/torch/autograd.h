// What every fused op's autograd shares. The autograd of an op is C++, as
// eager PyTorch's own ops have it: its forward kernel (CUDA), its backward
// op, and between them a torch::autograd::Function registered to the op's
// Autograd key (CODA_AUTOGRAD). A training step then pays no Python for an
// op's graph node or its backward; the backward op is one dispatcher call,
// so that torch.compile traces it through its fake like the forward.
#pragma once

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <string>
#include <vector>

#include "tensors.h"

namespace coda::torch_ops {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// fn_op(): the op's registered schema, looked up once. Calls through it
// dispatch as Python's torch.ops.coda.* do (to the CUDA kernel, a fake, a CPU
// stand-in); under AutoDispatchBelowADInplaceOrView they skip the Autograd key.
template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
#define CODA_OP_HANDLE_OF(fn, Sig)                                                     \
  [[maybe_unused]] const c10::TypedOperatorHandle<Sig>& fn##_op() {                    \
    static const auto handle = find_op<Sig>("coda::" #fn);                             \
    return handle;                                                                     \
  }
#define CODA_OP_HANDLE(fn) CODA_OP_HANDLE_OF(fn, decltype(fn))

// linear_backward's signature, for the ops whose backward is a Linear's.
using LinearBackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                             const OptTensor&, int64_t, std::array<bool, 3>);

// Whether an op call builds a graph node: grad mode on and a tensor that
// requires grad. Without one the Autograd kernel only redispatches.
inline bool any_requires_grad(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}
inline const Tensor* opt(const OptTensor& t) { return t ? &*t : nullptr; }

// needs_input_grad by argument position. A torch::autograd::Function gives an
// absent optional tensor no edge, so edge indices skip it; `present` says
// which tensor arguments were passed (bit i: the i-th tensor argument).
template <size_t N>
std::array<bool, N> needs_by_arg(AutogradContext* ctx, int64_t present) {
  std::array<bool, N> out{};
  size_t edge = 0;
  for (size_t i = 0; i < N; ++i) {
    if (present >> i & 1) out[i] = ctx->needs_input_grad(edge++);
  }
  return out;
}

// Bit i set where the i-th tensor argument is present.
inline int64_t present_mask(std::initializer_list<bool> present) {
  int64_t mask = 0, bit = 1;
  for (bool p : present) {
    if (p) mask |= bit;
    bit <<= 1;
  }
  return mask;
}

// The gradients a backward returns, made to fail with a message naming the
// op if they are differentiated again (create_graph=True): the kernels'
// backward is not itself differentiable. Not while a compiler traces the
// backward (its tensors are functional or fake).
inline variable_list first_order(const char* op, variable_list grads) {
  if (!at::GradMode::is_enabled()) return grads;
  constexpr auto traced = c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  std::vector<size_t> at;
  variable_list present;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    if (grads[i].key_set().has_any(traced)) return grads;
    at.push_back(i);
    present.push_back(grads[i].detach().requires_grad_(true));
  }
  if (present.empty()) return grads;
  auto fail = std::make_shared<torch::autograd::DelayedError>(
      std::string("coda.") + op + ": double backward is not supported", int64_t(present.size()));
  variable_list marked = fail->apply(std::move(present));
  for (size_t j = 0; j < at.size(); ++j) grads[at[j]] = marked[j];
  return grads;
}

inline OptTensor opt_of(const Tensor& t) { return t.defined() && t.numel() > 0 ? OptTensor(t) : std::nullopt; }

}  // namespace coda::torch_ops

// The op's Autograd kernel: `fn` has the op's signature and either
// redispatches (no graph node needed) or applies the op's Function.
#define CODA_AUTOGRAD(name, fn)                                                  \
  TORCH_LIBRARY_IMPL(coda, Autograd, m) { m.impl(#name, TORCH_FN(fn)); }
