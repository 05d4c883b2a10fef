// The Linear and MLP fused ops, forward and backward, each one call from
// Python that launches every kernel of its direction.
#include <atomic>

#include "autograd.h"
#include "tensors.h"

namespace coda::torch_ops {

namespace {

// act(x·wᵀ + bias) + residual, with H = x·wᵀ + bias where `h` is given.
void forward(const Tensor& x, const Tensor& w, const OptTensor& bias, const OptTensor& residual, Activation act,
             const Tensor& y, const Tensor* h) {
  LinearArgs a = residual_gemm_args<LinearArgs>(x, w, bias, residual, y);
  a.activation = act;
  a.pre_act = h ? h->data_ptr() : nullptr;
  a.ld_pre_act = h ? h->stride(0) : 0;
  call("linear", dtype_of(x), a, x, coda::linear, coda::linear_workspace_size);
}

}  // namespace

namespace {
int sm_count(int device) {  // asked once per device
  static std::atomic<int> counts[64];
  if (device < 0 || device >= 64) return 0;
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}
}  // namespace

// dx = (dy·w) ⊙ act'(h), and Σ_rows dx into `dbias` where it is defined: coda's
// kernel, or cuBLAS's where there is no epilogue work (coda::dgrad_prefers_vendor_gemm).
Tensor dgrad_of(const Tensor& dy, const Tensor& w, const OptTensor& h, Activation act, const Tensor& dbias) {
  const int64_t m = dy.size(0), n = w.size(1);
  if (act == Activation::kIdentity && !dbias.defined() &&
      coda::dgrad_prefers_vendor_gemm(m, n, dy.size(1), sm_count(c10::cuda::current_device()))) {
    return at::mm(dy, w);
  }
  Tensor dx = empty2(m, n, dy);
  DgradArgs a;
  a.m = m; a.n = n; a.k = dy.size(1);
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.weight = w.data_ptr(); a.ldw = w.stride(0);
  a.activation = act;
  a.pre_act = ptr(h);
  a.ld_pre_act = h ? h->stride(0) : 0;
  a.dx = dx.data_ptr(); a.lddx = dx.stride(0);
  a.dbias = dbias.defined() ? dbias.data_ptr() : nullptr;
  call("dgrad", dtype_of(dy), a, dy, coda::dgrad, coda::dgrad_workspace_size);
  return dx;
}

// dw = dyᵀ·x: coda's kernel, or cuBLAS where its tiles would leave most SMs
// idle (coda::wgrad_prefers_vendor_gemm).
Tensor wgrad_of(const Tensor& dy, const Tensor& x) {
  const int sms = sm_count(c10::cuda::current_device());
  if (coda::wgrad_prefers_vendor_gemm(dy.size(1), x.size(1), dy.size(0), sms)) {
    return at::mm(dy.t(), x);
  }
  Tensor dw = empty2(dy.size(1), x.size(1), dy);
  WgradArgs a;
  a.m = dy.size(1); a.n = x.size(1); a.k = dy.size(0);
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.dw = dw.data_ptr(); a.lddw = dw.stride(0);
  call("wgrad", dtype_of(dy), a, dy, coda::wgrad, coda::wgrad_workspace_size);
  return dw;
}

// One pass over dy (and h): dh = dy ⊙ act'(h) (dy itself for identity) and,
// when wanted, Σ_rows dh. Returns (dh, dbias or undefined).
std::tuple<Tensor, Tensor> act_grad_of(const Tensor& dy, const OptTensor& h, Activation act, bool want_dbias) {
  const int64_t m = dy.size(0), n = dy.size(1);
  const bool identity = act == Activation::kIdentity;
  Tensor dh = identity ? dy : empty2(m, n, dy);
  Tensor db = want_dbias ? empty1(n, dy) : Tensor();
  if (identity && !want_dbias) return {dh, db};
  NormRowDotsArgs a;
  a.m = m; a.n = n;
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.pre_act = ptr(h);
  a.ld_pre_act = h ? h->stride(0) : 0;
  a.activation = act;
  a.dp = identity ? nullptr : dh.data_ptr();
  a.lddp = identity ? 0 : dh.stride(0);
  a.dbias = want_dbias ? db.data_ptr() : nullptr;
  call("act_grad", dtype_of(dy), a, dy, coda::norm_row_dots, coda::norm_row_dots_workspace_size);
  return {dh, db};
}

namespace {

Tensor or_none(const Tensor& t, const Tensor& like) { return t.defined() ? t : none(like); }

std::tuple<Tensor, Tensor> linear(const Tensor& x_, const Tensor& weight, const OptTensor& bias,
                                  const OptTensor& residual, int64_t activation, bool save_pre_act) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = rows(x_), w = rows(weight);
  const int64_t m = x.size(0), n = w.size(0);
  expect(w.size(1) == x.size(1), "linear: weight must be (N, K) for x (M, K)");
  expect(!bias || bias->numel() == n, "linear: bias must be (N,)");
  OptTensor r = rows(residual);
  expect(!r || (r->size(0) == m && r->size(1) == n), "linear: residual must be (M, N)");
  const Activation act = activation_of(activation);
  const bool save = save_pre_act && act != Activation::kIdentity;
  Tensor y = empty_rows_of(x_, n), h = save ? empty_rows_of(x_, n) : none(x);
  Tensor h2 = save ? flat(h) : h;
  forward(x, w, vec(bias), r, act, flat(y), save ? &h2 : nullptr);
  return {y, h};
}

// needs: (dx, dweight, dbias)
std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& dy_, const Tensor& x_, const Tensor& weight,
                                                   const OptTensor& pre_act, int64_t activation,
                                                   std::array<bool, 3> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_), x = rows(x_), w = rows(weight);
  const Activation act = activation_of(activation);
  expect(act == Activation::kIdentity || (pre_act && pre_act->sizes() == dy.sizes()),
         "linear_backward: pre_act must be (M, N) with an activation");
  // A lone Linear gets dy from outside: act' needs its own pass here, which
  // also reduces the bias gradient (coda::mlp folds both into fc2's dgrad).
  auto [dh, db] = act_grad_of(dy, rows(pre_act), act, needs[2]);
  Tensor dx = needs[0] ? dgrad_of(dh, w, std::nullopt, Activation::kIdentity, Tensor()).view(x_.sizes()) : none(dy);
  Tensor dw = needs[1] ? wgrad_of(dh, x) : none(dy);
  return {dx, dw, or_none(db, dy)};
}

