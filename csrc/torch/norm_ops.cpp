// The norm-folding fused ops: row statistics, the weight fold, norm -> Linear
// and norm -> MLP forward and backward, and Linear + residual with the next
// norm's statistics. Row statistics travel as one (2, M) fp32 tensor: row 0
// the mean (0 for RMSNorm), row 1 rstd.
//
//   Norm(x)·Wᵀ + b = rstd ⊙ (x·W̃ᵀ − mean ⊙ s) + t,  W̃ = W∘γ, s = Σ_k W̃, t = W·β + b
#include "autograd.h"
#include "shared_ops.h"
#include "tensors.h"

namespace coda::torch_ops {

namespace {

const float* mean_of(const Tensor& stats, bool layernorm) { return layernorm ? stats.data_ptr<float>() : nullptr; }
const float* rstd_of(const Tensor& stats) { return stats.data_ptr<float>() + stats.stride(0); }

// Given stats as (2, M) rows, or one pass over x.
Tensor stats_for(const Tensor& x, const OptTensor& stats, bool layernorm, double eps) {
  if (stats) {
    expect(stats->dim() == 2 && stats->size(1) == x.size(0), "stats must be float32 (2, M)");
    return stats_rows(*stats);
  }
  Tensor st = stats_buffer(x.size(0), x);
  RowStatsArgs a;
  a.m = x.size(0); a.n = x.size(1);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.layernorm = layernorm;
  a.eps = static_cast<float>(eps);
  a.mean = st.data_ptr<float>();
  a.rstd = st.data_ptr<float>() + st.stride(0);
  check(coda::row_stats(dtype_of(x), a, stream()), "row_stats");
  return st;
}

struct Fold {
  Tensor weight, col_sum, shift;  // W̃, s (undefined for RMSNorm), t
};

Fold fold(const Tensor& w, const Tensor& gamma, const OptTensor& beta, const OptTensor& bias, bool layernorm) {
  const int64_t n = w.size(0), k = w.size(1);
  expect(gamma.numel() == k && (!beta || beta->numel() == k) && (!bias || bias->numel() == n),
         "fold: gamma, beta must be (K,) and bias (N,) for a weight (N, K)");
  Fold f{empty2(n, k, w), layernorm ? f32({n}, w) : Tensor(), f32({n}, w)};
  Tensor g = vec(gamma);
  OptTensor be = vec(beta), bi = vec(bias);
  FoldNormWeightArgs a;
  a.n = n; a.k = k;
  a.weight = w.data_ptr(); a.ldw = w.stride(0);
  a.gamma = g.data_ptr();
  a.beta = ptr(be);
  a.bias = ptr(bi);
  a.folded = f.weight.data_ptr(); a.ld_folded = f.weight.stride(0);
  a.col_sum = layernorm ? f.col_sum.data_ptr<float>() : nullptr;
  a.shift = f.shift.data_ptr<float>();
  check(coda::fold_norm_weight(dtype_of(w), a, stream()), "fold_norm_weight");
  return f;
}

// The fold given by the caller (coda.ops.fold_norm_weight, kept by a module),
// or made now.
Fold fold_for(const Tensor& w, const Tensor& gamma, const OptTensor& beta, const OptTensor& bias,
              const OptTensor& folded, const OptTensor& col_sum, const OptTensor& shift, bool layernorm) {
  if (!folded) return fold(w, gamma, beta, bias, layernorm);
  expect(folded->sizes() == w.sizes() && shift && (!layernorm || col_sum), "folded weight, col_sum, shift mismatch");
  return {rows(*folded), layernorm ? vec(*col_sum) : Tensor(), vec(*shift)};
}

// act(rstd ⊙ (x·W̃ᵀ − mean ⊙ s) + t), with H stored where `h` is given.
void norm_forward(const Tensor& x, const Fold& f, const Tensor& stats, bool layernorm, double eps, Activation act,
                  const Tensor& y, const Tensor* h) {
  NormLinearArgs a;
  a.m = x.size(0); a.n = f.weight.size(0); a.k = x.size(1);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = f.weight.data_ptr(); a.ldw = f.weight.stride(0);
  a.mean = mean_of(stats, layernorm);
  a.rstd = rstd_of(stats);
  a.eps = layernorm ? static_cast<float>(eps) : 0.f;
  a.col_sum = layernorm ? f.col_sum.data_ptr<float>() : nullptr;
  a.shift = f.shift.data_ptr<float>();
  a.activation = act;
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  a.pre_act = h ? h->data_ptr() : nullptr;
  a.ld_pre_act = h ? h->stride(0) : 0;
  call("norm_linear", dtype_of(x), a, x, coda::norm_linear, coda::norm_linear_workspace_size);
}

struct NormGrads {
  Tensor dx, normalized, dgamma, dbeta;
};

// The norm's input gradient in the epilogue of the dgrad GEMM dp·W, with
// dγ, dβ, N̂ for dW = dpᵀ·N̂, and the residual's gradient added.
NormGrads norm_dgrad_of(const Tensor& dp, const Tensor& w, const Tensor& x, const Tensor& stats, bool layernorm,
                        const Tensor& gamma, const OptTensor& beta, const Tensor& c1, const Tensor& c2,
                        const OptTensor& residual_grad, bool want_normalized, bool want_dgamma) {
  const int64_t m = x.size(0), k = x.size(1);
  Tensor g = vec(gamma);
  OptTensor be = vec(beta);
  NormGrads out{empty2(m, k, dp), want_normalized ? empty2(m, k, dp) : Tensor(),
                want_dgamma ? empty1(k, dp) : Tensor(), want_dgamma && be ? empty1(k, dp) : Tensor()};
  NormDgradArgs a;
  a.m = m; a.n = k; a.k = dp.size(1);
  a.dy = dp.data_ptr(); a.lddy = dp.stride(0);
  a.weight = w.data_ptr(); a.ldw = w.stride(0);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.mean = mean_of(stats, layernorm);
  a.rstd = rstd_of(stats);
  a.gamma = g.data_ptr();
  a.beta = ptr(be);
  a.c1 = c1.data_ptr<float>();
  a.c2 = c2.defined() ? c2.data_ptr<float>() : nullptr;
  a.residual_grad = ptr(residual_grad);
  a.ld_residual_grad = residual_grad ? residual_grad->stride(0) : 0;
  a.dx = out.dx.data_ptr(); a.lddx = out.dx.stride(0);
  a.normalized = want_normalized ? out.normalized.data_ptr() : nullptr;
  a.ld_normalized = want_normalized ? out.normalized.stride(0) : 0;
  a.dgamma = want_dgamma ? out.dgamma.data_ptr() : nullptr;
  a.dbeta = out.dbeta.defined() ? out.dbeta.data_ptr() : nullptr;
  call("norm_dgrad", dtype_of(dp), a, dp, coda::norm_dgrad, coda::norm_dgrad_workspace_size);
  return out;
}

Tensor or_none(const Tensor& t, const Tensor& like) { return t.defined() ? t : none(like); }
Tensor or_none_f32(const Tensor& t, const Tensor& like) { return t.defined() ? t : none_f32(like); }

// ---- the ops

Tensor row_stats(const Tensor& x_, bool layernorm, double eps) {
  c10::cuda::CUDAGuard guard(x_.device());
  return stats_for(rows(x_), std::nullopt, layernorm, eps);
}

std::tuple<Tensor, Tensor, Tensor> fold_norm_weight(const Tensor& weight, const Tensor& gamma, const OptTensor& beta,
                                                    const OptTensor& bias, bool layernorm) {
  c10::cuda::CUDAGuard guard(weight.device());
  Fold f = fold(rows(weight), gamma, beta, bias, layernorm);
  return {f.weight, or_none_f32(f.col_sum, weight), f.shift};
}

// -> (y, pre_act, stats, col_sum, shift); the last three (0,) where given
// (a custom op's outputs may not alias its inputs) or unused (s for RMSNorm).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_linear(
    const Tensor& x_, const Tensor& norm_weight, const OptTensor& norm_bias, const Tensor& weight,
    const OptTensor& bias, const OptTensor& stats, const OptTensor& folded, const OptTensor& col_sum,
    const OptTensor& shift, bool layernorm, double eps, int64_t activation, bool save_pre_act) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = rows(x_), w = rows(weight);
  expect(w.size(1) == x.size(1), "norm_linear: weight must be (N, K) for x (M, K)");
  const Activation act = activation_of(activation);
  const bool save = save_pre_act && act != Activation::kIdentity;
  Tensor st = stats_for(x, stats, layernorm, eps);
  Fold f = fold_for(w, norm_weight, norm_bias, bias, folded, col_sum, shift, layernorm);
  Tensor y = empty_rows_of(x_, w.size(0)), h = save ? empty_rows_of(x_, w.size(0)) : none(x);
  Tensor h2 = save ? flat(h) : h;
  norm_forward(x, f, st, layernorm, eps, act, flat(y), save ? &h2 : nullptr);
  return {y, h, stats ? none_f32(x) : st, folded ? none_f32(x) : or_none_f32(f.col_sum, x),
          folded ? none_f32(x) : f.shift};
}

