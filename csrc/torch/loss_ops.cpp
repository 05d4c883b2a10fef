// The LM head + cross-entropy, with no (tokens, vocab) tensor in memory.
//
// Three ways to the gradients, chosen per call (`recompute`):
//
// recompute (kAll, the default): the forward runs the LM-head GEMM by slices
// of the vocabulary (every token, a slice of W's rows) into one reused buffer
// and the cross-entropy kernel (csrc/cross_entropy_kernels.cu) folds each
// slice into the rows' running log-sum-exp and loss; nothing outlives it but
// the lse. The backward, where the upstream gradient is known, recomputes
// the same slices (the same GEMMs: bit for bit the forward's logits), turns
// them into d loss / d logits in place, and takes them to dW's rows of the
// slice (one GEMM over all tokens) and to dX (summed over the slices in
// float32): each gradient is rounded once, as torch's unfused path rounds
// it. Four GEMMs. With coda._kernels.lm_head_grad_epilogue() (off until
// measured), the backward's GEMM of each slice writes d loss / d logits from
// its epilogue (the linear_ce_grad program) instead of the logits, which the
// cross-entropy kernel would read back and overwrite.
//
// in the forward (kNothing, recompute false; mean and sum only): per chunk
// of tokens the kernel writes d loss / d logits over the logits and two GEMMs
// take it to dX (the chunk's rows, complete) and dW (summed over the chunks
// in float32: in W's dtype each of the ≥ 4 chunks under the memory bound
// would round it again, where torch's one GEMM rounds once); the backward
// scales them by the upstream gradient and rounds once. Three GEMMs, and a
// float32 dW held from the forward to the backward (4 bytes a weight, of
// which the 16-bit gradient ends up using 2: see Grads).
//
// half (kTail, recompute="half"): as kNothing, but the forward sums only dW's
// head rows (half of V) in float32, whose bytes are exactly the 16-bit
// gradient's; the backward rounds them in place and recomputes the tail's
// logits by slices of all tokens, as kAll does for every slice, straight into
// the gradient's second half. Three and a half GEMMs, and no memory for dW
// beyond the gradient itself. The tail's logits come from other GEMMs than
// the forward's chunks (same values up to the GEMMs' summation order).
//
// Either way the peak extra memory is one buffer of logits in x's dtype and
// a float32 dX (recompute: its 2 bytes an element beyond the gradient) within
// 1/8 of the fp32 logits (and 512 MiB of logits; small problems may take
// 16 MiB of logits and a 64 MiB dX). The lm_head benchmark times all three.
// On CPU tensors the same code runs with host kernels (host_kernels.h), for
// tests.
#include <ATen/DeviceGuard.h>

#include <atomic>
#include <cmath>
#include <functional>

#include "autograd.h"
#include "blas.h"
#include "host_kernels.h"
#include "tensors.h"

