// coda: Transformer-block GEMMs whose epilogues do the memory-bound work.
//
// The public C++ API. No torch, no CUTLASS in this header: device pointers,
// shapes, leading dimensions and a stream in; a Status out. Every matrix is
// row-major with the given leading dimension (element (i, j) at ptr[i*ld + j]),
// which is how PyTorch hands over activations and nn.Linear weights [out, in].
// Kernels are built for sm_90a (H100 / H200) only. The ops run on the current
// device and make its primary context current on the calling thread (once per
// thread, with cudaSetDevice), so any thread may call them.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace coda {

enum class Status : int {
  kSuccess = 0,
  kInvalidArgument,    // a null pointer, a negative size, an unknown enum value
  kMisaligned,         // a pointer or leading dimension is not 16-byte aligned
  kNotSupported,       // no kernel for this device, dtype or shape; use a reference path
  kWorkspaceTooSmall,  // pass at least *_workspace_size() bytes, or nullptr
  kCudaError,          // a CUDA runtime call or launch failed
  kKernelError,        // CUTLASS refused or failed to launch the kernel
};

// A short name for the status, e.g. "misaligned".
const char* status_string(Status status);
// Details of the last non-success status returned on this thread.
const char* last_error_message();

enum class DType : int { kBFloat16 = 0, kFloat16 = 1 };

// Values match coda::epilogues::ActivationKind.
enum class Activation : int { kIdentity = 0, kGeluTanh = 1, kGeluErf = 2, kReLU = 3, kSiLU = 4 };

// Y = act(X·Wᵀ + bias) + residual;  H = X·Wᵀ + bias  (the forward of a Linear).
struct LinearArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, out features, in features
  const void* x = nullptr;           // (m, k)
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n, k), nn.Linear layout
  int64_t ldw = 0;
  const void* bias = nullptr;        // (n) or null
  Activation activation = Activation::kIdentity;
  const void* residual = nullptr;    // (m, n) or null, added after the activation
  int64_t ld_residual = 0;
  void* y = nullptr;                 // (m, n) out
  int64_t ldy = 0;
  void* pre_act = nullptr;           // (m, n) out, H for the backward; or null
  int64_t ld_pre_act = 0;
};

// dX = (dY·W) ⊙ act'(H);  dbias = Σ_rows dX.  The dgrad GEMM of the layer
// *after* an activation, with that activation's backward and its bias
// gradient in the epilogue. With Activation::kIdentity and null pre_act /
// dbias it is the plain dgrad dX = dY·W.
struct DgradArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, in features (of dX), out features (of dY)
  const void* dy = nullptr;          // (m, k)
  int64_t lddy = 0;
  const void* weight = nullptr;      // (k, n), nn.Linear layout of the layer dY came from
  int64_t ldw = 0;
  Activation activation = Activation::kIdentity;
  const void* pre_act = nullptr;     // (m, n) H saved by the forward, or null
  int64_t ld_pre_act = 0;
  void* dx = nullptr;                // (m, n) out
  int64_t lddx = 0;
  void* dbias = nullptr;             // (n) out, or null
  // The row dots of the norm in front of the layer dX belongs to (bf16 only):
  // c₁ = norm_scale·Σ_n dX ⊙ (pre_act − norm_shift), c₂ = norm_scale·Σ_n dX ⊙ norm_col_sum.
  const float* norm_shift = nullptr; // (n) t of fold_norm_weight
  const float* norm_col_sum = nullptr;  // (n) s, or null (RMSNorm)
  float norm_scale = 1.f;            // 1 / the norm's size
  float* norm_c1 = nullptr;          // (m) out, or null (no row dots)
  float* norm_c2 = nullptr;          // (m) out, or null
};

// dW = dYᵀ·X, the weight gradient of a Linear: dY (tokens, n), X (tokens, k).
struct WgradArgs {
  int64_t m = 0, n = 0, k = 0;       // out features, in features, tokens
  const void* dy = nullptr;          // (k, m)
  int64_t lddy = 0;
  const void* x = nullptr;           // (k, n)
  int64_t ldx = 0;
  void* dw = nullptr;                // (m, n) out
  int64_t lddw = 0;
};

