// RMSNorm -> QKV projection -> rotary embedding, LLaMA's attention input, in
// one GEMM: the norm folded into the weight, the rotation in the epilogue.
//
// The rotation acts on adjacent column pairs (2j, 2j+1) of the output, by
// φ = 2π·pos·(freq[2j] + freq[2j+1]) (python/coda/ops/rope.py builds freq;
// v's columns have 0). Backward: dP = R(−φ)·dY and the RMSNorm's row dot in
// one elementwise pass (the rotation sits on the dgrad GEMM's K dimension,
// where no epilogue reaches), then the norm's backward in the dgrad GEMM's
// epilogue as for any folded norm.
#include "autograd.h"
#include "shared_ops.h"
#include "tensors.h"

namespace coda::torch_ops {

namespace {

Tensor positions_of(const Tensor& positions, int64_t m) {
  expect(positions.scalar_type() == at::kInt && positions.numel() == m,
         "rmsnorm_linear_rope: positions must be int32 with one per row of x");
  return vec(positions.reshape({m}));
}

Tensor freq_of(const Tensor& freq, int64_t n) {
  expect(freq.scalar_type() == at::kFloat && freq.numel() == n && n % 2 == 0,
         "rmsnorm_linear_rope: freq must be float32 (N,), N even");
  return vec(freq);
}

// -> (y, the stats computed here or (0,), t = bias as fp32)
std::tuple<Tensor, Tensor, Tensor> rmsnorm_linear_rope(const Tensor& x_, const Tensor& norm_weight,
                                                       const Tensor& weight, const OptTensor& bias,
                                                       const Tensor& positions, const Tensor& freq,
                                                       const OptTensor& stats, double eps) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = rows(x_), w = rows(weight);
  const int64_t m = x.size(0), n = w.size(0);
  expect(w.size(1) == x.size(1), "rmsnorm_linear_rope: weight must be (N, K) for x (M, K)");
  Tensor pos = positions_of(positions, m), fr = freq_of(freq, n);
  Tensor st = rms_stats_of(x, stats, eps);
  auto [wf, shift] = rms_fold_of(w, norm_weight, bias);
  Tensor y_ = empty_rows_of(x_, n), y = flat(y_);
  NormRopeArgs a;
  a.m = m; a.n = n; a.k = x.size(1);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = wf.data_ptr(); a.ldw = wf.stride(0);
  a.rstd = st.data_ptr<float>() + st.stride(0);
  a.shift = bias ? shift.data_ptr<float>() : nullptr;
  a.positions = pos.data_ptr<int32_t>();
  a.freq = fr.data_ptr<float>();
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  call("norm_rope_linear", dtype_of(x), a, x, coda::norm_rope_linear, coda::norm_rope_linear_workspace_size);
  return {y_, stats ? none_f32(x) : st, shift};
}

// y: the forward's output. needs: (dx, dnorm_weight, dweight, dbias)
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_linear_rope_backward(
    const Tensor& dy_, const Tensor& x_, const Tensor& norm_weight, const Tensor& weight, const Tensor& y_,
    const Tensor& positions, const Tensor& freq, const Tensor& stats, const Tensor& shift,
    std::array<bool, 4> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_), x = rows(x_), w = rows(weight), y = rows(y_);
  const int64_t m = dy.size(0), n = dy.size(1);
  Tensor pos = positions_of(positions, m), fr = freq_of(freq, n), t = vec(shift);
  // One pass: the gradient before the rotation and the norm's row dot.
  Tensor dp = empty2(m, n, dy), c1 = f32({m}, dy);
  RopeBackwardArgs r;
  r.m = m; r.n = n;
  r.dy = dy.data_ptr(); r.lddy = dy.stride(0);
  r.y = y.data_ptr(); r.ldy = y.stride(0);
  r.positions = pos.data_ptr<int32_t>();
  r.freq = fr.data_ptr<float>();
  r.shift = t.numel() ? t.data_ptr<float>() : nullptr;
  r.scale = 1.f / float(x.size(1));  // a mean over the norm's features
  r.dp = dp.data_ptr(); r.lddp = dp.stride(0);
  r.c1 = c1.data_ptr<float>();
  check(coda::rope_backward(dtype_of(dy), r, stream()), "rope_backward");
  Tensor db = needs[3] ? dp.sum(0) : none(dy);
  if (!(needs[0] || needs[1] || needs[2])) return {none(dy), none(dy), none(dy), db};
  auto [dx, normalized, dgamma] =
      rms_dgrad_of(dp, w, x, stats, norm_weight, c1, std::nullopt, needs[2], needs[1]);
  Tensor dw = needs[2] ? wgrad_of(dp, normalized) : none(dy);
  return {needs[0] ? dx.view(x_.sizes()) : none(dy), needs[1] ? dgamma : none(dy), dw, db};
}

