#include "host_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>

namespace coda::torch_ops::host {

namespace {

struct Lse {
  float m, s;
};

Lse combine(Lse a, Lse b) {
  const float m = std::fmax(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * std::exp(a.m - m) + b.s * std::exp(b.m - m)};
}

float capped(float z, float cap) { return cap > 0.f ? cap * std::tanh(z / cap) : z; }

// d loss / d z of one logit, unscaled: off = ls/V, hit = 1 − ls, zl = 2·z_loss·lse.
float grad_of(float raw, float lse, float cap, float off, float hit, float zl, bool is_target) {
  const float z = capped(raw, cap);
  float g = std::exp(z - lse) * (1.f + zl) - off - (is_target ? hit : 0.f);
  if (cap > 0.f) g *= 1.f - (z / cap) * (z / cap);
  return g;
}

template <class T>
void rows(const CrossEntropyArgs& a) {
  const float cap = a.softcap, eps = a.label_smoothing;
  for (int64_t r = 0; r < a.m; ++r) {
    T* row = static_cast<T*>(a.logits) + r * a.ld;
    const int64_t t = a.target[r];
    if (t == a.ignore_index) {
      if (a.loss != nullptr && (a.partial == nullptr || a.last)) {
        a.loss[r] = 0.f;
        if (a.lse != nullptr) a.lse[r] = 0.f;
      }
      if (a.write_grad) std::fill(row, row + a.n, T(0.f));
      continue;
    }
    const int64_t vocab = a.vocab > 0 ? a.vocab : a.n, tc = t - a.col0;
    const bool bad = t < 0 || t >= vocab;
    float lse;
    if (a.lse_in != nullptr) {
      lse = a.lse_in[r];
    } else {
      Lse acc{-INFINITY, 0.f};
      float zsum = 0.f;
      for (int64_t j = 0; j < a.n; ++j) {
        const float z = capped(float(row[j]), cap);
        zsum += z;
        acc = combine(acc, {z, 1.f});
      }
      lse = acc.m + std::log(acc.s);
      float zt = !bad && tc >= 0 && tc < a.n ? capped(float(row[tc]), cap) : 0.f, lse_all = lse, zsum_all = zsum;
      if (a.partial != nullptr) {
        float* st = a.partial + 4 * r;
        Lse run{a.first ? -INFINITY : st[0], a.first ? 0.f : st[1]};
        run = combine(run, acc);
        zt += a.first ? 0.f : st[2];
        zsum_all += a.first ? 0.f : st[3];
        st[0] = run.m;
        st[1] = run.s;
        st[2] = zt;
        st[3] = zsum_all;
        lse_all = run.m + std::log(run.s);
      }
      if (a.partial == nullptr || a.last) {
        const float loss = (1.f - eps) * (lse_all - zt) + eps * (lse_all - zsum_all / float(vocab)) +
                           a.z_loss * lse_all * lse_all;
        a.loss[r] = bad ? NAN : loss;
        if (a.lse != nullptr) a.lse[r] = lse_all;
      }
      if (!a.write_grad) continue;
    }
    float scale = (a.grad_scale != nullptr ? *a.grad_scale : 1.f) * (a.row_grad != nullptr ? a.row_grad[r] : 1.f);
    if (bad) scale = NAN;
    const float off = eps / float(vocab), hit = 1.f - eps, zl = 2.f * a.z_loss * lse;
    for (int64_t j = 0; j < a.n; ++j) row[j] = T(scale * grad_of(float(row[j]), lse, cap, off, hit, zl, j == tc));
  }
}

template <class F>
void with_type(at::ScalarType dtype, const char* what, F&& f) {
  if (dtype == at::kBFloat16) return f(c10::BFloat16());
  if (dtype == at::kHalf) return f(c10::Half());
  TORCH_CHECK(false, "coda: ", what, ": dtype must be bfloat16 or float16, got ", dtype);
}

}  // namespace

void cross_entropy(at::ScalarType dtype, const CrossEntropyArgs& a) {
  with_type(dtype, "cross_entropy", [&](auto tag) { rows<decltype(tag)>(a); });
}

void scale_round(at::ScalarType dtype, const float* src, void* dst, int64_t n, const float* scale) {
  with_type(dtype, "scale_round", [&](auto tag) {
    using T = decltype(tag);
    const float s = scale != nullptr ? *scale : 1.f;
    // ascending: element i's 2 bytes land on bytes of elements ≤ i/2, all read already
    for (int64_t i = 0; i < n; ++i) {
      const float v = src[i] * s;
      static_cast<T*>(dst)[i] = T(v);
    }
  });
}

void scale(at::ScalarType dtype, void* x, int64_t n, const float* scale) {
  with_type(dtype, "scale", [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(x);
    for (int64_t i = 0; i < n; ++i) p[i] = T(float(p[i]) * *scale);
  });
}

void linear_cross_entropy_grad(at::Tensor& dz, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                               const at::Tensor& classes, const at::Tensor& lse, const at::Tensor& target,
                               const at::Tensor& scale, float label_smoothing, float softcap, float z_loss,
                               int64_t vocab) {
  at::Tensor acc = at::mm(x.to(at::kFloat), w.to(at::kFloat).t());
  if (bias.defined()) acc.add_(bias.to(at::kFloat));
  dz.copy_(acc);  // the logits, rounded as the GEMM's epilogue rounds them
  const float off = label_smoothing / float(vocab), hit = 1.f - label_smoothing;
  const float *cls = classes.data_ptr<float>(), *l = lse.data_ptr<float>(), *t = target.data_ptr<float>(),
              *s = scale.data_ptr<float>();
  with_type(dz.scalar_type(), "linear_cross_entropy_grad", [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < dz.size(0); ++r) {
      T* row = static_cast<T*>(dz.data_ptr()) + r * dz.stride(0);
      for (int64_t j = 0; j < dz.size(1); ++j) {
        const float g = grad_of(float(row[j]), l[r], softcap, off, hit, 2.f * z_loss * l[r], cls[j] == t[r]);
        row[j] = T(s[r] == 0.f ? 0.f : s[r] * g);
      }
    }
  });
}

}  // namespace coda::torch_ops::host
