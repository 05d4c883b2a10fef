// Y = gelu(X·Wᵀ + b) through coda's C++ API, checked against a double
// reference on the host. Exits 0 and says so when no sm_90 GPU is present.
#include <coda/coda.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#define CHECK_CUDA(expr)                                                              \
  do {                                                                                \
    cudaError_t _e = (expr);                                                          \
    if (_e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(_e));         \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

}  // namespace

int main() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || !coda::device_supported(device)) {
    std::printf("linear_gelu: no sm_90 GPU here, nothing to run\n");
    return 0;
  }
  const int64_t m = 1000, n = 3000, k = 1032;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> x(m * k), w(n * k), b(n), y(m * n, 0xffff);
  for (auto& v : x) v = to_bf16(normal(rng));
  for (auto& v : w) v = to_bf16(normal(rng) / std::sqrt(float(k)));
  for (auto& v : b) v = to_bf16(normal(rng));

  void *dx, *dw, *db, *dy;
  CHECK_CUDA(cudaMalloc(&dx, x.size() * 2));
  CHECK_CUDA(cudaMalloc(&dw, w.size() * 2));
  CHECK_CUDA(cudaMalloc(&db, b.size() * 2));
  CHECK_CUDA(cudaMalloc(&dy, y.size() * 2));
  CHECK_CUDA(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dy, 0xff, y.size() * 2));  // NaN poison: unwritten outputs fail

  coda::LinearArgs args;
  args.m = m; args.n = n; args.k = k;
  args.x = dx; args.ldx = k;
  args.weight = dw; args.ldw = k;
  args.bias = db;
  args.activation = coda::Activation::kGeluTanh;
  args.y = dy; args.ldy = n;
  coda::Status s = coda::linear(coda::DType::kBFloat16, args, nullptr, 0, nullptr);
  if (s != coda::Status::kSuccess) {
    std::fprintf(stderr, "coda::linear: %s: %s\n", coda::status_string(s), coda::last_error_message());
    return 1;
  }
  CHECK_CUDA(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));

  double err = 0, ref_norm = 0;
  for (int64_t i = 0; i < m; i += 7) {  // every 7th row keeps the host reference quick
    for (int64_t j = 0; j < n; ++j) {
      double h = from_bf16(b[j]);
      for (int64_t t = 0; t < k; ++t) h += double(from_bf16(x[i * k + t])) * from_bf16(w[j * k + t]);
      double ref = 0.5 * h * (1 + std::tanh(0.7978845608028654 * (h + 0.044715 * h * h * h)));
      double got = from_bf16(y[i * n + j]);
      err += (got - ref) * (got - ref);
      ref_norm += ref * ref;
    }
  }
  double rel = std::sqrt(err / ref_norm);
  std::printf("linear_gelu: m=%lld n=%lld k=%lld  |Y - ref| / |ref| = %.3e\n", (long long)m, (long long)n,
              (long long)k, rel);
  cudaFree(dx); cudaFree(dw); cudaFree(db); cudaFree(dy);
  return std::isfinite(rel) && rel < 1e-2 ? 0 : 1;
}