// pre_act: H, or the output y with identity. needs: (dx, dnorm_weight, dnorm_bias, dweight, dbias)
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_linear_backward(
    const Tensor& dy_, const Tensor& x_, const Tensor& norm_weight, const OptTensor& norm_bias, const Tensor& weight,
    const Tensor& pre_act, const Tensor& stats, const OptTensor& col_sum, const Tensor& shift, bool layernorm,
    int64_t activation, std::array<bool, 5> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_), x = rows(x_), w = rows(weight), h = rows(pre_act);
  const int64_t m = dy.size(0), n = dy.size(1), k = x.size(1);
  const Activation act = activation_of(activation);
  Tensor s = layernorm ? vec(*col_sum) : Tensor(), t = vec(shift);
  // One pass over dy and H: dP = dy ⊙ act'(H), the norm's row dots
  // c₁ = mean_n dP ⊙ (H − t), c₂ = mean_n dP ⊙ s and the bias gradient: no
  // GEMM of a lone norm-linear has dP as its output, so no epilogue can.
  const bool identity = act == Activation::kIdentity;
  Tensor dp = identity ? dy : empty2(m, n, dy), c1 = f32({m}, dy), c2 = layernorm ? f32({m}, dy) : Tensor();
  Tensor db = needs[4] ? empty1(n, dy) : Tensor();
  NormRowDotsArgs r;
  r.m = m; r.n = n;
  r.dy = dy.data_ptr(); r.lddy = dy.stride(0);
  r.pre_act = h.data_ptr(); r.ld_pre_act = h.stride(0);
  r.activation = act;
  r.shift = t.data_ptr<float>();
  r.col_sum = layernorm ? s.data_ptr<float>() : nullptr;
  r.scale = 1.f / float(k);  // the row dots are means over the norm's features
  r.dp = identity ? nullptr : dp.data_ptr();
  r.lddp = identity ? 0 : dp.stride(0);
  r.c1 = c1.data_ptr<float>();
  r.c2 = layernorm ? c2.data_ptr<float>() : nullptr;
  r.dbias = needs[4] ? db.data_ptr() : nullptr;
  call("norm_row_dots", dtype_of(dy), r, dy, coda::norm_row_dots, coda::norm_row_dots_workspace_size);
  if (!(needs[0] || needs[1] || needs[2] || needs[3])) return {none(dy), none(dy), none(dy), none(dy), or_none(db, dy)};
  NormGrads g = norm_dgrad_of(dp, w, x, stats_rows(stats), layernorm, norm_weight, norm_bias, c1, c2, std::nullopt, needs[3],
                              needs[1] || needs[2]);
  Tensor dw = needs[3] ? wgrad_of(dp, g.normalized) : none(dy);
  return {needs[0] ? g.dx.view(x_.sizes()) : none(dy), needs[1] ? or_none(g.dgamma, dy) : none(dy),
          needs[2] ? or_none(g.dbeta, dy) : none(dy), dw, or_none(db, dy)};
}

