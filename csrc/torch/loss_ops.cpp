// The LM head + cross-entropy, with no (tokens, vocab) tensor in memory.
//
// Tokens go in chunks: per chunk the LM-head GEMM writes its logits into one
// reused buffer, the cross-entropy kernel (csrc/cross_entropy_kernels.cu)
// turns them into the loss and, in place, d loss / d logits, and two GEMMs
// take that to dX (the chunk's rows, complete) and dW (accumulated over the
// chunks). So the peak extra memory is one chunk of logits in x's dtype (and
// a float32 dX, below), and
// the gradients are ready when the forward returns: with a mean or a sum the
// backward only scales them by the upstream gradient. With reduction "none"
// the upstream gradient differs per row and the forward cannot know it, so
// the backward recomputes the chunks instead (one more GEMM per chunk).
//
// The trade-off is the chunk: dW is read and written once per chunk, so few
// chunks cost memory (C·V·2 bytes) and many cost dW traffic (4·V·D bytes
// each); the lm_head benchmark times chunks of 1024 and 4096 tokens beside the default.
#include "autograd.h"
#include "tensors.h"

namespace coda::torch_ops {

namespace {

enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

struct CeParams {
  int64_t ignore_index;
  double label_smoothing, softcap, z_loss;
};

// Tokens per chunk: one chunk of logits (rows padded to 8) and `reserve`
// bytes (a float32 dX) within 1/8 of the fp32 logits, so 4 chunks at least,
// and at most 512 MiB of logits per chunk; chunks of equal size.
int64_t chunk_rows(int64_t m, int64_t n, int64_t requested, int64_t reserve) {
  if (requested > 0) return std::min(requested, std::max<int64_t>(m, 1));
  const int64_t row_bytes = (n + 7) / 8 * 8 * 2;
  const int64_t budget = std::min<int64_t>(m * n / 2 - reserve, int64_t(512) << 20);
  const int64_t rows = std::max<int64_t>(1, std::min(m / 4, budget / row_bytes));
  const int64_t chunks = (m + rows - 1) / rows;
  return std::max<int64_t>(1, std::min(rows, (m + chunks - 1) / chunks));
}

// The gradients one pass returns: (dx, dw, db), (0,) where not needed.
// scaled_later: the forward's gradients of a mean or sum, which the backward
// scales; db is then float32 (and dX where alloc_grads made it so), rounded
// once after the scaling.
struct Grads {
  Tensor dx, dw, db;
  bool scaled_later = false;
};

// The chunk loop. row_grad (m,) or grad_scale (): the gradient's scales.
// Returns the per-row losses (m,) and the log-sum-exps (m,).
std::pair<Tensor, Tensor> run_chunks(const Tensor& x, const Tensor& w, const OptTensor& bias, const Tensor& target,
                                     const CeParams& p, int64_t chunk, const OptTensor& grad_scale,
                                     const OptTensor& row_grad, std::array<bool, 3> needs, Grads& g) {
  const int64_t m = x.size(0), n = w.size(0);
  const bool grad = needs[0] || needs[1] || needs[2];
  Tensor loss = f32({m}, x), lse = f32({m}, x);
  const int64_t reserve = needs[0] && g.dx.scalar_type() == at::kFloat ? g.dx.nbytes() : 0;
  const int64_t c = chunk_rows(m, n, chunk, reserve), ldp = (n + 7) / 8 * 8;
  Tensor buffer = at::empty({std::min(c, m), ldp}, x.options());
  Tensor db32 = needs[2] ? at::zeros({n}, x.options().dtype(at::kFloat)) : Tensor();
  const Tensor wt = w.t();
  for (int64_t s = 0; s < m; s += c) {
    const int64_t len = std::min(c, m - s);
    Tensor xc = x.narrow(0, s, len), z = buffer.narrow(0, 0, len).narrow(1, 0, n);
    if (bias) {
      at::addmm_out(z, *bias, xc, wt);
    } else {
      at::mm_out(z, xc, wt);
    }
    CrossEntropyArgs a;
    a.m = len; a.n = n;
    a.logits = z.data_ptr(); a.ld = ldp;
    a.target = target.data_ptr<int64_t>() + s;
    a.ignore_index = p.ignore_index;
    a.label_smoothing = float(p.label_smoothing);
    a.softcap = float(p.softcap);
    a.z_loss = float(p.z_loss);
    a.grad_scale = f32_ptr(grad_scale);
    a.row_grad = row_grad ? row_grad->data_ptr<float>() + s : nullptr;
    a.write_grad = grad;
    a.loss = loss.data_ptr<float>() + s;
    a.lse = lse.data_ptr<float>() + s;
    check(coda::cross_entropy(dtype_of(x), a, stream()), "cross_entropy");
    if (needs[0]) {
      Tensor dxc = g.dx.narrow(0, s, len);
      if (g.dx.scalar_type() != z.scalar_type()) {
        at::mm_out(dxc, z, w, g.dx.scalar_type());
      } else {
        at::mm_out(dxc, z, w);
      }
    }
    if (needs[1]) {
      if (s == 0) {
        at::mm_out(g.dw, z.t(), xc);
      } else {
        g.dw.addmm_(z.t(), xc);
      }
    }
    if (needs[2]) db32.add_(z.sum(0, false, at::kFloat));
  }
  if (needs[2]) g.db = g.scaled_later ? db32 : db32.to(x.scalar_type());
  return {loss, lse};
}

Tensor target_of(const Tensor& target, int64_t m) {
  expect(target.numel() == m && (target.scalar_type() == at::kLong || target.scalar_type() == at::kInt),
         "linear_cross_entropy: target must be int64 (or int32) with one class per row of x");
  return target.reshape({m}).to(at::kLong).contiguous();
}

// scaled_later: dX in float32 where it takes at most half the memory bound
// (D ≤ V/16), so that the backward's scaling rounds it once, as torch's path
// rounds its dX once.
Grads alloc_grads(const Tensor& x, const Tensor& w, const OptTensor& bias, std::array<bool, 3> needs,
                  bool scaled_later = false) {
  const bool dx_float = scaled_later && x.size(1) * 16 <= w.size(0);
  return {needs[0] ? at::empty_like(x, dx_float ? x.options().dtype(at::kFloat) : x.options()) : none(x),
          needs[1] ? at::empty_like(w) : none(x), needs[2] && bias ? Tensor() : none(x), scaled_later};
}

// -> (loss: () for mean/sum, target's shape for none; lse (m,); dx, dw, db for
// mean and sum where `needs`, scaled for an upstream gradient of 1).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_cross_entropy(
    const Tensor& x_, const Tensor& weight, const OptTensor& bias, const Tensor& target_, int64_t ignore_index,
    double label_smoothing, double softcap, double z_loss, int64_t reduction, int64_t chunk,
    std::array<bool, 3> needs) {
  c10::cuda::CUDAGuard guard(x_.device());
  expect(reduction >= kNone && reduction <= kSum, "linear_cross_entropy: reduction code must be 0, 1 or 2");
  Tensor x = x_.reshape({-1, x_.size(-1)}).contiguous(), w = weight.contiguous();
  expect(w.dim() == 2 && w.size(1) == x.size(1), "linear_cross_entropy: weight must be (V, D) for x (..., D)");
  const int64_t m = x.size(0);
  Tensor target = target_of(target_, m);
  if (reduction == kNone) needs = {false, false, false};
  needs[2] = needs[2] && bias.has_value();
  OptTensor b = bias ? OptTensor(bias->contiguous()) : std::nullopt;
  // The mean's divisor stays on the device: no sync for the count of rows not ignored.
  Tensor valid = reduction == kMean ? (target != ignore_index).sum().to(at::kFloat) : Tensor();
  OptTensor scale = reduction == kMean ? OptTensor(valid.reciprocal()) : std::nullopt;
  Grads g = alloc_grads(x, w, b, needs, /*scaled_later=*/true);
  auto [loss, lse] = run_chunks(x, w, b, target, {ignore_index, label_smoothing, softcap, z_loss}, chunk, scale,
                                std::nullopt, needs, g);
  Tensor out = reduction == kNone ? loss.view(target_.sizes())
               : reduction == kSum ? loss.sum()
                                   : loss.sum() / valid;  // 0/0 = NaN when every row is ignored, as torch's mean
  if (!g.db.defined()) g.db = none(x);
  return {out, lse, needs[0] ? g.dx.view(x_.sizes()) : g.dx, g.dw, g.db};
}

// Reduction "none": the gradients of Σ grad_loss ⊙ loss, by recomputing the chunks.
std::tuple<Tensor, Tensor, Tensor> linear_cross_entropy_backward(
    const Tensor& grad_loss, const Tensor& x_, const Tensor& weight, const OptTensor& bias, const Tensor& target_,
    int64_t ignore_index, double label_smoothing, double softcap, double z_loss, int64_t chunk,
    std::array<bool, 3> needs) {
  c10::cuda::CUDAGuard guard(x_.device());
  Tensor x = x_.reshape({-1, x_.size(-1)}).contiguous(), w = weight.contiguous();
  const int64_t m = x.size(0);
  Tensor target = target_of(target_, m);
  needs[2] = needs[2] && bias.has_value();
  OptTensor b = bias ? OptTensor(bias->contiguous()) : std::nullopt;
  Tensor rg = grad_loss.reshape({m}).to(at::kFloat).contiguous();
  Grads g = alloc_grads(x, w, b, needs);
  run_chunks(x, w, b, target, {ignore_index, label_smoothing, softcap, z_loss}, chunk, std::nullopt, rg, needs, g);
  if (!g.db.defined()) g.db = none(x);
  return {needs[0] ? g.dx.view(x_.sizes()) : g.dx, g.dw, g.db};
}

CODA_OP_HANDLE(linear_cross_entropy)
CODA_OP_HANDLE(linear_cross_entropy_backward)

// Mean and sum save the gradients the forward computed; none saves x, W, b
// and the targets to recompute them.
struct LinearCrossEntropyFn : torch::autograd::Function<LinearCrossEntropyFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               const Tensor& target, int64_t ignore_index, double label_smoothing, double softcap,
                               double z_loss, int64_t reduction, int64_t chunk) {
    at::AutoDispatchBelowADInplaceOrView below;
    const std::array<bool, 3> needs{x.requires_grad(), weight.requires_grad(), bias && bias->requires_grad()};
    auto [loss, lse, dx, dw, db] = linear_cross_entropy_op().call(
        x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction, chunk, needs);
    if (reduction == kNone) {
      ctx->save_for_backward({x, weight, bias ? *bias : none(x), target});
      ctx->saved_data["ii"] = ignore_index;
      ctx->saved_data["ls"] = label_smoothing;
      ctx->saved_data["cap"] = softcap;
      ctx->saved_data["z"] = z_loss;
      ctx->saved_data["chunk"] = chunk;
    } else {
      ctx->save_for_backward({dx, dw, db});
    }
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["dt_x"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["dt_b"] = static_cast<int64_t>(bias ? bias->scalar_type() : x.scalar_type());
    ctx->saved_data["p"] = present_mask({true, true, bias.has_value(), true});
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {loss, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dl = grads[0];
    if (!dl.defined()) return variable_list(10);
    at::AutoDispatchBelowADInplaceOrView below;
    const auto n = needs_by_arg<3>(ctx, ctx->saved_data["p"].toInt());
    auto v = ctx->get_saved_variables();
    variable_list out(10);
    if (ctx->saved_data["reduction"].toInt() == kNone) {
      const OptTensor bias = opt_of(v[2]);
      auto [dx, dw, db] = linear_cross_entropy_backward_op().call(
          dl, v[0], v[1], bias, v[3], ctx->saved_data["ii"].toInt(), ctx->saved_data["ls"].toDouble(),
          ctx->saved_data["cap"].toDouble(), ctx->saved_data["z"].toDouble(), ctx->saved_data["chunk"].toInt(),
          {n[0], n[1], n[2]});
      const Tensor* g[3] = {&dx, &dw, &db};
      for (int i = 0; i < 3; ++i) out[i] = n[i] ? *g[i] : Tensor();
      return first_order("linear_cross_entropy", std::move(out));
    }
    // The forward's gradients times the upstream scalar, in float32 (the scalar
    // is not rounded to bf16 first): dX and db, kept in float32, are scaled
    // and rounded once; dW in place in eager by coda::scale (nothing else
    // holds it; no second dW-sized tensor, no sync), out of place while a
    // compiler traces (its tensors are functional) or on the CPU.
    constexpr auto traced = c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
    const Tensor s = dl.to(at::kFloat).contiguous();
    // the dtypes of x and b, which the float32 dX and db are rounded to (dW keeps W's)
    const auto x_dtype = static_cast<c10::ScalarType>(ctx->saved_data["dt_x"].toInt());
    const auto b_dtype = static_cast<c10::ScalarType>(ctx->saved_data["dt_b"].toInt());
    for (int i = 0; i < 3; ++i) {
      if (!n[i] || v[i].numel() == 0) continue;
      Tensor t = v[i];
      const bool functional = s.key_set().has_any(traced) || t.key_set().has_any(traced);
      if (t.scalar_type() == at::kFloat) {
        out[i] = (functional ? t * s : t.mul_(s)).to(i == 0 ? x_dtype : b_dtype);
      } else if (functional || !t.is_cuda()) {
        out[i] = (t.to(at::kFloat) * s).to(t.scalar_type());
      } else {
        check(coda::scale(dtype_of(t), t.data_ptr(), t.numel(), s.data_ptr<float>(), stream()), "scale");
        out[i] = t;
      }
    }
    return first_order("linear_cross_entropy", std::move(out));
  }
};

std::tuple<Tensor, Tensor> linear_cross_entropy_autograd(const Tensor& x, const Tensor& weight,
                                                         const OptTensor& bias, const Tensor& target,
                                                         int64_t ignore_index, double label_smoothing, double softcap,
                                                         double z_loss, int64_t reduction, int64_t chunk) {
  if (!any_requires_grad({&x, &weight, opt(bias)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto o = linear_cross_entropy_op().call(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                            reduction, chunk, {false, false, false});
    return {std::get<0>(o), std::get<1>(o)};
  }
  auto o = LinearCrossEntropyFn::apply(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                       reduction, chunk);
  return {o[0], o[1]};
}

// The public op: (loss, lse); its Autograd kernel runs the one above.
std::tuple<Tensor, Tensor> linear_cross_entropy_loss(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                                     const Tensor& target, int64_t ignore_index,
                                                     double label_smoothing, double softcap, double z_loss,
                                                     int64_t reduction, int64_t chunk) {
  auto o = linear_cross_entropy(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction,
                                chunk, {false, false, false});
  return {std::get<0>(o), std::get<1>(o)};
}

}  // namespace

CODA_TORCH_OP(linear_cross_entropy,
              "linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index,"
              " float label_smoothing, float softcap, float z_loss, int reduction, int chunk, bool[3] needs)"
              " -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_TORCH_OP(linear_cross_entropy_backward,
              "linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight, Tensor? bias, Tensor target,"
              " int ignore_index, float label_smoothing, float softcap, float z_loss, int chunk, bool[3] needs)"
              " -> (Tensor, Tensor, Tensor)")
CODA_TORCH_OP(linear_cross_entropy_loss,
              "linear_cross_entropy_loss(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index,"
              " float label_smoothing, float softcap, float z_loss, int reduction, int chunk) -> (Tensor, Tensor)")

CODA_AUTOGRAD(linear_cross_entropy_loss, linear_cross_entropy_autograd)

}  // namespace coda::torch_ops