namespace coda::torch_ops {

namespace {

enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

// What the backward recomputes: nothing (the forward formed the gradients),
// every slice of the vocabulary, or the slices past dW's head rows.
enum Recompute : int64_t { kNothing = 0, kAll = 1, kTail = 2 };

struct CeParams {
  int64_t ignore_index;
  double label_smoothing, softcap, z_loss;
};

// coda.h's kernels on the current stream; for CPU tensors their host
// versions (host_kernels.h), so that these ops run and are tested there.
void cross_entropy_on(const Tensor& like, const CrossEntropyArgs& a) {
  if (like.is_cpu()) return host::cross_entropy(like.scalar_type(), a);
  check(coda::cross_entropy(dtype_of(like), a, stream()), "cross_entropy");
}

// into `out`'s dtype; dst is out's data or, in place, src
void scale_round_on(const Tensor& out, const float* src, void* dst, int64_t n, const float* scale) {
  if (out.is_cpu()) return host::scale_round(out.scalar_type(), src, dst, n, scale);
  check(coda::scale_round(dtype_of(out), src, dst, n, scale, stream()), "scale_round");
}

// The recomputing backward's d loss / d logits in the epilogue of the GEMM
// that recomputes each slice (coda::linear_cross_entropy_grad) instead of a
// GEMM writing the logits and the cross-entropy kernel reading them back and
// writing the gradient over them: off by default until measured
// (coda._kernels.lm_head_grad_epilogue), and the slices it ran.
std::atomic<bool> grad_epilogue{false};
std::atomic<int64_t> grad_epilogue_slices{0};

// The per-row vectors of the fused pass, once a backward: each row's class as
// float, its lse, and its gradient scale (0 where ignored, NaN where the
// target lies outside the vocabulary, as the cross-entropy kernel does).
struct GradRows {
  Tensor classes, target, lse, scale;
};

GradRows grad_rows(const Tensor& target, const Tensor& lse, const Tensor& gs, int64_t ignore_index, int64_t vocab) {
  const int64_t m = target.numel();
  const Tensor valid = target != ignore_index;
  const Tensor bad = valid & ((target < 0) | (target >= vocab));
  const Tensor base = gs.dim() > 0 ? gs.reshape({m}) : gs.expand({m});
  const Tensor nan = at::full({}, NAN, gs.options()), zero = at::zeros({}, gs.options());
  return {at::arange(vocab, lse.options()), target.to(at::kFloat),
          lse, at::where(valid, at::where(bad, nan, base), zero).contiguous()};
}

// The slice [v0, v0 + z's columns) of d loss / d logits into z, its logits
// never written (GPU: the GEMM's epilogue; CPU: the same formulas on the host).
void fused_grad_on(Tensor& z, const Tensor& x, const Tensor& w, const OptTensor& bias, int64_t v0,
                   const GradRows& r, const CeParams& p, int64_t vocab) {
  const int64_t len = z.size(1);
  const Tensor wv = w.narrow(0, v0, len), classes = r.classes.narrow(0, v0, len);
  const Tensor bv = bias ? bias->narrow(0, v0, len) : Tensor();
  grad_epilogue_slices.fetch_add(1, std::memory_order_relaxed);
  if (z.is_cpu()) {
    return host::linear_cross_entropy_grad(z, x, wv, bv, classes, r.lse, r.target, r.scale,
                                           float(p.label_smoothing), float(p.softcap), float(p.z_loss), vocab);
  }
  LinearCrossEntropyGradArgs a;
  a.m = x.size(0); a.n = len; a.k = x.size(1);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = wv.data_ptr(); a.ldw = wv.stride(0);
  a.bias = bv.defined() ? bv.data_ptr() : nullptr;
  a.classes = classes.data_ptr<float>();
  a.lse = r.lse.data_ptr<float>();
  a.target = r.target.data_ptr<float>();
  a.scale = r.scale.data_ptr<float>();
  a.label_smoothing = float(p.label_smoothing);
  a.softcap = float(p.softcap);
  a.z_loss = float(p.z_loss);
  a.vocab = vocab;
  a.dz = z.data_ptr(); a.lddz = z.stride(0);
  call("linear_cross_entropy_grad", dtype_of(x), a, x, coda::linear_cross_entropy_grad,
       coda::linear_cross_entropy_grad_workspace_size);
}

void scale_on(const Tensor& t, const float* scale) {
  if (t.is_cpu()) return host::scale(t.scalar_type(), t.data_ptr(), t.numel(), scale);
  check(coda::scale(dtype_of(t), t.data_ptr(), t.numel(), scale, stream()), "scale");
}

// Bytes of logits a chunk or slice may take: 1/8 of the fp32 logits less
// `reserve`, at most 512 MiB, at least 16 MiB.
int64_t logits_budget(int64_t m, int64_t n, int64_t reserve) {
  return std::max<int64_t>(std::min<int64_t>(m * n / 2 - reserve, int64_t(512) << 20), 16 << 20);
}

// Tokens per chunk: one chunk of logits (rows padded to 8) and `reserve`
// bytes (a float32 dX) within 1/8 of the fp32 logits (at least 16 MiB), so
// 4 chunks at least, and at most 512 MiB of logits per chunk; chunks of
// equal size, a multiple of 8 tokens where the budget has room (the chunk is
// the K of the dW GEMM: see product()).
int64_t chunk_rows(int64_t m, int64_t n, int64_t requested, int64_t reserve) {
  if (requested > 0) return std::min(requested, std::max<int64_t>(m, 1));
  if (m == 0) return 1;
  const int64_t row_bytes = (n + 7) / 8 * 8 * 2;
  const int64_t budget = logits_budget(m, n, reserve);
  int64_t rows = std::max<int64_t>(1, std::min(m / 4, budget / row_bytes));
  if (rows >= 8) rows = rows / 8 * 8;
  const int64_t chunks = (m + rows - 1) / rows, even = (m + chunks - 1) / chunks;
  return std::min(rows, rows >= 8 ? (even + 7) / 8 * 8 : even);
}

// Classes per slice of the recomputing path, a multiple of 8 (the buffer's
// rows stay 16-byte aligned): the slice's logits for every token and
// `reserve` bytes (dX's float32 beyond its gradient) within 1/8 of the fp32
// logits (at least 16 MiB, so that small problems need not go by tiny
// slices), at most 512 MiB of logits; slices of equal size.
int64_t slice_cols(int64_t m, int64_t n, int64_t requested, int64_t reserve) {
  const int64_t padded = (n + 7) / 8 * 8;
  if (requested > 0) return (std::min(padded, requested) + 7) / 8 * 8;
  const int64_t budget = logits_budget(m, n, reserve);
  const int64_t cols = std::max<int64_t>(8, std::min(padded, budget / std::max<int64_t>(2 * m, 1)) / 8 * 8);
  const int64_t slices = (n + cols - 1) / cols;
  return std::min(cols, ((n + slices - 1) / slices + 7) / 8 * 8);
}

// The gradients the forward forms: (dx, dw, db), (0,) where not needed;
// dW and db in float32, and dX where it takes at most half the memory bound
// (D ≤ V/16): the backward scales them and rounds once. dW is two buffers,
// W's first head_rows(V) rows and the rest: the backward rounds the head in
// place, into the first half of its own bytes, and the tail into the second
// half, so the float32 bytes become the 16-bit dW with no third buffer (a
// peak of 4 bytes a weight, not 4 + 2) and the tail is freed.
struct Grads {
  Tensor dx, dw, dw_tail, db;
};

// The head's rows: half of V, up to a multiple of 8 (the tail's first logit
// column stays 16-byte aligned for its GEMM), so that its float32 bytes hold
// all V rows in 16 bits.
int64_t head_rows(int64_t v) { return std::min(v, ((v + 1) / 2 + 7) / 8 * 8); }

// A float32 (rows, D) sum as its head_rows(rows) first rows and the rest
// (with_tail false: none(like)), on `like`'s device: see Grads (dW), and the
// recomputing backward's dX.
struct SplitRows {
  Tensor head, tail;
};

SplitRows split_rows(int64_t rows, int64_t d, const Tensor& like, bool with_tail = true) {
  const auto o = like.options().dtype(at::kFloat);
  const int64_t head = head_rows(rows);
  return {at::empty({head, d}, o), with_tail ? at::empty({rows - head, d}, o) : none(like)};
}

// The (rows, D) tensor of the 16-bit `dtype` on the head's own storage: the
// head's float32 times *scale (nullptr: 1) rounded in place, into the first
// half of its bytes, and where `tail` is given its rows times *scale after
// them (else those rows are left to the caller). Nothing but the head is kept.
Tensor round_into_head(const Tensor& head, const Tensor* tail, const float* scale, c10::ScalarType dtype,
                       int64_t rows) {
  const int64_t d = head.size(1);
  Tensor out = at::empty({0}, head.options().dtype(dtype)).set_(head.storage(), 0, {rows, d}, {d, 1});
  scale_round_on(out, head.data_ptr<float>(), head.data_ptr(), head.numel(), scale);
  if (tail != nullptr && tail->numel() > 0) {
    scale_round_on(out, tail->data_ptr<float>(), out.narrow(0, head.size(0), tail->size(0)).data_ptr(),
                   tail->numel(), scale);
  }
  return out;
}

bool is_16_bit(c10::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

CrossEntropyArgs ce_args(const Tensor& z, int64_t ld, const Tensor& target, int64_t first_row, const CeParams& p) {
  CrossEntropyArgs a;
  a.m = z.size(0);
  a.n = z.size(1);
  a.logits = z.data_ptr();
  a.ld = ld;
  a.target = target.data_ptr<int64_t>() + first_row;
  a.ignore_index = p.ignore_index;
  a.label_smoothing = float(p.label_smoothing);
  a.softcap = float(p.softcap);
  a.z_loss = float(p.z_loss);
  return a;
}

// out = a·b, or out += a·b with `accumulate`; out float32 or a's dtype.
// Into float32, a K that is no multiple of 8 is cut there and the last few
// columns added by a second GEMM (into 16 bits that would round twice):
// cuBLAS runs a K of GPT-2's vocabulary (50,257, the K of the dX GEMMs) or
// of a chunk of 1,639 tokens (the K of the dW GEMMs) far below its speed
// (benchmarks/README, the three-GEMM head at GPT-2's vocabulary).
void product(Tensor& out, const Tensor& a, const Tensor& b, bool accumulate) {
  const int64_t k = a.size(1), k8 = k / 8 * 8;
  if (k % 8 != 0 && k8 > 0 && out.scalar_type() == at::kFloat) {
    product(out, a.narrow(1, 0, k8), b.narrow(0, 0, k8), accumulate);
    product(out, a.narrow(1, k8, k - k8), b.narrow(0, k8, k - k8), true);
    return;
  }
  blas::matmul(out, a, b, accumulate ? 1.f : 0.f);
}

// z = x·wᵀ (+ bias): the LM-head GEMM of the forward's chunks and of both
// recomputing passes' slices.
void logits_into(Tensor& z, const Tensor& x, const Tensor& w, const OptTensor& bias) {
  if (bias) z.copy_(bias->unsqueeze(0).expand_as(z));
  blas::matmul(z, x, w.t(), bias ? 1.f : 0.f);
}

// The forward's chunks of tokens: the per-row losses (m,) and log-sum-exps
// (m,), and where `needs`, the gradients of the rows' sum into g.
std::pair<Tensor, Tensor> run_chunks(const Tensor& x, const Tensor& w, const OptTensor& bias, const Tensor& target,
                                     const CeParams& p, int64_t chunk, std::array<bool, 3> needs, Grads& g,
                                     const float* grad_scale) {
  const int64_t m = x.size(0), n = w.size(0);
  Tensor loss = f32({m}, x), lse = f32({m}, x);
  const int64_t reserve = needs[0] && g.dx.scalar_type() == at::kFloat ? g.dx.nbytes() : 0;
  const int64_t c = chunk_rows(m, n, chunk, reserve), ldp = (n + 7) / 8 * 8;
  Tensor buffer = at::empty({std::min(c, m), ldp}, x.options());
  Tensor db32 = needs[2] ? at::zeros({n}, x.options().dtype(at::kFloat)) : Tensor();
  for (int64_t s = 0; s < m; s += c) {
    const int64_t len = std::min(c, m - s);
    Tensor xc = x.narrow(0, s, len), z = buffer.narrow(0, 0, len).narrow(1, 0, n);
    logits_into(z, xc, w, bias);
    CrossEntropyArgs a = ce_args(z, ldp, target, s, p);
    a.write_grad = needs[0] || needs[1] || needs[2];
    a.grad_scale = grad_scale;
    a.loss = loss.data_ptr<float>() + s;
    a.lse = lse.data_ptr<float>() + s;
    cross_entropy_on(x, a);
    if (needs[0]) {
      Tensor dxc = g.dx.narrow(0, s, len);
      product(dxc, z, w, false);
    }
    if (needs[1]) {
      const int64_t head = g.dw.size(0);
      product(g.dw, z.t().narrow(0, 0, head), xc, s > 0);
      if (g.dw_tail.numel() > 0) product(g.dw_tail, z.t().narrow(0, head, n - head), xc, s > 0);
    }
    if (needs[2]) db32.add_(z.sum(0, false, at::kFloat));
  }
  if (needs[2]) g.db = db32;
  return {loss, lse};
}

Tensor target_of(const Tensor& target, int64_t m) {
  expect(target.numel() == m && (target.scalar_type() == at::kLong || target.scalar_type() == at::kInt),
         "linear_cross_entropy: target must be int64 (or int32) with one class per row of x");
  return target.reshape({m}).to(at::kLong).contiguous();
}

// x as rows (M, D) and W (V, D), both contiguous, checked for the op `op`.
std::pair<Tensor, Tensor> head_operands(const Tensor& x_, const Tensor& weight, const char* op) {
  Tensor x = x_.reshape({-1, x_.size(-1)}).contiguous(), w = weight.contiguous();
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.size(0) > 0, "coda: ", op,
              ": weight must be (V, D), V > 0, for x (..., D)");
  return {x, w};
}

void expect_reduction(int64_t reduction) {
  expect(reduction >= kNone && reduction <= kSum, "linear_cross_entropy: reduction code must be 0, 1 or 2");
}

// The rows a mean divides by (at least 1: all ignored, the gradients stay 0), float32, on the device.
Tensor count_of(const Tensor& target, int64_t ignore_index) {
  return (target != ignore_index).sum().clamp_min(1).to(at::kFloat);
}

// The loss the op returns from the per-row losses; a mean's divisor stays on
// the device (no sync), and every row ignored gives 0/0 = NaN, as torch's mean.
Tensor reduced(const Tensor& loss, const Tensor& target, const Tensor& target_, int64_t ignore_index,
               int64_t reduction) {
  if (reduction == kNone) return loss.view(target_.sizes());
  return reduction == kSum ? loss.sum() : loss.sum() / (target != ignore_index).sum().to(at::kFloat);
}

// dX in float32 where that takes at most half the memory bound (D ≤ V/16), or 64 MiB.
bool dx_in_float(const Tensor& x, const Tensor& w) {
  return x.size(1) * 16 <= w.size(0) || 4 * x.size(0) * x.size(1) <= (int64_t(64) << 20);
}

// In fp16 the forward's gradients of a mean come scaled by
// 2^-⌊log2(count)/2⌋ ≈ 1/√count (from when dW summed in fp16, which would
// overflow past 65504 unscaled), and p_j/√count keeps √count times more of
// fp16's subnormal digits than p_j/count (≈ 1/(V·count)), which loses dX's
// small entries to the subnormals (twice torch's error); at a million
// tokens and V ~ 50k it too rounds to 0. A power of two rounds nothing
// else; the backward divides by the rest of the count.
bool prescaled(int64_t reduction, const Tensor& x) { return reduction == kMean && x.scalar_type() == at::kHalf; }
Tensor prescale_of(const Tensor& count) { return at::exp2(-at::floor(at::log2(count) * 0.5)); }

// -> (loss: () for mean/sum, target's shape for none; lse (m,); where
// `needs` (mean and sum), dx, dw (its head rows, and the tail's where
// dw_tail: else the backward recomputes those), db of the sum of the rows' losses, which
// the backward scales by the upstream gradient (over the valid rows for a
// mean; prescaled, by what prescale_of left): d loss / d logits is rounded before that scale,
// and unscaled its target entries (≈ −1) round almost exactly.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> linear_cross_entropy(
    const Tensor& x_, const Tensor& weight, const OptTensor& bias, const Tensor& target_, int64_t ignore_index,
    double label_smoothing, double softcap, double z_loss, int64_t reduction, int64_t chunk,
    std::array<bool, 3> needs, bool dw_tail) {
  const at::OptionalDeviceGuard guard(at::device_of(x_));
  expect_reduction(reduction);
  auto [x, w] = head_operands(x_, weight, "linear_cross_entropy");
  const int64_t m = x.size(0);
  Tensor target = target_of(target_, m);
  if (reduction == kNone) needs = {false, false, false};
  needs[2] = needs[2] && bias.has_value();
  OptTensor b = bias ? OptTensor(bias->contiguous()) : std::nullopt;
  const bool dx_float = dx_in_float(x, w);
  const SplitRows dw = needs[1] ? split_rows(w.size(0), w.size(1), x, dw_tail) : SplitRows{none(x), none(x)};
  Grads g{needs[0] ? at::empty_like(x, dx_float ? x.options().dtype(at::kFloat) : x.options()) : none(x), dw.head,
          dw.tail, none(x)};
  const bool grad = needs[0] || needs[1] || needs[2];
  const Tensor inv = grad && prescaled(reduction, x) ? prescale_of(count_of(target, ignore_index)) : Tensor();
  auto [loss, lse] = run_chunks(x, w, b, target, {ignore_index, label_smoothing, softcap, z_loss}, chunk, needs, g,
                                inv.defined() ? inv.data_ptr<float>() : nullptr);
  return {reduced(loss, target, target_, ignore_index, reduction), lse, needs[0] ? g.dx.view(x_.sizes()) : g.dx,
          g.dw, g.dw_tail, g.db};
}

// The recomputing path's slices: the float32 dX the backward sums into,
// beyond the bytes that become its gradient (2 an element), is reserved
// whether or not dX is needed, so that the forward and the backward cut the
// vocabulary alike.
int64_t recompute_cols(const Tensor& x, const Tensor& w, int64_t chunk) {
  const int64_t m = x.size(0);
  if (m == 0) return std::max<int64_t>(w.size(0), 1);
  return slice_cols(m, w.size(0), chunk, dx_in_float(x, w) ? 2 * m * x.size(1) : 0);
}

// The logits of classes [v0, v0 + len) for every token, into the buffer's
// first len columns: one call for the forward and the backward, so that
// both run the same GEMM on the same operands.
Tensor slice_logits(Tensor& buffer, const Tensor& x, const Tensor& w, const OptTensor& bias, int64_t v0, int64_t len) {
  Tensor z = buffer.narrow(1, 0, len);
  logits_into(z, x, w.narrow(0, v0, len), bias ? OptTensor(bias->narrow(0, v0, len)) : std::nullopt);
  return z;
}

// The recomputing path's forward: (loss, lse) by the backward's slices of the
// vocabulary, each slice's logits folded into the rows' running statistics.
std::tuple<Tensor, Tensor> linear_cross_entropy_sliced(const Tensor& x_, const Tensor& weight, const OptTensor& bias,
                                                       const Tensor& target_, int64_t ignore_index,
                                                       double label_smoothing, double softcap, double z_loss,
                                                       int64_t reduction, int64_t chunk) {
  const at::OptionalDeviceGuard guard(at::device_of(x_));
  expect_reduction(reduction);
  auto [x, w] = head_operands(x_, weight, "linear_cross_entropy");
  const int64_t m = x.size(0), n = w.size(0);
  Tensor target = target_of(target_, m), loss = f32({m}, x), lse = f32({m}, x);
  const int64_t cols = recompute_cols(x, w, chunk);
  Tensor buffer = at::empty({m, cols}, x.options()), partial = f32({m, 4}, x);
  const CeParams p{ignore_index, label_smoothing, softcap, z_loss};
  for (int64_t v0 = 0; m > 0 && v0 < n; v0 += cols) {
    const int64_t len = std::min(cols, n - v0);
    Tensor z = slice_logits(buffer, x, w, bias, v0, len);
    CrossEntropyArgs a = ce_args(z, cols, target, 0, p);
    a.partial = partial.data_ptr<float>();
    a.first = v0 == 0;
    a.last = v0 + len == n;
    a.col0 = v0;
    a.vocab = n;
    a.loss = loss.data_ptr<float>();
    a.lse = lse.data_ptr<float>();
    cross_entropy_on(x, a);
  }
  return {reduced(loss, target, target_, ignore_index, reduction), lse};
}

// The recomputing backward over the classes [first, V): grad () scales
// every row, or (target's shape) each row (reduction none); lse (m,) from the
// forward. -> dX and db of those classes, and dW's rows of them, (V − first, D)
// in W's dtype: into `dw_into` where given (rows of a gradient the forward
// began, recompute="half"), else a new tensor.
std::tuple<Tensor, Tensor, Tensor> backward_slices(const Tensor& grad, const Tensor& x_, const Tensor& weight,
                                                   const OptTensor& bias, const Tensor& target_, const Tensor& lse,
                                                   const CeParams& p, int64_t chunk, std::array<bool, 3> needs,
                                                   int64_t first, Tensor* dw_into) {
  const at::OptionalDeviceGuard guard(at::device_of(x_));
  auto [x, w] = head_operands(x_, weight, "linear_cross_entropy_backward");
  const int64_t m = x.size(0), n = w.size(0);
  expect(lse.numel() == m && lse.scalar_type() == at::kFloat,
         "linear_cross_entropy_backward: lse must be float32 with one value per row of x");
  expect(first >= 0 && first <= n, "linear_cross_entropy_backward: first_class must be in [0, V]");
  Tensor target = target_of(target_, m), l = lse.reshape({m}).contiguous();
  const bool per_row = grad.dim() > 0;
  expect(!per_row || grad.numel() == m, "linear_cross_entropy_backward: grad must be a scalar or one per row");
  Tensor gs = grad.to(at::kFloat).contiguous();
  needs[2] = needs[2] && bias.has_value();
  // dX sums over the slices in float32 where dx_in_float, as x's first
  // head_rows(M) rows and the rest, rounded at the end into the first's own
  // bytes (2 bytes an element beyond the gradient, not 4); else in x's dtype
  // (one rounding per slice).
  const bool dx_float = needs[0] && dx_in_float(x, w);
  const SplitRows acc = dx_float ? split_rows(m, x.size(1), x) : SplitRows{};
  Tensor dx = needs[0] && !dx_float ? at::empty_like(x) : none(x);
  Tensor dw = !needs[1] ? none(x) : dw_into != nullptr ? *dw_into : at::empty({n - first, w.size(1)}, w.options());
  expect(!needs[1] || (dw.size(0) == n - first && dw.size(1) == w.size(1) && dw.scalar_type() == w.scalar_type()),
         "linear_cross_entropy_backward: dW's rows must be (V - first_class, D) in W's dtype");
  Tensor db = needs[2] ? at::empty({n - first}, w.options().dtype(bias->scalar_type())) : none(x);
  if (m == 0 || first == n) {
    if (dx_float) {
      acc.head.zero_();
      acc.tail.zero_();
    } else if (needs[0]) {
      dx.zero_();
    }
    if (needs[1]) dw.zero_();
    if (needs[2]) db.zero_();
  }
  const int64_t cols = recompute_cols(x, w, chunk);
  Tensor buffer = at::empty({m, cols}, x.options());
  // the fused pass takes slices of whole 16-byte rows (a last slice of any other width runs unfused)
  const bool fused = grad_epilogue.load(std::memory_order_relaxed) && m > 0 && x.size(1) % 8 == 0 &&
                     n < (int64_t(1) << 24);
  const GradRows rows = fused ? grad_rows(target, l, gs, p.ignore_index, n) : GradRows{};
  for (int64_t v0 = first; m > 0 && v0 < n; v0 += cols) {
    const int64_t len = std::min(cols, n - v0);
    Tensor z = buffer.narrow(1, 0, len), wv = w.narrow(0, v0, len);
    if (fused && len % 8 == 0) {
      fused_grad_on(z, x, w, bias, v0, rows, p, n);
    } else {
      z = slice_logits(buffer, x, w, bias, v0, len);
      CrossEntropyArgs a = ce_args(z, cols, target, 0, p);
      a.write_grad = true;
      a.lse_in = l.data_ptr<float>();
      a.col0 = v0;
      a.vocab = n;
      (per_row ? a.row_grad : a.grad_scale) = gs.data_ptr<float>();
      cross_entropy_on(x, a);
    }
    if (dx_float) {
      const int64_t mh = acc.head.size(0);
      Tensor head = acc.head, tail = acc.tail;
      product(head, z.narrow(0, 0, mh), wv, v0 > first);
      if (m > mh) product(tail, z.narrow(0, mh, m - mh), wv, v0 > first);
    } else if (needs[0]) {
      product(dx, z, wv, v0 > first);
    }
    if (needs[1]) {
      Tensor dwv = dw.narrow(0, v0 - first, len);
      blas::matmul(dwv, z.t(), x, 0.f);
    }
    if (needs[2]) db.narrow(0, v0 - first, len).copy_(z.sum(0, false, at::kFloat));
  }
  if (dx_float) {
    dx = is_16_bit(x.scalar_type()) ? round_into_head(acc.head, &acc.tail, nullptr, x.scalar_type(), m)
                                    : at::cat({acc.head, acc.tail}).to(x.scalar_type());
  }
  return {needs[0] ? dx.view(x_.sizes()) : dx, dw, db};
}

std::tuple<Tensor, Tensor, Tensor> linear_cross_entropy_backward(
    const Tensor& grad, const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& target,
    const Tensor& lse, int64_t ignore_index, double label_smoothing, double softcap, double z_loss, int64_t chunk,
    std::array<bool, 3> needs, int64_t first_class) {
  return backward_slices(grad, x, weight, bias, target, lse, {ignore_index, label_smoothing, softcap, z_loss}, chunk,
                         needs, first_class, nullptr);
}

CODA_OP_HANDLE(linear_cross_entropy)
CODA_OP_HANDLE(linear_cross_entropy_sliced)
CODA_OP_HANDLE(linear_cross_entropy_backward)

// dW rounded once to W's dtype, `rows` rows: the head's float32 times s,
// then the rest: the tail's float32 times s, or with recompute="half" (no
// tail) `recomputed`, which writes those rows into the tensor it is given or
// returns them (nullptr). In eager, for a 16-bit W, into the head's own bytes:
// the head in place, the rest after it, no other buffer; while a compiler
// traces, out of place.
Tensor weight_grad(const Tensor& head, const Tensor& tail, const Tensor& s, c10::ScalarType dtype, int64_t rows,
                   bool functional, const std::function<Tensor(Tensor*)>& recomputed) {
  const bool formed = tail.numel() > 0 || rows == head.size(0);  // every row summed in the forward
  if (functional || !is_16_bit(dtype)) {
    if (formed) return (at::cat({head, tail}) * s).to(dtype);
    return at::cat({(head * s).to(dtype), recomputed(nullptr)});
  }
  Tensor dw = round_into_head(head, formed ? &tail : nullptr, s.data_ptr<float>(), dtype, rows);
  if (!formed) {
    Tensor rest = dw.narrow(0, head.size(0), rows - head.size(0));
    recomputed(&rest);
  }
  return dw;
}

// Saved for the recomputing backward (recompute, recompute="half", and
// reduction none): x, W, b, the targets and the lse; for the forward's
// gradients (recompute=False and "half"): dX, dW's head and tail, db.
struct LinearCrossEntropyFn : torch::autograd::Function<LinearCrossEntropyFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               const Tensor& target, int64_t ignore_index, double label_smoothing, double softcap,
                               double z_loss, int64_t reduction, int64_t chunk, int64_t recompute,
                               int64_t chunk_vocab) {
    at::AutoDispatchBelowADInplaceOrView below;
    if (reduction == kNone) recompute = kAll;  // per-row upstream gradients: none can be formed before them
    const std::array<bool, 3> needs{x.requires_grad(), weight.requires_grad(), bias && bias->requires_grad()};
    Tensor loss, lse, dx, dw, dw_tail, db;
    if (recompute == kAll) {
      std::tie(loss, lse) = linear_cross_entropy_sliced_op().call(x, weight, bias, target, ignore_index,
                                                                  label_smoothing, softcap, z_loss, reduction,
                                                                  chunk_vocab);
    } else {
      std::tie(loss, lse, dx, dw, dw_tail, db) =
          linear_cross_entropy_op().call(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                         reduction, chunk, needs, recompute == kNothing);
    }
    // a mean's upstream gradient is spread over the rows not ignored (all ignored: the gradients stay 0)
    // (prescaled: the forward's gradients came multiplied by prescale_of(count) already)
    const Tensor count = reduction == kMean ? count_of(target, ignore_index) : none_f32(x);
    const bool pre = recompute != kAll && prescaled(reduction, x);
    const Tensor formed_count = pre ? count * prescale_of(count) : count;
    const Tensor empty = none(x);
    if (recompute == kAll) {
      ctx->save_for_backward({empty, empty, empty, empty, count, x, weight, bias ? *bias : empty, target, lse, count});
    } else if (recompute == kTail) {
      ctx->save_for_backward({dx, dw, db, dw_tail, formed_count, x, weight, bias ? *bias : empty, target, lse, count});
    } else {  // no inputs: an optimizer may update W in place before this backward, which needs none of them
      ctx->save_for_backward({dx, dw, db, dw_tail, formed_count, empty, empty, empty, empty, empty, count});
    }
    ctx->saved_data["ii"] = ignore_index;
    ctx->saved_data["ls"] = label_smoothing;
    ctx->saved_data["cap"] = softcap;
    ctx->saved_data["z"] = z_loss;
    ctx->saved_data["chunk"] = chunk_vocab;
    ctx->saved_data["recompute"] = recompute;
    ctx->saved_data["dt_x"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["dt_w"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["dt_b"] = static_cast<int64_t>(bias ? bias->scalar_type() : x.scalar_type());
    ctx->saved_data["p"] = present_mask({true, true, bias.has_value(), true});
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {loss, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dl = grads[0];
    if (!dl.defined()) return variable_list(12);
    at::AutoDispatchBelowADInplaceOrView below;
    const auto n = needs_by_arg<3>(ctx, ctx->saved_data["p"].toInt());
    auto v = ctx->get_saved_variables();
    variable_list out(12);
    // s scales the forward's gradients, s_rows the recomputed ones (they differ by a prescale)
    const auto scale_by = [&](const Tensor& count) {
      return count.numel() ? dl.to(at::kFloat) / count : dl.to(at::kFloat).contiguous();
    };
    const Tensor s = scale_by(v[4]), s_rows = scale_by(v[10]);
    const Tensor &x = v[5], &w = v[6], &target = v[8], &lse = v[9];
    const OptTensor b = opt_of(v[7]);
    const int64_t recompute = ctx->saved_data["recompute"].toInt(), chunk_vocab = ctx->saved_data["chunk"].toInt();
    const CeParams p{ctx->saved_data["ii"].toInt(), ctx->saved_data["ls"].toDouble(),
                     ctx->saved_data["cap"].toDouble(), ctx->saved_data["z"].toDouble()};
    if (recompute == kAll) {
      auto [dx, dw, db] = linear_cross_entropy_backward_op().call(
          s_rows, x, w, b, target, lse, p.ignore_index, p.label_smoothing, p.softcap, p.z_loss, chunk_vocab,
          {n[0], n[1], n[2]}, 0);
      const Tensor* g[3] = {&dx, &dw, &db};
      for (int i = 0; i < 3; ++i) out[i] = n[i] ? *g[i] : Tensor();
      return first_order("linear_cross_entropy", std::move(out));
    }
    // The forward's gradients times the upstream scalar, in float32: those
    // kept in float32 (dW, db, and dX where dx_in_float) are scaled and
    // rounded once, in eager in one pass (coda::scale_round); a 16-bit dX in place in eager by coda::scale (nothing
    // else holds it; no second such tensor, no sync), out of place while a
    // compiler traces (its tensors are functional). In place, a second
    // backward (retain_graph) would scale them again.
    TORCH_CHECK(!ctx->saved_data.count("scaled"), "coda.linear_cross_entropy with recompute=False or \"half\" runs "
                "one backward (its gradients were formed in the forward and scaled in place); use recompute=True "
                "for more");
    ctx->saved_data["scaled"] = true;
    constexpr auto traced = c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
    // the dtypes of x, W and b, which the float32 gradients are rounded to
    const c10::ScalarType dtypes[3] = {static_cast<c10::ScalarType>(ctx->saved_data["dt_x"].toInt()),
                                       static_cast<c10::ScalarType>(ctx->saved_data["dt_w"].toInt()),
                                       static_cast<c10::ScalarType>(ctx->saved_data["dt_b"].toInt())};
    for (int i = 0; i < 3; ++i) {
      if (!n[i] || v[i].numel() == 0) continue;
      Tensor t = v[i];
      const bool functional = s.key_set().has_any(traced) || t.key_set().has_any(traced);
      if (i == 1) {
        // recompute="half": W's rows past the head, by the recomputing backward's slices
        const int64_t head = t.size(0);
        const auto recomputed = [&](Tensor* into) {
          if (into != nullptr) {
            return std::get<1>(backward_slices(s_rows, x, w, b, target, lse, p, chunk_vocab, {false, true, false},
                                               head, into));
          }
          return std::get<1>(linear_cross_entropy_backward_op().call(
              s_rows, x, w, b, target, lse, p.ignore_index, p.label_smoothing, p.softcap, p.z_loss, chunk_vocab,
              {false, true, false}, head));
        };
        // W itself is not saved for recompute=False: its rows are the head's and the tail's
        const int64_t rows = recompute == kTail ? w.size(0) : head + v[3].size(0);
        out[1] = weight_grad(t, v[3], s, dtypes[1], rows, functional || s_rows.key_set().has_any(traced),
                             recomputed);
        continue;
      }
      if (t.scalar_type() == at::kFloat && is_16_bit(dtypes[i]) && !functional) {
        out[i] = at::empty(t.sizes(), t.options().dtype(dtypes[i]));
        scale_round_on(out[i], t.data_ptr<float>(), out[i].data_ptr(), t.numel(), s.data_ptr<float>());
      } else if (t.scalar_type() == at::kFloat) {
        out[i] = (functional ? t * s : t.mul_(s)).to(dtypes[i]);
      } else if (functional || !is_16_bit(t.scalar_type())) {
        out[i] = (t.to(at::kFloat) * s).to(t.scalar_type());
      } else {
        scale_on(t, s.data_ptr<float>());
        out[i] = t;
      }
    }
    return first_order("linear_cross_entropy", std::move(out));
  }
};

std::tuple<Tensor, Tensor> linear_cross_entropy_autograd(const Tensor& x, const Tensor& weight,
                                                         const OptTensor& bias, const Tensor& target,
                                                         int64_t ignore_index, double label_smoothing, double softcap,
                                                         double z_loss, int64_t reduction, int64_t chunk,
                                                         int64_t recompute, int64_t chunk_vocab) {
  TORCH_CHECK(recompute >= kNothing && recompute <= kTail,
              "coda: linear_cross_entropy: recompute code must be 0 (False), 1 (True) or 2 (\"half\"), got ",
              recompute);
  if (!any_requires_grad({&x, &weight, opt(bias)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto o = linear_cross_entropy_op().call(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                            reduction, chunk, {false, false, false}, true);
    return {std::get<0>(o), std::get<1>(o)};
  }
  auto o = LinearCrossEntropyFn::apply(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                       reduction, chunk, recompute, chunk_vocab);
  return {o[0], o[1]};
}

// The public op: (loss, lse); its Autograd kernel runs the one above.
std::tuple<Tensor, Tensor> linear_cross_entropy_loss(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                                     const Tensor& target, int64_t ignore_index,
                                                     double label_smoothing, double softcap, double z_loss,
                                                     int64_t reduction, int64_t chunk, int64_t recompute,
                                                     int64_t chunk_vocab) {
  auto o = linear_cross_entropy(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction,
                                chunk, {false, false, false}, true);
  return {std::get<0>(o), std::get<1>(o)};
}

void set_lm_head_grad_epilogue(bool on) { grad_epilogue.store(on, std::memory_order_relaxed); }
int64_t lm_head_grad_epilogue_slices() { return grad_epilogue_slices.load(std::memory_order_relaxed); }

}  // namespace

CODA_TORCH_OP(linear_cross_entropy,
              "linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index,"
              " float label_smoothing, float softcap, float z_loss, int reduction, int chunk, bool[3] needs,"
              " bool dw_tail) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
CODA_TORCH_OP(linear_cross_entropy_sliced,
              "linear_cross_entropy_sliced(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index,"
              " float label_smoothing, float softcap, float z_loss, int reduction, int chunk) -> (Tensor, Tensor)")
CODA_TORCH_OP(linear_cross_entropy_backward,
              "linear_cross_entropy_backward(Tensor grad, Tensor x, Tensor weight, Tensor? bias, Tensor target,"
              " Tensor lse, int ignore_index, float label_smoothing, float softcap, float z_loss, int chunk,"
              " bool[3] needs, int first_class)"
              " -> (Tensor, Tensor, Tensor)")
CODA_TORCH_OP(linear_cross_entropy_loss,
              "linear_cross_entropy_loss(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index,"
              " float label_smoothing, float softcap, float z_loss, int reduction, int chunk, int recompute,"
              " int chunk_vocab) -> (Tensor, Tensor)")

CODA_AUTOGRAD(linear_cross_entropy_loss, linear_cross_entropy_autograd)

TORCH_LIBRARY_FRAGMENT(coda, m) {
  m.def("_set_lm_head_grad_epilogue(bool on) -> ()", &set_lm_head_grad_epilogue);
  m.def("_lm_head_grad_epilogue_slices() -> int", &lm_head_grad_epilogue_slices);
}

// The same ops on CPU tensors, their kernels on the host (host_kernels.h):
// for tests of this file's orchestration on a machine without a GPU. The
// Python API keeps CPU tensors on its reference path.
TORCH_LIBRARY_IMPL(coda, CPU, m) {
  m.impl("linear_cross_entropy", TORCH_FN(linear_cross_entropy));
  m.impl("linear_cross_entropy_sliced", TORCH_FN(linear_cross_entropy_sliced));
  m.impl("linear_cross_entropy_backward", TORCH_FN(linear_cross_entropy_backward));
  m.impl("linear_cross_entropy_loss", TORCH_FN(linear_cross_entropy_loss));
}

}  // namespace coda::torch_ops