// fc2(act(fc1(Norm(x)))) + residual (x itself with add_input).
// -> (y, h1, a1, stats, col_sum, shift) as norm_linear, and with want_stats
// the row statistics of y for a norm of this one's kind and eps (the next
// block's, from fc2's epilogue), else (0,).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> norm_mlp(
    const Tensor& x_, const Tensor& norm_weight, const OptTensor& norm_bias, const Tensor& w1_, const OptTensor& b1,
    const Tensor& w2_, const OptTensor& b2, const OptTensor& stats, const OptTensor& folded,
    const OptTensor& col_sum, const OptTensor& shift, const OptTensor& residual, bool add_input, bool layernorm,
    double eps, int64_t activation, bool save, bool want_stats) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = rows(x_), w1 = rows(w1_), w2 = rows(w2_);
  const int64_t m = x.size(0), f = w1.size(0), e = w2.size(0);
  expect(w1.size(1) == x.size(1) && w2.size(1) == f, "norm_mlp: w1 must be (F, D) and w2 (E, F)");
  OptTensor r = add_input ? OptTensor(x) : rows(residual);
  expect(!r || (r->size(0) == m && r->size(1) == e), "norm_mlp: residual must be (M, E)");
  const Activation act = activation_of(activation);
  const bool save_h = save && act != Activation::kIdentity;
  Tensor st = stats_for(x, stats, layernorm, eps);
  Fold fo = fold_for(w1, norm_weight, norm_bias, b1, folded, col_sum, shift, layernorm);
  Tensor a1 = empty2(m, f, x), h1 = save_h ? empty2(m, f, x) : none(x);
  norm_forward(x, fo, st, layernorm, eps, act, a1, save_h ? &h1 : nullptr);
  Tensor y_ = empty_rows_of(x_, e), y = flat(y_);
  OptTensor bias2 = vec(b2);
  Tensor out_st = want_stats ? stats_buffer(m, x) : none_f32(x);
  if (want_stats) {
    linear_residual_into(a1, w2, bias2, r, y, layernorm, eps, out_st);
  } else {
    LinearArgs a = residual_gemm_args<LinearArgs>(a1, w2, bias2, r, y);
    call("linear", dtype_of(x), a, x, coda::linear, coda::linear_workspace_size);
  }
  return {y_, h1, save ? a1 : none(x), stats ? none_f32(x) : st,
          folded ? none_f32(x) : or_none_f32(fo.col_sum, x), folded ? none_f32(x) : fo.shift, out_st};
}