// ---- norms folded into GEMMs (bf16 only; other dtypes return kNotSupported)
//
// Norm(X)·Wᵀ + b = rstd ⊙ (X·W̃ᵀ − mean ⊙ s) + t, with W̃ = W∘γ, s = Σ_k W̃ and
// t = W·β + b: the GEMM reads X itself and the epilogue applies the norm.
// Row statistics are fp32 (mean, rstd); RMSNorm passes null for mean, s, β.

// W̃ = round(W ∘ γ), s[n] = Σ_k W̃[n,k], t[n] = Σ_k W[n,k]·β[k] + b[n]: the
// folded weight of a norm-GEMM, once per weight update.
struct FoldNormWeightArgs {
  int64_t n = 0, k = 0;              // out features, in features (= the norm's size)
  const void* weight = nullptr;      // (n, k) nn.Linear layout
  int64_t ldw = 0;
  const void* gamma = nullptr;       // (k)
  const void* beta = nullptr;        // (k) or null (RMSNorm)
  const void* bias = nullptr;        // (n) or null
  void* folded = nullptr;            // (n, k) out W̃, or null (s and t only)
  int64_t ld_folded = 0;
  float* col_sum = nullptr;          // (n) out s, or null
  float* shift = nullptr;            // (n) out t
};

// Per-row statistics of X in one pass over it (where no GEMM epilogue made them).
struct RowStatsArgs {
  int64_t m = 0, n = 0;              // rows, row length
  const void* x = nullptr;           // (m, n)
  int64_t ldx = 0;
  bool layernorm = true;             // false: RMSNorm (rstd of the raw rows)
  float eps = 1e-5f;
  float* mean = nullptr;             // (m) out, or null; RMSNorm writes 0
  float* rstd = nullptr;             // (m) out
};

// Y = act(H), H = rstd ⊙ (X·W̃ᵀ − mean ⊙ s) + t: the forward of a norm-GEMM.
struct NormLinearArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, out features, in features
  const void* x = nullptr;           // (m, k) the norm's input, not normalized
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n, k) W̃ from fold_norm_weight
  int64_t ldw = 0;
  const float* mean = nullptr;       // (m) or null (RMSNorm)
  const float* rstd = nullptr;       // (m)
  float eps = 0.f;                   // LayerNorm's eps: rows whose variance is below 2⁻¹⁹·eps
                                     // (constant rows) give H = t; 0: no such rows
  const float* col_sum = nullptr;    // (n) s, or null (RMSNorm)
  const float* shift = nullptr;      // (n) t, or null
  Activation activation = Activation::kIdentity;
  void* y = nullptr;                 // (m, n) out
  int64_t ldy = 0;
  void* pre_act = nullptr;           // (m, n) out H, or null
  int64_t ld_pre_act = 0;
};

// Y = X·Wᵀ + b + R and the row statistics of Y for the next norm, in one GEMM
// (residual-reduce).
struct LinearResidualArgs {
  int64_t m = 0, n = 0, k = 0;
  const void* x = nullptr;           // (m, k)
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n, k)
  int64_t ldw = 0;
  const void* bias = nullptr;        // (n) or null
  const void* residual = nullptr;    // (m, n) or null
  int64_t ld_residual = 0;
  void* y = nullptr;                 // (m, n) out
  int64_t ldy = 0;
  bool layernorm = true;             // false: RMSNorm statistics
  float eps = 1e-5f;
  float* mean = nullptr;             // (m) out, or null; RMSNorm writes 0
  float* rstd = nullptr;             // (m) out
};