std::tuple<Tensor, Tensor, Tensor> mlp(const Tensor& x_, const Tensor& w1_, const OptTensor& b1, const Tensor& w2_,
                                       const OptTensor& b2, const OptTensor& residual, int64_t activation, bool save) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = rows(x_), w1 = rows(w1_), w2 = rows(w2_);
  const int64_t m = x.size(0), f = w1.size(0), e = w2.size(0);
  expect(w1.size(1) == x.size(1) && w2.size(1) == f, "mlp: w1 must be (F, D) and w2 (E, F)");
  OptTensor r = rows(residual);
  expect(!r || (r->size(0) == m && r->size(1) == e), "mlp: residual must be (M, E)");
  const Activation act = activation_of(activation);
  const bool save_h = save && act != Activation::kIdentity;
  Tensor a1 = empty2(m, f, x), h1 = save_h ? empty2(m, f, x) : none(x);
  forward(x, w1, vec(b1), std::nullopt, act, a1, save_h ? &h1 : nullptr);
  Tensor y = empty_rows_of(x_, e);
  forward(a1, w2, vec(b2), r, Activation::kIdentity, flat(y), nullptr);
  return {y, h1, save ? a1 : none(x)};
}

// h1: the pre-activation (a1 with identity). needs: (dx, dw1, db1, dw2, db2)
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mlp_backward(const Tensor& dy_, const Tensor& x_, const Tensor& w1_,
                                                                const Tensor& w2_, const Tensor& h1, const Tensor& a1,
                                                                int64_t activation, std::array<bool, 5> needs) {
  c10::cuda::CUDAGuard guard(dy_.device());
  Tensor dy = rows(dy_), x = rows(x_), w1 = rows(w1_), w2 = rows(w2_);
  const Activation act = activation_of(activation);
  Tensor dw2 = needs[3] ? wgrad_of(dy, rows(a1)) : none(dy);
  Tensor db2 = needs[4] ? std::get<1>(act_grad_of(dy, std::nullopt, Activation::kIdentity, true)) : none(dy);
  Tensor dx = none(dy), dw1 = none(dy), db1 = needs[2] ? empty1(w1.size(0), dy) : none(dy);
  if (needs[0] || needs[1] || needs[2]) {
    // fc2's dgrad epilogue applies act' (with the saved h1) and reduces db1:
    // no pass over the (M, F) activation gradient.
    OptTensor h = act == Activation::kIdentity ? OptTensor() : OptTensor(rows(h1));
    Tensor dh1 = dgrad_of(dy, w2, h, act, needs[2] ? db1 : Tensor());
    if (needs[1]) dw1 = wgrad_of(dh1, x);
    if (needs[0]) dx = dgrad_of(dh1, w1, std::nullopt, Activation::kIdentity, Tensor()).view(x_.sizes());
  }
  return {dx, dw1, db1, dw2, db2};
}

// ---- autograd

CODA_OP_HANDLE(linear)
CODA_OP_HANDLE_OF(linear_backward, LinearBackwardSig)
CODA_OP_HANDLE(mlp)
CODA_OP_HANDLE(mlp_backward)

// x as its own residual (y = f(x) + x) enters a Function once: its gradient
// is dx + dy, added in the backward.
bool is_input(const OptTensor& residual, const Tensor& x) { return residual && residual->is_same(x); }