// h1: the pre-activation (a1 with identity). needs: (dx, dnorm_weight, dnorm_bias, dw1, db1, dw2, db2)
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> norm_mlp_backward(
    const Tensor& dy_, const Tensor& x_, const Tensor& norm_weight, const OptTensor& norm_bias, const Tensor& w1_,
    const Tensor& w2_, const Tensor& h1_, const Tensor& a1_, const Tensor& stats, const OptTensor& col_sum,
    const Tensor& shift, bool add_input, bool layernorm, int64_t activation, std::array<bool, 7> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_), x = rows(x_), w1 = rows(w1_), w2 = rows(w2_), h1 = rows(h1_), a1 = rows(a1_);
  const int64_t m = dy.size(0), f = w1.size(0);
  const Activation act = activation_of(activation);
  Tensor s = layernorm ? vec(*col_sum) : Tensor(), t = vec(shift);
  Tensor dw2 = needs[5] ? wgrad_of(dy, a1) : none(dy);
  Tensor db2 = needs[6] ? std::get<1>(act_grad_of(dy, std::nullopt, Activation::kIdentity, true)) : none(dy);
  if (!(needs[0] || needs[1] || needs[2] || needs[3] || needs[4])) {
    return {none(dy), none(dy), none(dy), none(dy), none(dy), dw2, db2};
  }
  // fc2's dgrad epilogue: act', db1 and the norm's row dots c₁, c₂ in one pass.
  Tensor dh1 = empty2(m, f, dy), db1 = needs[4] ? empty1(f, dy) : Tensor();
  Tensor c1 = f32({m}, dy), c2 = layernorm ? f32({m}, dy) : Tensor();
  DgradArgs d;
  d.m = m; d.n = f; d.k = dy.size(1);
  d.dy = dy.data_ptr(); d.lddy = dy.stride(0);
  d.weight = w2.data_ptr(); d.ldw = w2.stride(0);
  d.activation = act;
  d.pre_act = h1.data_ptr(); d.ld_pre_act = h1.stride(0);
  d.dx = dh1.data_ptr(); d.lddx = dh1.stride(0);
  d.dbias = needs[4] ? db1.data_ptr() : nullptr;
  d.norm_shift = t.data_ptr<float>();
  d.norm_col_sum = layernorm ? s.data_ptr<float>() : nullptr;
  d.norm_scale = 1.f / float(x.size(1));  // means over the norm's features
  d.norm_c1 = c1.data_ptr<float>();
  d.norm_c2 = layernorm ? c2.data_ptr<float>() : nullptr;
  call("dgrad_rowdot", dtype_of(dy), d, dy, coda::dgrad, coda::dgrad_workspace_size);
  // fc1's dgrad epilogue: the norm's backward, dγ, dβ, N̂ for dw1, and the
  // residual's gradient when x is its own residual.
  NormGrads g = norm_dgrad_of(dh1, w1, x, stats_rows(stats), layernorm, norm_weight, norm_bias, c1, c2,
                              add_input ? OptTensor(dy) : std::nullopt, needs[3], needs[1] || needs[2]);
  Tensor dw1 = needs[3] ? wgrad_of(dh1, g.normalized) : none(dy);
  return {needs[0] ? g.dx.view(x_.sizes()) : none(dy), needs[1] ? or_none(g.dgamma, dy) : none(dy),
          needs[2] ? or_none(g.dbeta, dy) : none(dy), dw1, or_none(db1, dy), dw2, db2};
}

// y = x·Wᵀ + b + residual and the (2, M) row statistics of y, in one GEMM.
std::tuple<Tensor, Tensor> linear_residual(const Tensor& x_, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& residual, bool layernorm, double eps) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = rows(x_), w = rows(weight), r = rows(residual);
  const int64_t m = x.size(0), n = w.size(0);
  expect(w.size(1) == x.size(1) && r.size(0) == m && r.size(1) == n,
         "linear_residual: weight must be (N, K) for x (M, K), residual (M, N)");
  OptTensor b = vec(bias);
  Tensor y_ = empty_rows_of(x_, n), y = flat(y_), st = stats_buffer(m, x);
  linear_residual_into(x, w, b, r, y, layernorm, eps, st);
  return {y_, st};
}

// ---- autograd

