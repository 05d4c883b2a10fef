// The gated MLP (SwiGLU, GeGLU), LLaMA's: down(act(g) ⊙ u) + residual with
// (g, u) = RMSNorm(x)·W_guᵀ, the norm folded into the gate/up GEMM.
//
// W_gu is coda's (2F, D) layout, gate and up rows interleaved, so the gate/up
// GEMM's epilogue sees each (g, u) pair in adjacent columns: it writes H (the
// backward's input) and A = act(g) ⊙ u. Backward: the down projection's dgrad
// epilogue loads H and writes dH = (dg, du) and the RMSNorm's row dot; the
// gate/up dgrad's epilogue applies the norm's backward (norm_dgrad.hpp). No
// pass over the (tokens, 2F) activation of its own in either direction.
#include "autograd.h"
#include "shared_ops.h"
#include "tensors.h"

namespace coda::torch_ops {

namespace {

float* rstd_ptr(const Tensor& stats) { return stats.data_ptr<float>() + stats.stride(0); }

// y = down(act(g) ⊙ u) + residual; norm_weight null: no norm. -> (y, h, a,
// the stats computed here, the stats of y): (0,) for what was not asked.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_glu_mlp(
    const Tensor& x_, const OptTensor& norm_weight, const Tensor& w_gate_up, const Tensor& w_down,
    const OptTensor& stats, const OptTensor& residual, bool add_input, double eps, int64_t activation, bool save,
    bool want_stats) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = rows(x_), wgu = rows(w_gate_up), wd = rows(w_down);
  const int64_t m = x.size(0), f = wgu.size(0) / 2, e = wd.size(0);
  expect(wgu.size(0) % 2 == 0 && wgu.size(1) == x.size(1) && wd.size(1) == f,
         "norm_glu_mlp: w_gate_up must be (2F, D) and w_down (E, F) for x (M, D)");
  OptTensor r = add_input ? OptTensor(x) : rows(residual);
  expect(!r || (r->size(0) == m && r->size(1) == e), "norm_glu_mlp: residual must be (M, E)");
  const bool has_norm = norm_weight.has_value();
  Tensor st = has_norm ? rms_stats_of(x, stats, eps) : Tensor();
  Tensor w = has_norm ? std::get<0>(rms_fold_of(wgu, *norm_weight, std::nullopt)) : wgu;
  Tensor h = empty2(m, 2 * f, x), a = empty2(m, f, x);
  NormGluArgs g;
  g.m = m; g.n = 2 * f; g.k = x.size(1);
  g.x = x.data_ptr(); g.ldx = x.stride(0);
  g.weight = w.data_ptr(); g.ldw = w.stride(0);
  g.rstd = has_norm ? rstd_ptr(st) : nullptr;
  g.activation = activation_of(activation);
  g.h = h.data_ptr(); g.ldh = h.stride(0);
  g.a = a.data_ptr(); g.lda = a.stride(0);
  call("norm_glu_linear", dtype_of(x), g, x, coda::norm_glu_linear, coda::norm_glu_linear_workspace_size);
  Tensor y_ = empty_rows_of(x_, e), y = flat(y_);
  Tensor out_st = want_stats ? stats_buffer(m, x) : none_f32(x);
  if (want_stats) {  // the next norm's row statistics from the down projection's epilogue
    linear_residual_into(a, wd, std::nullopt, r, y, false, eps, out_st);
  } else {
    LinearArgs d = residual_gemm_args<LinearArgs>(a, wd, std::nullopt, r, y);
    call("linear", dtype_of(x), d, x, coda::linear, coda::linear_workspace_size);
  }
  return {y_, save ? h : none(x), save ? a : none(x), has_norm && !stats ? st : none_f32(x), out_st};
}

// needs: (dx, dnorm_weight, dw_gate_up, dw_down)
std::tuple<Tensor, Tensor, Tensor, Tensor> norm_glu_mlp_backward(
    const Tensor& dy_, const Tensor& x_, const OptTensor& norm_weight, const Tensor& w_gate_up,
    const Tensor& w_down, const Tensor& h_, const Tensor& a_, const OptTensor& stats, bool add_input,
    int64_t activation, std::array<bool, 4> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_), x = rows(x_), wgu = rows(w_gate_up), wd = rows(w_down), h = rows(h_), a = rows(a_);
  const int64_t m = dy.size(0), f = wd.size(1);
  const bool has_norm = norm_weight.has_value();
  expect(!has_norm || stats.has_value(), "norm_glu_mlp_backward: stats are required with a norm");
  Tensor dwd = needs[3] ? wgrad_of(dy, a) : none(dy);
  if (!(needs[0] || needs[1] || needs[2])) return {none(dy), none(dy), none(dy), dwd};
  // The down projection's dgrad epilogue: the gate's backward and the norm's row dot.
  Tensor dh = empty2(m, 2 * f, dy), c1 = has_norm ? f32({m}, dy) : Tensor();
  GluDgradArgs d;
  d.m = m; d.n = f; d.k = dy.size(1);
  d.dy = dy.data_ptr(); d.lddy = dy.stride(0);
  d.weight = wd.data_ptr(); d.ldw = wd.stride(0);
  d.activation = activation_of(activation);
  d.h = h.data_ptr(); d.ldh = h.stride(0);
  d.dh = dh.data_ptr(); d.lddh = dh.stride(0);
  d.norm_scale = 1.f / float(x.size(1));  // a mean over the norm's features
  d.norm_c1 = has_norm ? c1.data_ptr<float>() : nullptr;
  call("glu_dgrad", dtype_of(dy), d, dy, coda::glu_dgrad, coda::glu_dgrad_workspace_size);
  if (has_norm) {
    // The gate/up dgrad's epilogue: the RMSNorm's backward, dγ, N̂ for dW_gu,
    // and the residual's gradient when x is its own residual.
    auto [dx, normalized, dgamma] = rms_dgrad_of(dh, wgu, x, *stats, *norm_weight, c1,
                                                 add_input ? OptTensor(dy) : std::nullopt, needs[2], needs[1]);
    Tensor dwgu = needs[2] ? wgrad_of(dh, normalized) : none(dy);
    return {needs[0] ? dx.view(x_.sizes()) : none(dy), needs[1] ? dgamma : none(dy), dwgu, dwd};
  }
  Tensor dx = none(dy);
  if (needs[0]) {
    dx = dgrad_of(dh, wgu, std::nullopt, Activation::kIdentity, Tensor());
    if (add_input) dx.add_(dy);
    dx = dx.view(x_.sizes());
  }
  return {dx, none(dy), needs[2] ? wgrad_of(dh, x) : none(dy), dwd};
}