// The backward of a lone (norm-)linear's epilogue, one pass over its rows:
// dP = dY ⊙ act'(H), c₁ = scale·Σ_n dP ⊙ (H − t), c₂ = scale·Σ_n dP ⊙ s and,
// optionally, the bias gradient Σ_m dP. With c1 null it is the activation's
// backward and the bias gradient alone. (Inside coda's MLP the fc2 dgrad
// epilogue does this; see DgradArgs.)
struct NormRowDotsArgs {
  int64_t m = 0, n = 0;              // tokens, out features of the norm-GEMM
  const void* dy = nullptr;          // (m, n)
  int64_t lddy = 0;
  const void* pre_act = nullptr;     // (m, n) H; with identity, the output Y
  int64_t ld_pre_act = 0;
  Activation activation = Activation::kIdentity;
  const float* shift = nullptr;      // (n) t, or null
  const float* col_sum = nullptr;    // (n) s, or null (RMSNorm)
  float scale = 1.f;                 // 1 / the norm's size
  void* dp = nullptr;                // (m, n) out dP; unused with identity (dP is dY)
  int64_t lddp = 0;
  float* c1 = nullptr;               // (m) out, or null (no row dots)
  float* c2 = nullptr;               // (m) out, or null
  void* dbias = nullptr;             // (n) out Σ_m dP, or null: the bias gradient in the same read
};

// dX = rstd ⊙ (γ ⊙ (dP·W) − x̂ ⊙ c₁ − c₂) + dR, x̂ = (X − mean) ⊙ rstd, with
// dγ = Σ_m (dP·W) ⊙ x̂, dβ = Σ_m dP·W and N̂ = x̂ ⊙ γ + β (for dW = dPᵀ·N̂), in
// the epilogue of the dgrad GEMM: the backward of a norm-GEMM's input.
struct NormDgradArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, in features (the norm's size), out features
  const void* dy = nullptr;          // (m, k) dP
  int64_t lddy = 0;
  const void* weight = nullptr;      // (k, n) W, unfolded
  int64_t ldw = 0;
  const void* x = nullptr;           // (m, n) the norm's input
  int64_t ldx = 0;
  const float* mean = nullptr;       // (m) or null (RMSNorm)
  const float* rstd = nullptr;       // (m)
  const void* gamma = nullptr;       // (n)
  const void* beta = nullptr;        // (n) or null
  const float* c1 = nullptr;         // (m)
  const float* c2 = nullptr;         // (m) or null (RMSNorm)
  const void* residual_grad = nullptr;  // (m, n) added to dX, or null
  int64_t ld_residual_grad = 0;
  void* dx = nullptr;                // (m, n) out
  int64_t lddx = 0;
  void* normalized = nullptr;        // (m, n) out N̂, or null
  int64_t ld_normalized = 0;
  void* dgamma = nullptr;            // (n) out, or null
  void* dbeta = nullptr;             // (n) out, or null
};

// ---- the LLaMA path (bf16 only)

// A = act(g) ⊙ u for the (g, u) pairs of a gated MLP, H = rstd ⊙ (X·W̃ᵀ): the
// gate/up GEMM of SwiGLU / GeGLU with an RMSNorm folded in (rstd null: no
// norm). The weight's rows alternate gate and up (row 2j = gate[j], row 2j+1 =
// up[j]), so H's columns hold each (g, u) pair side by side.
struct NormGluArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, 2F (gate and up rows), in features
  const void* x = nullptr;           // (m, k) the norm's input, not normalized
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n, k) W̃ = W∘γ from fold_norm_weight, rows interleaved
  int64_t ldw = 0;
  const float* rstd = nullptr;       // (m) or null (no norm)
  Activation activation = Activation::kSiLU;  // the gate's
  void* h = nullptr;                 // (m, n) out H (the backward's input)
  int64_t ldh = 0;
  void* a = nullptr;                 // (m, n/2) out A
  int64_t lda = 0;
};

// dH = (dg, du) from dA = dY·W_down and the saved H: du = dA ⊙ act(g),
// dg = dA ⊙ u ⊙ act'(g), written interleaved as H is, and the RMSNorm row dot
// c₁ = norm_scale·Σ_n dH ⊙ H in the same epilogue.
struct GluDgradArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, F (A's width), out features of the down projection
  const void* dy = nullptr;          // (m, k)
  int64_t lddy = 0;
  const void* weight = nullptr;      // (k, n) W_down, nn.Linear layout
  int64_t ldw = 0;
  Activation activation = Activation::kSiLU;
  const void* h = nullptr;           // (m, 2n) H, (g, u) pairs; ldh even, 16-byte aligned rows
  int64_t ldh = 0;
  void* dh = nullptr;                // (m, 2n) out dH; lddh even
  int64_t lddh = 0;
  float norm_scale = 1.f;            // 1 / the norm's size
  float* norm_c1 = nullptr;          // (m) out, or null
};