CODA_OP_HANDLE(norm_linear)
CODA_OP_HANDLE(norm_linear_backward)
CODA_OP_HANDLE(norm_mlp)
CODA_OP_HANDLE(norm_mlp_backward)
CODA_OP_HANDLE(linear_residual)
CODA_OP_HANDLE_OF(linear_backward, LinearBackwardSig)

// The given tensor where the caller passed it, else the one the op computed
// (the op returns (0,) for what it was given).
Tensor given_or(const OptTensor& given, const Tensor& computed) { return given ? *given : computed; }

// act(Norm(x)·Wᵀ + b). Saves x, γ, β, W, H (y itself with identity), the row
// statistics and the fold's s and t; stats and the fold take no gradient.
struct NormLinearFn : torch::autograd::Function<NormLinearFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& norm_weight,
                               const OptTensor& norm_bias, const Tensor& weight, const OptTensor& bias,
                               const OptTensor& stats, const OptTensor& folded, const OptTensor& col_sum,
                               const OptTensor& shift, bool layernorm, double eps, int64_t activation) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, h, st, s, t] = norm_linear_op().call(x, norm_weight, norm_bias, weight, bias, stats, folded, col_sum,
                                                  shift, layernorm, eps, activation, true);
    const bool identity = activation == int64_t(Activation::kIdentity);
    const Tensor s_used = folded ? given_or(col_sum, Tensor()) : s;
    ctx->save_for_backward({x, norm_weight, norm_bias.value_or(Tensor()), weight, identity ? y : h,
                            given_or(stats, st), layernorm ? s_used : Tensor(), folded ? given_or(shift, t) : t});
    ctx->saved_data["p"] = present_mask({true, true, norm_bias.has_value(), true, bias.has_value(), stats.has_value(),
                                         folded.has_value(), col_sum.has_value(), shift.has_value()});
    ctx->saved_data["a"] = activation << 1 | int64_t(layernorm);
    ctx->mark_non_differentiable({h, st, s, t});
    ctx->set_materialize_grads(false);
    return {y, h, st, s, t};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(12);
    at::AutoDispatchBelowADInplaceOrView below;  // the backward op's own Autograd key has nothing to do
    const auto n = needs_by_arg<5>(ctx, ctx->saved_data["p"].toInt());
    const int64_t packed = ctx->saved_data["a"].toInt();
    auto v = ctx->get_saved_variables();
    const std::array<bool, 5> needs{n[0], n[1], n[2], n[3], n[4]};
    auto [dx, dg, db, dw, dbias] = norm_linear_backward_op().call(
        dy, v[0], v[1], opt_of(v[2]), v[3], v[4], v[5], opt_of(v[6]), v[7], (packed & 1) != 0, packed >> 1, needs);
    variable_list out(12);
    const Tensor* g[5] = {&dx, &dg, &db, &dw, &dbias};
    for (int i = 0; i < 5; ++i) out[i] = needs[i] ? *g[i] : Tensor();
    return first_order("norm_linear", std::move(out));
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_linear_autograd(
    const Tensor& x, const Tensor& norm_weight, const OptTensor& norm_bias, const Tensor& weight,
    const OptTensor& bias, const OptTensor& stats, const OptTensor& folded, const OptTensor& col_sum,
    const OptTensor& shift, bool layernorm, double eps, int64_t activation, bool save_pre_act) {
  if (!any_requires_grad({&x, &norm_weight, opt(norm_bias), &weight, opt(bias)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return norm_linear_op().call(x, norm_weight, norm_bias, weight, bias, stats, folded, col_sum, shift, layernorm,
                                 eps, activation, save_pre_act);
  }
  auto o = NormLinearFn::apply(x, norm_weight, norm_bias, weight, bias, stats, folded, col_sum, shift, layernorm, eps,
                               activation);
  return {o[0], o[1], o[2], o[3], o[4]};
}

// fc2(act(fc1(Norm(x)))) + residual. Saves x, γ, β, W1, W2, H1 (A1 with
// identity), A1, the row statistics and the fold's s and t.
struct NormMlpFn : torch::autograd::Function<NormMlpFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& norm_weight,
                               const OptTensor& norm_bias, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                               const OptTensor& b2, const OptTensor& stats, const OptTensor& folded,
                               const OptTensor& col_sum, const OptTensor& shift, const OptTensor& residual,
                               bool add_input, bool layernorm, double eps, int64_t activation, bool want_stats) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, h1, a1, st, s, t, out_st] = norm_mlp_op().call(x, norm_weight, norm_bias, w1, b1, w2, b2, stats, folded,
                                                            col_sum, shift, residual, add_input, layernorm, eps,
                                                            activation, true, want_stats);
    const bool identity = activation == int64_t(Activation::kIdentity);
    const Tensor s_used = folded ? given_or(col_sum, Tensor()) : s;
    ctx->save_for_backward({x, norm_weight, norm_bias.value_or(Tensor()), w1, w2, identity ? a1 : h1, a1,
                            given_or(stats, st), layernorm ? s_used : Tensor(), folded ? given_or(shift, t) : t});
    ctx->saved_data["p"] = present_mask({true, true, norm_bias.has_value(), true, b1.has_value(), true, b2.has_value(),
                                         stats.has_value(), folded.has_value(), col_sum.has_value(),
                                         shift.has_value(), residual.has_value()});
    ctx->saved_data["a"] = activation << 2 | int64_t(layernorm) << 1 | int64_t(add_input);
    ctx->mark_non_differentiable({h1, a1, st, s, t, out_st});
    ctx->set_materialize_grads(false);
    return {y, h1, a1, st, s, t, out_st};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(17);
    at::AutoDispatchBelowADInplaceOrView below;  // the backward op's own Autograd key has nothing to do
    const auto n = needs_by_arg<12>(ctx, ctx->saved_data["p"].toInt());
    const int64_t packed = ctx->saved_data["a"].toInt();
    auto v = ctx->get_saved_variables();
    const std::array<bool, 7> needs{n[0], n[1], n[2], n[3], n[4], n[5], n[6]};
    auto g = norm_mlp_backward_op().call(dy, v[0], v[1], opt_of(v[2]), v[3], v[4], v[5], v[6], v[7], opt_of(v[8]),
                                         v[9], (packed & 1) != 0, (packed >> 1 & 1) != 0, packed >> 2, needs);
    const Tensor* r[7] = {&std::get<0>(g), &std::get<1>(g), &std::get<2>(g), &std::get<3>(g),
                          &std::get<4>(g), &std::get<5>(g), &std::get<6>(g)};
    variable_list out(17);
    for (int i = 0; i < 7; ++i) out[i] = needs[i] ? *r[i] : Tensor();
    if (n[11]) out[11] = dy;
    return first_order("norm_mlp", std::move(out));
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> norm_mlp_autograd(
    const Tensor& x, const Tensor& norm_weight, const OptTensor& norm_bias, const Tensor& w1, const OptTensor& b1,
    const Tensor& w2, const OptTensor& b2, const OptTensor& stats, const OptTensor& folded,
    const OptTensor& col_sum, const OptTensor& shift, const OptTensor& residual, bool add_input, bool layernorm,
    double eps, int64_t activation, bool save, bool want_stats) {
  if (!any_requires_grad({&x, &norm_weight, opt(norm_bias), &w1, opt(b1), &w2, opt(b2), opt(residual)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return norm_mlp_op().call(x, norm_weight, norm_bias, w1, b1, w2, b2, stats, folded, col_sum, shift, residual,
                              add_input, layernorm, eps, activation, save, want_stats);
  }
  auto o = NormMlpFn::apply(x, norm_weight, norm_bias, w1, b1, w2, b2, stats, folded, col_sum, shift, residual,
                            add_input, layernorm, eps, activation, want_stats);
  return {o[0], o[1], o[2], o[3], o[4], o[5], o[6]};
}

// y = x·Wᵀ + b + residual and the next norm's row statistics (no gradient).
struct LinearResidualFn : torch::autograd::Function<LinearResidualFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               const OptTensor& residual, bool add_input, bool layernorm, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, st] = linear_residual_op().call(x, weight, bias, add_input ? x : *residual, layernorm, eps);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["p"] = present_mask({true, true, bias.has_value(), residual.has_value()});
    ctx->saved_data["a"] = int64_t(add_input);
    ctx->mark_non_differentiable({st});
    ctx->set_materialize_grads(false);
    return {y, st};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(7);
    at::AutoDispatchBelowADInplaceOrView below;  // the backward op's own Autograd key has nothing to do
    const auto n = needs_by_arg<4>(ctx, ctx->saved_data["p"].toInt());
    auto v = ctx->get_saved_variables();
    auto [dx, dw, db] = linear_backward_op().call(dy, v[0], v[1], std::nullopt, int64_t(Activation::kIdentity),
                                                  {n[0], n[1], n[2]});
    if (n[0] && ctx->saved_data["a"].toInt()) dx.add_(dy);
    return first_order("linear_residual", {n[0] ? dx : Tensor(), n[1] ? dw : Tensor(), n[2] ? db : Tensor(),
                                           n[3] ? dy : Tensor(), Tensor(), Tensor(), Tensor()});
  }
};