CODA_OP_HANDLE(norm_glu_mlp)
CODA_OP_HANDLE(norm_glu_mlp_backward)

// Saves x, γ, W_gu, W_down, H, A and the row statistics; H, A and the
// statistics take no gradient.
struct NormGluMlpFn : torch::autograd::Function<NormGluMlpFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& norm_weight,
                               const Tensor& w_gate_up, const Tensor& w_down, const OptTensor& stats,
                               const OptTensor& residual, bool add_input, double eps, int64_t activation,
                               bool want_stats) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, h, a, st, out_st] = norm_glu_mlp_op().call(x, norm_weight, w_gate_up, w_down, stats, residual,
                                                        add_input, eps, activation, true, want_stats);
    ctx->save_for_backward({x, norm_weight.value_or(Tensor()), w_gate_up, w_down, h, a,
                            stats ? *stats : (norm_weight ? st : Tensor())});
    ctx->saved_data["p"] = present_mask({true, norm_weight.has_value(), true, true, stats.has_value(),
                                         residual.has_value()});
    ctx->saved_data["a"] = activation << 1 | int64_t(add_input);
    ctx->mark_non_differentiable({h, a, st, out_st});
    ctx->set_materialize_grads(false);
    return {y, h, a, st, out_st};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(10);
    at::AutoDispatchBelowADInplaceOrView below;  // the backward op's own Autograd key has nothing to do
    const auto n = needs_by_arg<6>(ctx, ctx->saved_data["p"].toInt());
    const int64_t packed = ctx->saved_data["a"].toInt();
    auto v = ctx->get_saved_variables();
    const std::array<bool, 4> needs{n[0], n[1], n[2], n[3]};
    auto [dx, dg, dwgu, dwd] = norm_glu_mlp_backward_op().call(
        dy, v[0], opt_of(v[1]), v[2], v[3], v[4], v[5], opt_of(v[6]), (packed & 1) != 0, packed >> 1, needs);
    variable_list out(10);
    const Tensor* g[4] = {&dx, &dg, &dwgu, &dwd};
    for (int i = 0; i < 4; ++i) out[i] = needs[i] ? *g[i] : Tensor();
    if (n[5]) out[5] = dy;
    return first_order("norm_glu_mlp", std::move(out));
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_glu_mlp_autograd(
    const Tensor& x, const OptTensor& norm_weight, const Tensor& w_gate_up, const Tensor& w_down,
    const OptTensor& stats, const OptTensor& residual, bool add_input, double eps, int64_t activation, bool save,
    bool want_stats) {
  if (!any_requires_grad({&x, opt(norm_weight), &w_gate_up, &w_down, opt(residual)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return norm_glu_mlp_op().call(x, norm_weight, w_gate_up, w_down, stats, residual, add_input, eps, activation,
                                  save, want_stats);
  }
  auto o = NormGluMlpFn::apply(x, norm_weight, w_gate_up, w_down, stats, residual, add_input, eps, activation,
                               want_stats);
  return {o[0], o[1], o[2], o[3], o[4]};
}

}  // namespace

CODA_TORCH_OP(norm_glu_mlp,
              "norm_glu_mlp(Tensor x, Tensor? norm_weight, Tensor w_gate_up, Tensor w_down, Tensor? stats,"
              " Tensor? residual, bool add_input, float eps, int activation, bool save, bool want_stats)"
              " -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_TORCH_OP(norm_glu_mlp_backward,
              "norm_glu_mlp_backward(Tensor dy, Tensor x, Tensor? norm_weight, Tensor w_gate_up, Tensor w_down,"
              " Tensor h, Tensor a, Tensor? stats, bool add_input, int activation, bool[4] needs)"
              " -> (Tensor, Tensor, Tensor, Tensor)")

CODA_AUTOGRAD(norm_glu_mlp, norm_glu_mlp_autograd)

}  // namespace coda::torch_ops