// Y = RoPE(rstd ⊙ (X·W̃ᵀ) + t): the QKV projection of an RMSNorm'd X with its
// rotary embedding in the epilogue. Each adjacent column pair (2j, 2j+1) is
// rotated by φ = 2π·pos[m]·(freq[2j] + freq[2j+1]) (freq in turns, split hi +
// lo; 0 on v's columns); for Hugging Face's rotate-half convention the q/k
// head rows of W are stored pair-permuted (python/coda/ops/rope.py).
struct NormRopeArgs {
  int64_t m = 0, n = 0, k = 0;
  const void* x = nullptr;           // (m, k)
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n, k) W̃
  int64_t ldw = 0;
  const float* rstd = nullptr;       // (m) or null (no norm)
  const float* shift = nullptr;      // (n) t, or null
  const int32_t* positions = nullptr;  // (m), exact below 2^24
  const float* freq = nullptr;       // (n)
  void* y = nullptr;                 // (m, n) out
  int64_t ldy = 0;
};

// dP = R(−φ)·dY per column pair (the gradient before the rotation) and,
// optionally, the RMSNorm row dot c₁[m] = scale·Σ_n dP ⊙ (R(−φ)·Y − shift)
// from the forward's rotated output Y.
struct RopeBackwardArgs {
  int64_t m = 0, n = 0;              // tokens, columns (even)
  const void* dy = nullptr;          // (m, n) gradient of the rotated output
  int64_t lddy = 0;
  const void* y = nullptr;           // (m, n) the rotated output, or null (then c1 must be null)
  int64_t ldy = 0;
  const int32_t* positions = nullptr;  // (m)
  const float* freq = nullptr;       // (n) as NormRopeArgs
  const float* shift = nullptr;      // (n) or null
  float scale = 1.f;
  void* dp = nullptr;                // (m, n) out; may be dy (in place)
  int64_t lddp = 0;
  float* c1 = nullptr;               // (m) out, or null
};

// A dropout draw's seed and offset (Philox4x32-10, csrc/philox.cuh): values, or,
// under CUDA-graph capture, where torch's generator keeps them in device memory
// (at::PhiloxCudaState), so that each replay draws anew.
struct DropoutRng {
  uint64_t seed = 0, offset = 0;
  const int64_t* seed_ptr = nullptr;     // non-null: read *seed_ptr and *offset_ptr + offset_intragraph
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
};

// GPT-2's residual dropout: Y = R + mask ⊙ X / keep, mask[i, j] = 1 with
// probability keep (a function of the draw and the element i·n + j, so the
// backward regenerates it), and optionally the next norm's row statistics of
// Y as stored (mean null: RMSNorm). The draw's (seed, offset) are written to
// rng_state (2 int64, device) for the backward.
struct DropoutResidualArgs {
  int64_t m = 0, n = 0;
  const void* x = nullptr;           // (m, n)
  int64_t ldx = 0;
  const void* residual = nullptr;    // (m, n)
  int64_t ld_residual = 0;
  float keep = 1.f;                  // 1 − p, in (0, 1]
  DropoutRng rng;
  int64_t* rng_state = nullptr;      // (2) out
  void* y = nullptr;                 // (m, n) out
  int64_t ldy = 0;
  float eps = 1e-5f;
  float* mean = nullptr;             // (m) out, or null (RMSNorm)
  float* rstd = nullptr;             // (m) out, or null (no statistics)
};

// Its backward for X: dX = mask ⊙ dY / keep, the mask regenerated from the
// forward's rng_state (the residual's gradient is dY itself).
struct DropoutBackwardArgs {
  int64_t m = 0, n = 0;
  const void* dy = nullptr;          // (m, n)
  int64_t lddy = 0;
  float keep = 1.f;
  const int64_t* rng_state = nullptr;  // (2) the forward's
  void* dx = nullptr;                // (m, n) out
  int64_t lddx = 0;
};