std::tuple<Tensor, Tensor> linear_residual_autograd(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                                    const Tensor& residual, bool layernorm, double eps) {
  const bool add_input = residual.is_same(x);
  if (!any_requires_grad({&x, &weight, opt(bias), add_input ? nullptr : &residual})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return linear_residual_op().call(x, weight, bias, residual, layernorm, eps);
  }
  auto o = LinearResidualFn::apply(x, weight, bias, add_input ? OptTensor() : OptTensor(residual), add_input,
                                   layernorm, eps);
  return {o[0], o[1]};
}


// ---- Gemma's sandwich norms: y = residual + γ ⊙ RMSNorm(x) (γ = 1 + weight where zero_centered)

Tensor vector_like(const Tensor& w, const Tensor& x, int64_t n, const char* what) {
  expect(w.numel() == n, what);
  return vec(w.to(x.scalar_type()));
}

// -> (y, rstd (m) fp32)
std::tuple<Tensor, Tensor> rmsnorm_residual(const Tensor& x_, const Tensor& weight, const Tensor& residual_,
                                            double eps, bool zero_centered) {
  c10::cuda::CUDAGuard guard(x_.device());
  expect(residual_.sizes() == x_.sizes(), "rmsnorm_residual: residual must have x's shape");
  Tensor x = rows(x_), res = rows(residual_);
  const int64_t m = x.size(0), n = x.size(1);
  Tensor w = vector_like(weight, x, n, "rmsnorm_residual: weight must be (features,)");
  Tensor y = empty_rows_of(x_, n), rstd = f32({m}, x);
  RmsNormResidualArgs a;
  a.m = m; a.n = n;
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = w.data_ptr(); a.zero_centered = zero_centered;
  a.eps = static_cast<float>(eps);
  a.residual = res.data_ptr(); a.ld_residual = res.stride(0);
  Tensor y2 = flat(y);
  a.y = y2.data_ptr(); a.ldy = y2.stride(0);
  a.rstd = rstd.data_ptr<float>();
  check(coda::rmsnorm_residual(dtype_of(x), a, stream()), "rmsnorm_residual");
  return {y, rstd};
}

