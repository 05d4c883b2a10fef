// Bad arguments get a Status and a message naming the argument; prints
// "N passed, M failed" and exits non-zero on any failure.
#include <coda/coda.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

int passed = 0, failed = 0;

void expect(const char* what, coda::Status got, coda::Status want, const char* needle) {
  const char* msg = coda::last_error_message();
  bool ok = got == want && (needle == nullptr || std::strstr(msg, needle) != nullptr);
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAIL %s: got %s (%s), want %s containing '%s'\n", what, coda::status_string(got), msg,
                coda::status_string(want), needle ? needle : "");
  }
}

// Host buffers stand in for device pointers: validation never dereferences them.
alignas(16) uint16_t buffer[1 << 16];

coda::LinearArgs good_linear() {
  coda::LinearArgs a;
  a.m = 16; a.n = 64; a.k = 32;
  a.x = buffer; a.ldx = 32;
  a.weight = buffer; a.ldw = 32;
  a.y = buffer; a.ldy = 64;
  return a;
}

}  // namespace

int main() {
  using coda::Status;
  auto run = [](const coda::LinearArgs& a) { return coda::linear(coda::DType::kBFloat16, a, nullptr, 0, nullptr); };

  coda::LinearArgs a = good_linear();
  a.x = nullptr;
  expect("null x", run(a), Status::kInvalidArgument, "x is null");

  a = good_linear();
  a.x = reinterpret_cast<const char*>(buffer) + 2;
  expect("misaligned x", run(a), Status::kMisaligned, "x must be 16-byte aligned");

  a = good_linear();
  a.k = 30; a.ldx = 30; a.ldw = 30;
  expect("k not a multiple of 8", run(a), Status::kMisaligned, "multiples of 8");

  a = good_linear();
  a.ldy = 32;
  expect("ldy < n", run(a), Status::kInvalidArgument, "y: leading dimension 32 is smaller");

  a = good_linear();
  a.n = -8;
  expect("negative n", run(a), Status::kInvalidArgument, "sizes must be positive");

  a = good_linear();
  a.activation = static_cast<coda::Activation>(42);
  expect("unknown activation", run(a), Status::kInvalidArgument, "unknown activation 42");

  a = good_linear();
  a.bias = reinterpret_cast<const char*>(buffer) + 4;
  expect("misaligned bias", run(a), Status::kMisaligned, "bias must be 16-byte aligned");

  a = good_linear();
  expect("bad dtype", coda::linear(static_cast<coda::DType>(7), a, nullptr, 0, nullptr), Status::kInvalidArgument,
         "dtype must be bfloat16 or float16");

  coda::DgradArgs d;
  d.m = 16; d.n = 64; d.k = 32;
  d.dy = buffer; d.lddy = 32; d.weight = buffer; d.ldw = 64; d.dx = buffer; d.lddx = 64;
  d.activation = coda::Activation::kGeluTanh;
  expect("dgrad without pre_act", coda::dgrad(coda::DType::kBFloat16, d, nullptr, 0, nullptr),
         Status::kInvalidArgument, "pre_act is required");

  coda::WgradArgs w;
  w.m = 64; w.n = 32; w.k = 16;
  w.dy = buffer; w.lddy = 64; w.x = buffer; w.ldx = 32; w.dw = nullptr; w.lddw = 32;
  expect("wgrad null dw", coda::wgrad(coda::DType::kFloat16, w, nullptr, 0, nullptr), Status::kInvalidArgument,
         "dw is null");

  alignas(16) static float rows[64];
  const auto good_ce = [] {
    coda::LinearCrossEntropyGradArgs c;
    c.m = 16; c.n = 64; c.k = 32;
    c.x = buffer; c.ldx = 32; c.weight = buffer; c.ldw = 32;
    c.classes = rows; c.lse = rows; c.target = rows; c.scale = rows;
    c.vocab = 1000;
    c.dz = buffer; c.lddz = 64;
    return c;
  };
  const auto run_ce = [](const coda::LinearCrossEntropyGradArgs& c) {
    return coda::linear_cross_entropy_grad(coda::DType::kBFloat16, c, nullptr, 0, nullptr);
  };
  coda::LinearCrossEntropyGradArgs c = good_ce();
  c.lse = nullptr;
  expect("ce grad null lse", run_ce(c), Status::kInvalidArgument, "lse is null");
  c = good_ce();
  c.classes = rows + 1;
  expect("ce grad misaligned classes", run_ce(c), Status::kMisaligned, "classes must be 16-byte aligned");
  c = good_ce();
  c.vocab = 32;
  expect("ce grad vocab < n", run_ce(c), Status::kInvalidArgument, "vocab must be at least n");
  c = good_ce();
  c.label_smoothing = 1.f;
  expect("ce grad label smoothing 1", run_ce(c), Status::kInvalidArgument, "label_smoothing must be in [0, 1)");
  c = good_ce();
  c.n = 60; c.lddz = 60;
  expect("ce grad slice of 60 classes", run_ce(c), Status::kMisaligned, "multiples of 8");

  // A valid call on a machine without an sm_90 GPU says so instead of launching.
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || !coda::device_supported(device)) {
    expect("no sm_90 device", run(good_linear()), Status::kNotSupported, "");
    expect("ce grad, no sm_90 device", run_ce(good_ce()), Status::kNotSupported, "");
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