// Gemma's sandwich norms: Y = R + γ ⊙ X·rstd, rstd = rsqrt(mean(X²) + eps)
// per row, an RMSNorm of a GEMM's output before the residual add (γ = 1 +
// weight where zero_centered, in fp32). rstd (m) is written for the backward.
struct RmsNormResidualArgs {
  int64_t m = 0, n = 0;
  const void* x = nullptr;           // (m, n)
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n)
  bool zero_centered = false;
  float eps = 1e-6f;
  const void* residual = nullptr;    // (m, n)
  int64_t ld_residual = 0;
  void* y = nullptr;                 // (m, n) out
  int64_t ldy = 0;
  float* rstd = nullptr;             // (m) out
};

// Its backward: dX = rstd·(g − x̂·mean(g ⊙ x̂)), g = dY ⊙ γ, x̂ = X·rstd (the
// residual's gradient is dY itself), and dweight as fp32 partial sums
// dweight_partials[p][j] = Σ over block p's rows of dY ⊙ x̂, for p <
// rmsnorm_residual_partials(m), or null.
struct RmsNormResidualBackwardArgs {
  int64_t m = 0, n = 0;
  const void* dy = nullptr;          // (m, n)
  int64_t lddy = 0;
  const void* x = nullptr;           // as the forward's
  int64_t ldx = 0;
  const void* weight = nullptr;
  bool zero_centered = false;
  const float* rstd = nullptr;       // (m) the forward's
  void* dx = nullptr;                // (m, n) out
  int64_t lddx = 0;
  float* dweight_partials = nullptr;  // (rmsnorm_residual_partials(m), n) out, or null
};

// Qwen3's and Gemma 3's q / k path after the projection, per token m and head h
// of rows holding `heads` heads of head_dim elements each (coda's pair order:
// the head's dims j and j + head_dim/2 adjacent, as NormRopeArgs writes q and k):
//   n = weight ⊙ x·rsqrt(mean(x²) + eps)       (an RMSNorm of the head)
//   y = R(φ)·n per pair (2j, 2j+1), φ = pos[m]·inv_freq[j] (float32, as Hugging Face)
// weight (head_dim,) in pair order; head_dim 64, 128 or 256.
struct HeadNormRopeArgs {
  int64_t m = 0, heads = 0, head_dim = 0;
  const void* x = nullptr;           // (m, heads, head_dim): row stride ldx, heads adjacent
  int64_t ldx = 0;
  const void* weight = nullptr;      // (head_dim)
  const int32_t* positions = nullptr;  // (m)
  const float* inv_freq = nullptr;   // (head_dim / 2)
  float eps = 1e-6f;
  void* y = nullptr;                 // (m, heads, head_dim) out, row stride ldy
  int64_t ldy = 0;
};

// Its backward from the forward's input x: dx (may not alias dy or x) and the
// weight gradient as fp32 partial sums, dweight_partials[p][j] for
// p < head_norm_rope_partials(args) (their sum over p is dweight), or null.
struct HeadNormRopeBackwardArgs {
  int64_t m = 0, heads = 0, head_dim = 0;
  const void* dy = nullptr;          // (m, heads, head_dim), row stride lddy
  int64_t lddy = 0;
  const void* x = nullptr;           // as HeadNormRopeArgs
  int64_t ldx = 0;
  const void* weight = nullptr;
  const int32_t* positions = nullptr;
  const float* inv_freq = nullptr;
  float eps = 1e-6f;
  void* dx = nullptr;                // (m, heads, head_dim) out, row stride lddx
  int64_t lddx = 0;
  float* dweight_partials = nullptr;  // (head_norm_rope_partials, head_dim) out, or null
};

