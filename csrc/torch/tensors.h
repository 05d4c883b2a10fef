// What every fused op's C++ implementation shares: tensors made kernel-ready,
// outputs allocated, statuses turned into errors, and the registration of an
// op's schema with its CUDA implementation in one line (CODA_TORCH_OP).
//
// The user-facing argument checks are Python's (python/coda/ops/_checks.py)
// and the pointer checks the C++ API's; the shape invariants here only keep
// a direct caller of torch.ops.coda.* from reaching a kernel with a wrong
// shape.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <vector>
#include <optional>

#include "coda/coda.h"

namespace coda::torch_ops {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

inline DType dtype_of(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, "coda: expected bfloat16 or float16, got ",
              t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
}

inline bool aligned16(const Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// A 2-D tensor as the kernels read it: unit column stride, a row stride of at
// least a row and a multiple of 8 elements, 16-byte aligned. Anything else
// (an expanded dy with row stride 0, a transposed view, a slice at an odd
// offset) is copied, never handed over with a leading dimension the kernel
// would misread.
inline Tensor rows(const Tensor& t) {
  Tensor r = t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
  const bool ready = r.stride(1) == 1 && r.stride(0) >= r.size(1) && r.stride(0) % 8 == 0 &&
                     (r.numel() == 0 || aligned16(r));
  return ready ? r : r.clone(at::MemoryFormat::Contiguous);
}

inline OptTensor rows(const OptTensor& t) { return t ? OptTensor(rows(*t)) : std::nullopt; }

// A contiguous, 16-byte-aligned vector.
inline Tensor vec(const Tensor& t) {
  return t.is_contiguous() && (t.numel() == 0 || aligned16(t)) ? t : t.clone(at::MemoryFormat::Contiguous);
}

inline OptTensor vec(const OptTensor& t) { return t ? OptTensor(vec(*t)) : std::nullopt; }

inline const void* ptr(const OptTensor& t) { return t ? t->data_ptr() : nullptr; }
inline const float* f32_ptr(const OptTensor& t) { return t && t->numel() ? t->data_ptr<float>() : nullptr; }

inline void expect(bool ok, const char* what) { TORCH_CHECK(ok, "coda: ", what); }

// The fields LinearArgs and LinearResidualArgs share: y = x·wᵀ + bias + residual,
// x (M, K), w (N, K), row-major with a leading dimension.
template <class Args>
Args residual_gemm_args(const Tensor& x, const Tensor& w, const OptTensor& bias, const OptTensor& residual,
                        const Tensor& y) {
  Args a;
  a.m = x.size(0); a.n = w.size(0); a.k = x.size(1);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = w.data_ptr(); a.ldw = w.stride(0);
  a.bias = ptr(bias);
  a.residual = ptr(residual); a.ld_residual = residual ? residual->stride(0) : 0;
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  return a;
}

inline Tensor empty2(int64_t m, int64_t n, const Tensor& like) { return at::empty({m, n}, like.options()); }

// The ops take and return (..., features) as F.linear does, so that Python
// needs no reshape (and autograd no view node) around them: an output is
// allocated in x's leading shape with n features, and the kernels write it
// through its (rows, n) view.
inline Tensor empty_rows_of(const Tensor& x, int64_t n) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return at::empty(shape, x.options());
}
inline Tensor flat(const Tensor& t) { return t.view({-1, t.size(-1)}); }
inline Tensor empty1(int64_t n, const Tensor& like) { return at::empty({n}, like.options()); }
inline Tensor f32(at::IntArrayRef shape, const Tensor& like) { return at::empty(shape, like.options().dtype(at::kFloat)); }
// Row statistics: (2, M) fp32, row 0 the mean, row 1 rstd, each row a
// 16-byte-aligned vector (a row stride of M rounded up to 4 floats), so that
// rstd is as aligned as the mean for any M.
inline Tensor stats_buffer(int64_t m, const Tensor& like) {
  return f32({2, (m + 3) / 4 * 4}, like).narrow(1, 0, m);
}
inline Tensor stats_rows(const Tensor& s) {
  TORCH_CHECK(s.dim() == 2 && s.size(0) == 2 && s.scalar_type() == at::kFloat, "coda: stats must be float32 (2, M), got ",
              s.scalar_type(), " ", s.sizes());
  if (s.stride(1) == 1 && s.stride(0) % 4 == 0 && s.stride(0) >= s.size(1) && aligned16(s)) return s;
  Tensor r = stats_buffer(s.size(1), s);
  r.copy_(s);
  return r;
}

// The (0,) tensor an op returns for an output it did not compute.
inline Tensor none(const Tensor& like) { return at::empty({0}, like.options()); }
inline Tensor none_f32(const Tensor& like) { return at::empty({0}, like.options().dtype(at::kFloat)); }

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// A weight gradient from a kernel's fp32 partial rows (p, n): their sum, in the weight's dtype (zeros
// of n where no row was written, m = 0).
inline Tensor sum_partials(const Tensor& partials, int64_t n, const Tensor& weight) {
  Tensor total = partials.numel() ? partials.sum(0) : at::zeros({n}, partials.options());
  return total.to(weight.scalar_type());
}

inline void check(Status s, const char* op) {
  TORCH_CHECK(s == Status::kSuccess, "coda::", op, " failed (", status_string(s), "): ", last_error_message());
}

// `bytes` of scratch for one C++ API call on the current stream. Calls on one
// stream run in order, so each thread keeps one buffer per device and stream
// and grows it, rather than allocating per call (an allocation costs about
// what a launch does on a slow host). Under CUDA graph capture the buffer is
// the graph's own, from torch's allocator: a kept one could be freed while a
// graph still refers to it.
inline void* workspace(size_t bytes, const Tensor& like) {
  if (bytes == 0) return nullptr;
  const cudaStream_t s = stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  thread_local Tensor graph_owned;  // kept until the next captured call: the graph holds the pointer
  if (cudaStreamIsCapturing(s, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    graph_owned = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
    return graph_owned.data_ptr();
  }
  struct Key {
    c10::DeviceIndex device;
    cudaStream_t stream;
    bool operator==(const Key& o) const { return device == o.device && stream == o.stream; }
  };
  struct Buffer {
    Key key;
    Tensor bytes;
  };
  thread_local std::vector<Buffer> kept;
  const Key key{like.device().index(), s};
  for (Buffer& b : kept) {
    if (!(b.key == key)) continue;
    if (static_cast<size_t>(b.bytes.numel()) < bytes) {
      b.bytes = at::empty({static_cast<int64_t>(bytes + bytes / 2)}, like.options().dtype(at::kByte));
    }
    return b.bytes.data_ptr();
  }
  kept.push_back({key, at::empty({static_cast<int64_t>(bytes + bytes / 2)}, like.options().dtype(at::kByte))});
  return kept.back().bytes.data_ptr();
}

// One C++ API call on a workspace of size(dtype, args) bytes.
template <class Args, class Run, class Size>
void call(const char* op, DType dt, const Args& a, const Tensor& like, Run run, Size size) {
  const size_t bytes = size(dt, a);
  check(run(dt, a, workspace(bytes, like), bytes, stream()), op);
}

inline Activation activation_of(int64_t a) {
  TORCH_CHECK(a >= 0 && a <= static_cast<int64_t>(Activation::kSiLU), "coda: unknown activation code ", a);
  return static_cast<Activation>(a);
}

}  // namespace coda::torch_ops

// An op's schema and its CUDA implementation, registered together; its fake
// (shapes only) and its autograd are Python's (python/coda/ops/).
#define CODA_TORCH_OP(fn, schema)                                          \
  TORCH_LIBRARY_FRAGMENT(coda, m) {                                        \
    m.def(schema);                                                         \
    m.impl(#fn, torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(fn)));    \
  }