// needs: (dx, dweight); the residual's gradient is dy (the autograd's)
std::tuple<Tensor, Tensor> rmsnorm_residual_backward(const Tensor& dy_, const Tensor& x_, const Tensor& weight,
                                                     const Tensor& rstd, bool zero_centered,
                                                     std::array<bool, 2> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_), x = rows(x_);
  const int64_t m = x.size(0), n = x.size(1);
  Tensor w = vector_like(weight, x, n, "rmsnorm_residual_backward: weight must be (features,)");
  Tensor dx = empty2(m, n, x);
  Tensor partials = needs[1] ? f32({coda::rmsnorm_residual_partials(m), n}, x) : none_f32(x);
  RmsNormResidualBackwardArgs a;
  a.m = m; a.n = n;
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = w.data_ptr(); a.zero_centered = zero_centered;
  Tensor r = vec(rstd);
  a.rstd = r.data_ptr<float>();
  a.dx = dx.data_ptr(); a.lddx = dx.stride(0);
  a.dweight_partials = needs[1] && partials.numel() ? partials.data_ptr<float>() : nullptr;
  check(coda::rmsnorm_residual_backward(dtype_of(x), a, stream()), "rmsnorm_residual_backward");
  Tensor dw = needs[1] ? sum_partials(partials, n, weight) : none(dy);
  return {needs[0] ? dx.view(x_.sizes()) : none(dy), dw};
}

CODA_OP_HANDLE(rmsnorm_residual)
CODA_OP_HANDLE(rmsnorm_residual_backward)

// Saves x, weight and the forward's rstd.
struct RmsNormResidualFn : torch::autograd::Function<RmsNormResidualFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& residual,
                               double eps, bool zero_centered) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, rstd] = rmsnorm_residual_op().call(x, weight, residual, eps, zero_centered);
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["z"] = zero_centered;
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {y, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(5);
    at::AutoDispatchBelowADInplaceOrView below;
    const std::array<bool, 2> needs{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto v = ctx->get_saved_variables();
    Tensor dx, dw;
    if (needs[0] || needs[1]) {
      std::tie(dx, dw) = rmsnorm_residual_backward_op().call(dy, v[0], v[1], v[2], ctx->saved_data["z"].toBool(),
                                                             needs);
    }
    return first_order("rmsnorm_residual", {needs[0] ? dx : Tensor(), needs[1] ? dw : Tensor(),
                                            ctx->needs_input_grad(2) ? dy : Tensor(), Tensor(), Tensor()});
  }
};

std::tuple<Tensor, Tensor> rmsnorm_residual_autograd(const Tensor& x, const Tensor& weight, const Tensor& residual,
                                                     double eps, bool zero_centered) {
  if (!any_requires_grad({&x, &weight, &residual})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return rmsnorm_residual_op().call(x, weight, residual, eps, zero_centered);
  }
  auto o = RmsNormResidualFn::apply(x, weight, residual, eps, zero_centered);
  return {o[0], o[1]};
}

}  // namespace