// The cross-entropy rows of the fused LM head + loss (csrc/cross_entropy_kernels.cu):
// per row of a chunk of logits, the loss and log-sum-exp, and, with
// write_grad, d loss / d logits written over the logits (scaled by
// *grad_scale and row_grad[r] where given). The logits may be a slice of the
// vocabulary's columns [col0, col0 + n) of `vocab`: with `partial` each call
// folds its slice into per-row running statistics and the `last` writes the
// loss and lse; with lse_in (the rows' log-sum-exps from such a pass) only
// the gradient is written. The LM-head GEMMs around it are the caller's
// (torch's linear_cross_entropy op runs them chunk by chunk).
struct CrossEntropyArgs {
  int64_t m = 0, n = 0;              // rows (tokens), columns: the vocabulary or a slice of it
  void* logits = nullptr;            // (m, n) in; the gradient out when write_grad
  int64_t ld = 0;                    // a multiple of 8, logits 16-byte aligned
  const int64_t* target = nullptr;   // (m) class per row, or ignore_index
  int64_t ignore_index = -100;
  float label_smoothing = 0.f;
  float softcap = 0.f;               // > 0: logits -> softcap·tanh(logits/softcap)
  float z_loss = 0.f;                // adds z_loss·lse² per row
  const float* grad_scale = nullptr; // () scale of every row's gradient, or null (1)
  const float* row_grad = nullptr;   // (m) per-row scale, or null (1)
  bool write_grad = false;
  float* loss = nullptr;             // (m) out; may be null with lse_in
  float* lse = nullptr;              // (m) out, or null
  const float* lse_in = nullptr;     // (m) in, or null: the gradient only (write_grad)
  float* partial = nullptr;          // (m, 4) running max, Σexp, target logit, Σz: in and out, or null
  bool first = false, last = false;  // with partial: the first slice starts the statistics, the last ends them
  int64_t col0 = 0;                  // with lse_in or partial: the slice's first class
  int64_t vocab = 0;                 // with lse_in or partial: the whole vocabulary (0: n)
};

// d loss / d logits of a slice of the vocabulary in the epilogue of the GEMM
// that recomputes the slice's logits (the recomputing backward of the LM
// head's loss, given the rows' lse from its forward):
//   z = round(X·Wᵀ + bias), z' = softcap·tanh(z/softcap) (softcap > 0, else z),
//   dz = scale[m]·(exp(z' − lse[m])·(1 + 2·z_loss·lse[m]) − ls/vocab
//                  − [classes[n] = target[m]]·(1 − ls))·(1 − (z'/softcap)²)
// with the last factor only for softcap > 0, and dz = 0 where scale[m] = 0.
// The caller sets scale to 0 on ignored rows and NaN where the target is
// outside the vocabulary.
struct LinearCrossEntropyGradArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, the slice's classes, features
  const void* x = nullptr;           // (m, k)
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n, k): the slice's rows of W
  int64_t ldw = 0;
  const void* bias = nullptr;        // (n) or null
  const float* classes = nullptr;    // (n) each column's class, as float (exact below 2^24)
  const float* lse = nullptr;        // (m)
  const float* target = nullptr;     // (m) each row's class, as float
  const float* scale = nullptr;      // (m) each row's gradient scale
  float label_smoothing = 0.f;       // ls, in [0, 1)
  float softcap = 0.f;               // > 0: logits capped as above
  float z_loss = 0.f;
  int64_t vocab = 0;                 // the whole vocabulary (label smoothing's), ≥ n
  void* dz = nullptr;                // (m, n) out
  int64_t lddz = 0;
};

// Each op runs on `stream`. `workspace` may be null: then the op allocates
// what it needs stream-ordered (cudaMallocAsync) and frees it after.
Status linear(DType dtype, const LinearArgs& args, void* workspace, size_t workspace_bytes,
              cudaStream_t stream);
Status dgrad(DType dtype, const DgradArgs& args, void* workspace, size_t workspace_bytes,
             cudaStream_t stream);
Status wgrad(DType dtype, const WgradArgs& args, void* workspace, size_t workspace_bytes,
             cudaStream_t stream);

Status fold_norm_weight(DType dtype, const FoldNormWeightArgs& args, cudaStream_t stream);
Status row_stats(DType dtype, const RowStatsArgs& args, cudaStream_t stream);
Status norm_linear(DType dtype, const NormLinearArgs& args, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);
Status linear_residual(DType dtype, const LinearResidualArgs& args, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);
Status norm_row_dots(DType dtype, const NormRowDotsArgs& args, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream);
Status norm_dgrad(DType dtype, const NormDgradArgs& args, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream);

