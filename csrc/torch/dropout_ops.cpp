// GPT-2's residual dropout: y = residual + dropout(x, p), and optionally the next
// norm's row statistics of y, in one pass (csrc/dropout_kernels.cu). The draw
// comes from torch's CUDA generator (so torch.manual_seed fixes it, and a
// captured CUDA graph draws anew on each replay); the forward writes the
// draw's (seed, offset) into rng_state, from which the backward regenerates
// the mask: nothing of the size of x is kept.
#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <mutex>

#include "autograd.h"
#include "tensors.h"

namespace coda::torch_ops {

namespace {

DropoutRng draw(int64_t elements) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                 at::cuda::detail::getDefaultCUDAGenerator());
  // the offset counts 4-word Philox blocks: a fresh range for this draw's (elements + 3) / 4 of them
  const uint64_t increment = static_cast<uint64_t>((elements + 15) / 16 * 4);
  at::PhiloxCudaState st;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    st = gen->philox_cuda_state(increment > 0 ? increment : 4);
  }
  DropoutRng r;
  if (st.captured_) {
    r.seed_ptr = st.seed_.ptr;
    r.offset_ptr = st.offset_.ptr;
    r.offset_intragraph = st.offset_intragraph_;
  } else {
    r.seed = st.seed_.val;
    r.offset = st.offset_.val;
  }
  return r;
}

// -> (y, stats (2, m) or (0,), rng_state (2,) int64)
std::tuple<Tensor, Tensor, Tensor> dropout_residual(const Tensor& x_, const Tensor& residual_, double p,
                                                    bool want_stats, bool layernorm, double eps) {
  c10::cuda::CUDAGuard guard(x_.device());
  expect(residual_.sizes() == x_.sizes(), "dropout_residual: residual must have x's shape");
  expect(p >= 0.0 && p < 1.0, "dropout_residual: p must be in [0, 1)");
  Tensor x = rows(x_), res = rows(residual_);
  const int64_t m = x.size(0), n = x.size(1);
  Tensor y_ = empty_rows_of(x_, n), y = flat(y_);
  Tensor st = want_stats ? stats_buffer(m, x) : none_f32(x);
  Tensor rng_state = at::empty({2}, x.options().dtype(at::kLong));
  DropoutResidualArgs a;
  a.m = m; a.n = n;
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.residual = res.data_ptr(); a.ld_residual = res.stride(0);
  a.keep = static_cast<float>(1.0 - p);
  a.rng = draw(m * n);
  a.rng_state = rng_state.data_ptr<int64_t>();
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  a.eps = static_cast<float>(eps);
  if (want_stats) {
    a.mean = layernorm ? st.data_ptr<float>() : nullptr;
    a.rstd = st.data_ptr<float>() + st.stride(0);
    if (!layernorm) st[0].zero_();
  }
  check(coda::dropout_residual(dtype_of(x), a, stream()), "dropout_residual");
  return {y_, st, rng_state};
}

Tensor dropout_backward(const Tensor& dy_, const Tensor& rng_state, double p) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_);
  const int64_t m = dy.size(0), n = dy.size(1);
  Tensor dx = empty2(m, n, dy);
  DropoutBackwardArgs a;
  a.m = m; a.n = n;
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.keep = static_cast<float>(1.0 - p);
  a.rng_state = rng_state.data_ptr<int64_t>();
  a.dx = dx.data_ptr(); a.lddx = dx.stride(0);
  check(coda::dropout_backward(dtype_of(dy), a, stream()), "dropout_backward");
  return dx.view(dy_.sizes());
}

CODA_OP_HANDLE(dropout_residual)
CODA_OP_HANDLE(dropout_backward)

// Saves rng_state; x's gradient is the masked dy, the residual's dy itself.
struct DropoutResidualFn : torch::autograd::Function<DropoutResidualFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, double p,
                               bool want_stats, bool layernorm, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, st, rng_state] = dropout_residual_op().call(x, residual, p, want_stats, layernorm, eps);
    ctx->save_for_backward({rng_state});
    ctx->saved_data["p"] = p;
    ctx->mark_non_differentiable({st, rng_state});
    ctx->set_materialize_grads(false);
    return {y, st, rng_state};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(6);
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor dx;
    if (ctx->needs_input_grad(0)) {
      dx = dropout_backward_op().call(dy, ctx->get_saved_variables()[0], ctx->saved_data["p"].toDouble());
    }
    return first_order("dropout_residual",
                       {dx, ctx->needs_input_grad(1) ? dy : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()});
  }
};

std::tuple<Tensor, Tensor, Tensor> dropout_residual_autograd(const Tensor& x, const Tensor& residual, double p,
                                                             bool want_stats, bool layernorm, double eps) {
  if (!any_requires_grad({&x, &residual})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dropout_residual_op().call(x, residual, p, want_stats, layernorm, eps);
  }
  auto o = DropoutResidualFn::apply(x, residual, p, want_stats, layernorm, eps);
  return {o[0], o[1], o[2]};
}

}  // namespace

// Tagged as a seeded random op: a compiler saves its outputs rather than running it again.
TORCH_LIBRARY_FRAGMENT(coda, m) {
  m.def("dropout_residual(Tensor x, Tensor residual, float p, bool want_stats, bool layernorm, float eps)"
        " -> (Tensor, Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  m.impl("dropout_residual", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(dropout_residual)));
}
CODA_TORCH_OP(dropout_backward, "dropout_backward(Tensor dy, Tensor rng_state, float p) -> Tensor")
CODA_AUTOGRAD(dropout_residual, dropout_residual_autograd)

}  // namespace coda::torch_ops