void linear_residual_into(const Tensor& x, const Tensor& w, const OptTensor& bias, const OptTensor& residual,
                          const Tensor& y, bool layernorm, double eps, const Tensor& st) {
  LinearResidualArgs a = residual_gemm_args<LinearResidualArgs>(x, w, bias, residual, y);
  a.layernorm = layernorm;
  a.eps = static_cast<float>(eps);
  a.mean = st.data_ptr<float>();
  a.rstd = st.data_ptr<float>() + st.stride(0);
  call("linear_residual", dtype_of(x), a, x, coda::linear_residual, coda::linear_residual_workspace_size);
}

// ---- for the LLaMA path's ops (glu_ops.cpp, rope_ops.cpp): RMSNorm only

Tensor rms_stats_of(const Tensor& x, const OptTensor& stats, double eps) { return stats_for(x, stats, false, eps); }

std::tuple<Tensor, Tensor> rms_fold_of(const Tensor& w, const Tensor& gamma, const OptTensor& bias) {
  Fold f = fold(w, gamma, std::nullopt, bias, false);
  return {f.weight, f.shift};
}

std::tuple<Tensor, Tensor, Tensor> rms_dgrad_of(const Tensor& dp, const Tensor& w, const Tensor& x,
                                                const Tensor& stats, const Tensor& gamma, const Tensor& c1,
                                                const OptTensor& residual_grad, bool want_normalized,
                                                bool want_dgamma) {
  NormGrads g = norm_dgrad_of(dp, w, x, stats_rows(stats), false, gamma, std::nullopt, c1, Tensor(), residual_grad,
                              want_normalized, want_dgamma);
  return {g.dx, g.normalized, g.dgamma};
}

CODA_TORCH_OP(row_stats, "row_stats(Tensor x, bool layernorm, float eps) -> Tensor")
CODA_TORCH_OP(fold_norm_weight,
              "fold_norm_weight(Tensor weight, Tensor gamma, Tensor? beta, Tensor? bias, bool layernorm)"
              " -> (Tensor, Tensor, Tensor)")
CODA_TORCH_OP(norm_linear,
              "norm_linear(Tensor x, Tensor norm_weight, Tensor? norm_bias, Tensor weight, Tensor? bias,"
              " Tensor? stats, Tensor? folded, Tensor? col_sum, Tensor? shift, bool layernorm, float eps,"
              " int activation, bool save_pre_act) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_TORCH_OP(norm_linear_backward,
              "norm_linear_backward(Tensor dy, Tensor x, Tensor norm_weight, Tensor? norm_bias, Tensor weight,"
              " Tensor pre_act, Tensor stats, Tensor? col_sum, Tensor shift, bool layernorm, int activation,"
              " bool[5] needs) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_TORCH_OP(norm_mlp,
              "norm_mlp(Tensor x, Tensor norm_weight, Tensor? norm_bias, Tensor w1, Tensor? b1, Tensor w2,"
              " Tensor? b2, Tensor? stats, Tensor? folded, Tensor? col_sum, Tensor? shift, Tensor? residual,"
              " bool add_input, bool layernorm, float eps, int activation, bool save, bool want_stats)"
              " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_TORCH_OP(norm_mlp_backward,
              "norm_mlp_backward(Tensor dy, Tensor x, Tensor norm_weight, Tensor? norm_bias, Tensor w1, Tensor w2,"
              " Tensor h1, Tensor a1, Tensor stats, Tensor? col_sum, Tensor shift, bool add_input, bool layernorm,"
              " int activation, bool[7] needs) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_TORCH_OP(linear_residual,
              "linear_residual(Tensor x, Tensor weight, Tensor? bias, Tensor residual, bool layernorm, float eps)"
              " -> (Tensor, Tensor)")

CODA_TORCH_OP(rmsnorm_residual,
              "rmsnorm_residual(Tensor x, Tensor weight, Tensor residual, float eps, bool zero_centered)"
              " -> (Tensor, Tensor)")
CODA_TORCH_OP(rmsnorm_residual_backward,
              "rmsnorm_residual_backward(Tensor dy, Tensor x, Tensor weight, Tensor rstd, bool zero_centered,"
              " bool[2] needs) -> (Tensor, Tensor)")

CODA_AUTOGRAD(rmsnorm_residual, rmsnorm_residual_autograd)
CODA_AUTOGRAD(norm_linear, norm_linear_autograd)
CODA_AUTOGRAD(norm_mlp, norm_mlp_autograd)
CODA_AUTOGRAD(linear_residual, linear_residual_autograd)

}  // namespace coda::torch_ops