Status norm_glu_linear(DType dtype, const NormGluArgs& args, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);
Status glu_dgrad(DType dtype, const GluDgradArgs& args, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream);
Status norm_rope_linear(DType dtype, const NormRopeArgs& args, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);
Status rope_backward(DType dtype, const RopeBackwardArgs& args, cudaStream_t stream);
Status dropout_residual(DType dtype, const DropoutResidualArgs& args, cudaStream_t stream);
Status dropout_backward(DType dtype, const DropoutBackwardArgs& args, cudaStream_t stream);
Status rmsnorm_residual(DType dtype, const RmsNormResidualArgs& args, cudaStream_t stream);
Status rmsnorm_residual_backward(DType dtype, const RmsNormResidualBackwardArgs& args, cudaStream_t stream);
// The rows of rmsnorm_residual_backward's dweight_partials for m rows.
int64_t rmsnorm_residual_partials(int64_t m);
Status head_norm_rope(DType dtype, const HeadNormRopeArgs& args, cudaStream_t stream);
Status head_norm_rope_backward(DType dtype, const HeadNormRopeBackwardArgs& args, cudaStream_t stream);
// The rows of head_norm_rope_backward's dweight_partials for these sizes.
int64_t head_norm_rope_partials(int64_t m, int64_t heads);
Status cross_entropy(DType dtype, const CrossEntropyArgs& args, cudaStream_t stream);
Status linear_cross_entropy_grad(DType dtype, const LinearCrossEntropyGradArgs& args, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream);
// x[i] ← x[i]·(*scale) for i < n, computed in float and rounded once, the
// scale read on the device: gradients a fused loss computed in its forward,
// times the upstream gradient, with no host sync.
Status scale(DType dtype, void* x, int64_t n, const float* scale, cudaStream_t stream);
// dst[i] ← round(src[i]·(*scale)) for i < n into dtype (bf16 or fp16), src
// float32, scale read on the device (null: 1): a float32 gradient scaled and
// rounded once in one pass. dst is src itself (in place: the result fills the
// buffer's first 2n bytes) or does not overlap it.
Status scale_round(DType dtype, const float* src, void* dst, int64_t n, const float* scale, cudaStream_t stream);

size_t linear_workspace_size(DType dtype, const LinearArgs& args);
size_t norm_linear_workspace_size(DType dtype, const NormLinearArgs& args);
size_t linear_residual_workspace_size(DType dtype, const LinearResidualArgs& args);
size_t norm_dgrad_workspace_size(DType dtype, const NormDgradArgs& args);
size_t norm_row_dots_workspace_size(DType dtype, const NormRowDotsArgs& args);
size_t dgrad_workspace_size(DType dtype, const DgradArgs& args);
size_t wgrad_workspace_size(DType dtype, const WgradArgs& args);
size_t norm_glu_linear_workspace_size(DType dtype, const NormGluArgs& args);
size_t glu_dgrad_workspace_size(DType dtype, const GluDgradArgs& args);
size_t norm_rope_linear_workspace_size(DType dtype, const NormRopeArgs& args);
size_t linear_cross_entropy_grad_workspace_size(DType dtype, const LinearCrossEntropyGradArgs& args);

// True when the device can run coda's kernels (sm_90).
bool device_supported(int device);

// Whether the vendor library's plain GEMM (cuBLAS) is the better kernel on a
// device of `sms` SMs for a dgrad with no epilogue work (Activation::kIdentity,
// no dbias, no row dots) and for a wgrad, of these (m, n, k) as in DgradArgs
// and WgradArgs: a caller holding cuBLAS asks before dgrad / wgrad.
bool dgrad_prefers_vendor_gemm(int64_t m, int64_t n, int64_t k, int sms);
bool wgrad_prefers_vendor_gemm(int64_t m, int64_t n, int64_t k, int sms);

}  // namespace coda
