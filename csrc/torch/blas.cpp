#include "blas.h"

#include <ATen/cuda/CUDAContext.h>

#include <climits>
#include <string>

namespace coda::torch_ops::blas {

namespace {

void check(cublasStatus_t s, const char* what) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "coda: ", what, " failed: ", cublasGetStatusString(s));
}

cudaDataType_t type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "coda: blas::matmul takes bfloat16, float16 or float32, got ", t.scalar_type());
  }
}

int to_int(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= INT_MAX, "coda: blas::matmul: ", what, " = ", v, " exceeds cuBLAS's int");
  return static_cast<int>(v);
}

// A row-major (M, K) matrix read by column-major cuBLAS: with unit column
// stride it is stored as its transpose (op N), with unit row stride as
// itself (op T). `t` holds a copy where neither fits.
struct Operand {
  at::Tensor t;
  cublasOperation_t op;
  int64_t ld;
};

Operand operand(const at::Tensor& x) {
  if (x.stride(1) == 1 && x.stride(0) >= std::max<int64_t>(1, x.size(1))) return {x, CUBLAS_OP_N, x.stride(0)};
  if (x.stride(0) == 1 && x.stride(1) >= std::max<int64_t>(1, x.size(0))) return {x, CUBLAS_OP_T, x.stride(1)};
  at::Tensor c = x.contiguous();
  return {c, CUBLAS_OP_N, std::max<int64_t>(1, c.size(1))};
}

// The handle's math mode for the guard's lifetime; the handle is the calling
// thread's (torch keeps one per thread and device), so no other thread sees it.
class MathMode {
 public:
  MathMode(cublasHandle_t h, cublasMath_t mode) : h_(h) {
    check(cublasGetMathMode(h_, &saved_), "cublasGetMathMode");
    check(cublasSetMathMode(h_, mode), "cublasSetMathMode");
  }
  ~MathMode() { cublasSetMathMode(h_, saved_); }
  MathMode(const MathMode&) = delete;
  MathMode& operator=(const MathMode&) = delete;

 private:
  cublasHandle_t h_;
  cublasMath_t saved_{};
};

}  // namespace

void matmul(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float beta) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                  c.size(1) == b.size(1),
              "coda: blas::matmul: shapes ", a.sizes(), " x ", b.sizes(), " -> ", c.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (c.scalar_type() == a.scalar_type() || c.scalar_type() == at::kFloat),
              "coda: blas::matmul: operands ", a.scalar_type(), ", ", b.scalar_type(), " into ", c.scalar_type());
  TORCH_CHECK(a.device() == c.device() && b.device() == c.device() && (c.is_cuda() || c.is_cpu()),
              "coda: blas::matmul takes CUDA tensors (or CPU ones: the loss ops' host registration), got ",
              a.device(), ", ", b.device(), " into ", c.device());
  TORCH_CHECK(c.stride(1) == 1 && c.stride(0) >= std::max<int64_t>(1, c.size(1)),
              "coda: blas::matmul: c needs unit column stride, has strides ", c.strides());
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    beta == 0.f ? c.zero_() : c.mul_(beta);
    return;
  }
  if (c.is_cpu()) {  // the same contract in float32, rounded once into c
    at::Tensor r = at::mm(a.to(at::kFloat), b.to(at::kFloat));
    if (beta != 0.f) r.add_(c.to(at::kFloat), beta);
    c.copy_(r);
    return;
  }
  // Column-major cuBLAS computes cᵀ (n, m) = bᵀ (n, k) · aᵀ (k, m).
  const Operand A = operand(b), B = operand(a);
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  MathMode mode(h, c.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat
                       ? CUBLAS_DEFAULT_MATH
                       : cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  const float alpha = 1.f;
  check(cublasGemmEx(h, A.op, B.op, to_int(n, "N"), to_int(m, "M"), to_int(k, "K"), &alpha, A.t.data_ptr(),
                     type_of(A.t), to_int(A.ld, "lda"), B.t.data_ptr(), type_of(B.t), to_int(B.ld, "ldb"), &beta,
                     c.data_ptr(), type_of(c), to_int(c.stride(0), "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
}

}  // namespace coda::torch_ops::blas