CODA_OP_HANDLE(rmsnorm_linear_rope)
CODA_OP_HANDLE(rmsnorm_linear_rope_backward)

// Saves x, γ, W, y, positions, freq, the row statistics and t; positions,
// freq and the statistics take no gradient.
struct RmsNormLinearRopeFn : torch::autograd::Function<RmsNormLinearRopeFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& norm_weight,
                               const Tensor& weight, const OptTensor& bias, const Tensor& positions,
                               const Tensor& freq, const OptTensor& stats, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, st, t] = rmsnorm_linear_rope_op().call(x, norm_weight, weight, bias, positions, freq, stats, eps);
    ctx->save_for_backward({x, norm_weight, weight, y, positions, freq, stats ? *stats : st, t});
    ctx->saved_data["p"] = present_mask({true, true, true, bias.has_value(), true, true, stats.has_value()});
    ctx->mark_non_differentiable({st, t});
    ctx->set_materialize_grads(false);
    return {y, st, t};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(8);
    at::AutoDispatchBelowADInplaceOrView below;  // the backward op's own Autograd key has nothing to do
    const auto n = needs_by_arg<4>(ctx, ctx->saved_data["p"].toInt());
    auto v = ctx->get_saved_variables();
    const std::array<bool, 4> needs{n[0], n[1], n[2], n[3]};
    auto [dx, dg, dw, db] =
        rmsnorm_linear_rope_backward_op().call(dy, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], needs);
    variable_list out(8);
    const Tensor* g[4] = {&dx, &dg, &dw, &db};
    for (int i = 0; i < 4; ++i) out[i] = needs[i] ? *g[i] : Tensor();
    return first_order("rmsnorm_linear_rope", std::move(out));
  }
};