// y = act(x·Wᵀ + b) + residual. Saves x, W and H (the pre-activation, (0,)
// with identity).
struct LinearFn : torch::autograd::Function<LinearFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const OptTensor& bias,
                               const OptTensor& residual, bool add_input, int64_t activation) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, h] = linear_op().call(x, w, bias, add_input ? OptTensor(x) : residual, activation, true);
    ctx->save_for_backward({x, w, h});
    ctx->saved_data["p"] = present_mask({true, true, bias.has_value(), residual.has_value()});
    ctx->saved_data["a"] = activation << 1 | int64_t(add_input);
    ctx->mark_non_differentiable({h});
    ctx->set_materialize_grads(false);
    return {y, h};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(6);
    at::AutoDispatchBelowADInplaceOrView below;  // the backward op's own Autograd key has nothing to do
    const auto n = needs_by_arg<4>(ctx, ctx->saved_data["p"].toInt());
    const int64_t packed = ctx->saved_data["a"].toInt();
    const bool add_input = packed & 1;
    auto saved = ctx->get_saved_variables();
    auto [dx, dw, db] = linear_backward_op().call(dy, saved[0], saved[1], opt_of(saved[2]), packed >> 1,
                                                  {n[0], n[1], n[2]});
    if (n[0] && add_input) dx.add_(dy);
    return first_order("linear", {n[0] ? dx : Tensor(), n[1] ? dw : Tensor(), n[2] ? db : Tensor(),
                                  n[3] ? dy : Tensor(), Tensor(), Tensor()});
  }
};

std::tuple<Tensor, Tensor> linear_autograd(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                           const OptTensor& residual, int64_t activation, bool save_pre_act) {
  const bool add_input = is_input(residual, x);
  if (!any_requires_grad({&x, &weight, opt(bias), add_input ? nullptr : opt(residual)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return linear_op().call(x, weight, bias, residual, activation, save_pre_act);
  }
  auto out = LinearFn::apply(x, weight, bias, add_input ? std::nullopt : residual, add_input, activation);
  return {out[0], out[1]};
}

// y = fc2(act(fc1(x))) + residual. Saves x, W1, W2, H1 (A1 with identity) and A1.
struct MlpFn : torch::autograd::Function<MlpFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const OptTensor& b1,
                               const Tensor& w2, const OptTensor& b2, const OptTensor& residual, bool add_input,
                               int64_t activation) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, h1, a1] = mlp_op().call(x, w1, b1, w2, b2, add_input ? OptTensor(x) : residual, activation, true);
    ctx->save_for_backward({x, w1, w2, activation == int64_t(Activation::kIdentity) ? a1 : h1, a1});
    ctx->saved_data["p"] = present_mask({true, true, b1.has_value(), true, b2.has_value(), residual.has_value()});
    ctx->saved_data["a"] = activation << 1 | int64_t(add_input);
    ctx->mark_non_differentiable({h1, a1});
    ctx->set_materialize_grads(false);
    return {y, h1, a1};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(8);
    at::AutoDispatchBelowADInplaceOrView below;  // the backward op's own Autograd key has nothing to do
    const auto n = needs_by_arg<6>(ctx, ctx->saved_data["p"].toInt());
    const int64_t packed = ctx->saved_data["a"].toInt();
    auto s = ctx->get_saved_variables();
    auto [dx, dw1, db1, dw2, db2] = mlp_backward_op().call(dy, s[0], s[1], s[2], s[3], s[4], packed >> 1,
                                                           {n[0], n[1], n[2], n[3], n[4]});
    if (n[0] && (packed & 1)) dx.add_(dy);
    return first_order("mlp", {n[0] ? dx : Tensor(), n[1] ? dw1 : Tensor(), n[2] ? db1 : Tensor(),
                               n[3] ? dw2 : Tensor(), n[4] ? db2 : Tensor(), n[5] ? dy : Tensor(), Tensor(),
                               Tensor()});
  }
};

std::tuple<Tensor, Tensor, Tensor> mlp_autograd(const Tensor& x, const Tensor& w1, const OptTensor& b1,
                                                const Tensor& w2, const OptTensor& b2, const OptTensor& residual,
                                                int64_t activation, bool save) {
  const bool add_input = is_input(residual, x);
  if (!any_requires_grad({&x, &w1, opt(b1), &w2, opt(b2), add_input ? nullptr : opt(residual)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return mlp_op().call(x, w1, b1, w2, b2, residual, activation, save);
  }
  auto out = MlpFn::apply(x, w1, b1, w2, b2, add_input ? std::nullopt : residual, add_input, activation);
  return {out[0], out[1], out[2]};
}

}  // namespace

CODA_TORCH_OP(linear,
              "linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, int activation, bool save_pre_act)"
              " -> (Tensor, Tensor)")
CODA_TORCH_OP(linear_backward,
              "linear_backward(Tensor dy, Tensor x, Tensor weight, Tensor? pre_act, int activation, bool[3] needs)"
              " -> (Tensor, Tensor, Tensor)")
CODA_TORCH_OP(mlp,
              "mlp(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor? residual, int activation,"
              " bool save) -> (Tensor, Tensor, Tensor)")
CODA_TORCH_OP(mlp_backward,
              "mlp_backward(Tensor dy, Tensor x, Tensor w1, Tensor w2, Tensor h1, Tensor a1, int activation,"
              " bool[5] needs) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_AUTOGRAD(linear, linear_autograd)
CODA_AUTOGRAD(mlp, mlp_autograd)

}  // namespace coda::torch_ops