std::tuple<Tensor, Tensor, Tensor> rmsnorm_linear_rope_autograd(const Tensor& x, const Tensor& norm_weight,
                                                                const Tensor& weight, const OptTensor& bias,
                                                                const Tensor& positions, const Tensor& freq,
                                                                const OptTensor& stats, double eps) {
  if (!any_requires_grad({&x, &norm_weight, &weight, opt(bias)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return rmsnorm_linear_rope_op().call(x, norm_weight, weight, bias, positions, freq, stats, eps);
  }
  auto o = RmsNormLinearRopeFn::apply(x, norm_weight, weight, bias, positions, freq, stats, eps);
  return {o[0], o[1], o[2]};
}

// ---- Qwen3's / Gemma 3's per-head RMSNorm + RoPE: x (..., heads, head_dim), weight (head_dim) in pair order

// (rows of heads · head_dim with adjacent heads, the rows' stride) of x, a copy where its strides do not allow it.
Tensor heads_rows(const Tensor& x) {
  expect(x.dim() >= 2, "head_norm_rope: x must be (..., heads, head_dim)");
  const int64_t heads = x.size(-2), hd = x.size(-1);
  Tensor t = x.reshape({-1, heads, hd});
  if (t.stride(2) != 1 || t.stride(1) != hd || t.stride(0) % 8 != 0 || !aligned16(t)) t = t.contiguous();
  return t;
}

Tensor head_positions(const Tensor& positions, const Tensor& x) {
  const auto lead = x.sizes().slice(0, x.dim() - 2);
  return vec(positions.expand(lead).reshape({-1}).to(at::kInt));
}

Tensor head_norm_rope(const Tensor& x_, const Tensor& weight, const Tensor& positions, const Tensor& inv_freq,
                      double eps) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = heads_rows(x_);
  const int64_t m = x.size(0), heads = x.size(1), hd = x.size(2);
  expect(weight.numel() == hd && inv_freq.numel() * 2 == hd && inv_freq.scalar_type() == at::kFloat,
         "head_norm_rope: weight must be (head_dim,) and inv_freq float32 (head_dim / 2,)");
  Tensor w = vec(weight.to(x.scalar_type())), f = vec(inv_freq), pos = head_positions(positions, x_);
  Tensor y = at::empty(x.sizes(), x.options());
  HeadNormRopeArgs a;
  a.m = m; a.heads = heads; a.head_dim = hd;
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = w.data_ptr();
  a.positions = pos.data_ptr<int32_t>();
  a.inv_freq = f.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  check(coda::head_norm_rope(dtype_of(x), a, stream()), "head_norm_rope");
  return y.view(x_.sizes());
}

// needs: (dx, dweight)
std::tuple<Tensor, Tensor> head_norm_rope_backward(const Tensor& dy_, const Tensor& x_, const Tensor& weight,
                                                   const Tensor& positions, const Tensor& inv_freq, double eps,
                                                   std::array<bool, 2> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor x = heads_rows(x_), dy = heads_rows(dy_);
  const int64_t m = x.size(0), heads = x.size(1), hd = x.size(2);
  Tensor w = vec(weight.to(x.scalar_type())), f = vec(inv_freq), pos = head_positions(positions, x_);
  Tensor dx = at::empty(x.sizes(), x.options());
  Tensor partials = needs[1] ? f32({coda::head_norm_rope_partials(m, heads), hd}, x) : none_f32(x);
  HeadNormRopeBackwardArgs a;
  a.m = m; a.heads = heads; a.head_dim = hd;
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = w.data_ptr();
  a.positions = pos.data_ptr<int32_t>();
  a.inv_freq = f.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.dx = dx.data_ptr(); a.lddx = dx.stride(0);
  a.dweight_partials = needs[1] && partials.numel() ? partials.data_ptr<float>() : nullptr;
  check(coda::head_norm_rope_backward(dtype_of(x), a, stream()), "head_norm_rope_backward");
  Tensor dw = needs[1] ? sum_partials(partials, hd, weight) : none(dy);
  return {needs[0] ? dx.view(x_.sizes()) : none(dy), dw};
}

CODA_OP_HANDLE(head_norm_rope)
CODA_OP_HANDLE(head_norm_rope_backward)

// Saves x, weight, positions, inv_freq; positions and inv_freq take no gradient.
struct HeadNormRopeFn : torch::autograd::Function<HeadNormRopeFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& positions,
                               const Tensor& inv_freq, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor y = head_norm_rope_op().call(x, weight, positions, inv_freq, eps);
    ctx->save_for_backward({x, weight, positions, inv_freq});
    ctx->saved_data["eps"] = eps;
    ctx->set_materialize_grads(false);
    return {y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(5);
    at::AutoDispatchBelowADInplaceOrView below;
    const std::array<bool, 2> needs{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto v = ctx->get_saved_variables();
    auto [dx, dw] = head_norm_rope_backward_op().call(dy, v[0], v[1], v[2], v[3], ctx->saved_data["eps"].toDouble(),
                                                      needs);
    return first_order("head_norm_rope", {needs[0] ? dx : Tensor(), needs[1] ? dw : Tensor(), Tensor(), Tensor(),
                                          Tensor()});
  }
};

Tensor head_norm_rope_autograd(const Tensor& x, const Tensor& weight, const Tensor& positions,
                               const Tensor& inv_freq, double eps) {
  if (!any_requires_grad({&x, &weight})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return head_norm_rope_op().call(x, weight, positions, inv_freq, eps);
  }
  return HeadNormRopeFn::apply(x, weight, positions, inv_freq, eps)[0];
}

}  // namespace

CODA_TORCH_OP(head_norm_rope,
              "head_norm_rope(Tensor x, Tensor weight, Tensor positions, Tensor inv_freq, float eps) -> Tensor")
CODA_TORCH_OP(head_norm_rope_backward,
              "head_norm_rope_backward(Tensor dy, Tensor x, Tensor weight, Tensor positions, Tensor inv_freq,"
              " float eps, bool[2] needs) -> (Tensor, Tensor)")
CODA_AUTOGRAD(head_norm_rope, head_norm_rope_autograd)

CODA_TORCH_OP(rmsnorm_linear_rope,
              "rmsnorm_linear_rope(Tensor x, Tensor norm_weight, Tensor weight, Tensor? bias, Tensor positions,"
              " Tensor freq, Tensor? stats, float eps) -> (Tensor, Tensor, Tensor)")
CODA_TORCH_OP(rmsnorm_linear_rope_backward,
              "rmsnorm_linear_rope_backward(Tensor dy, Tensor x, Tensor norm_weight, Tensor weight, Tensor y,"
              " Tensor positions, Tensor freq, Tensor stats, Tensor shift, bool[4] needs)"
              " -> (Tensor, Tensor, Tensor, Tensor)")

CODA_AUTOGRAD(rmsnorm_linear_rope, rmsnorm_linear_rope_autograd)

}  // namespace coda::torch_ops
