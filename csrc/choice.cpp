// The kernel choice by problem shape: which tile configuration, raster order
// and swizzle each GEMM runs with. benchmarks/NOTES.md has the measurements
// behind every rule.
#include <atomic>
#include <initializer_list>

#include "kernels.h"

namespace coda::kernels {

namespace {

// A test or benchmark override; -1 leaves a choice to the rule.
std::atomic<int> override_config{-1}, override_raster{-1}, override_swizzle{-1};

// The first configuration built for (p, t) in this order.
Config first_built(Program p, DType t, std::initializer_list<Config> order) {
  for (Config c : order) {
    if (is_built(p, t, c)) return c;
  }
  return *order.begin();
}

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// CUTLASS's sm90 tile scheduler caps the swizzle by the smaller of the two
// CTA counts (get_log_swizzle_size), then rounds both counts up to a multiple
// of swizzle x cluster and runs every padded tile: its mainloop loads zeros
// and its MMAs run. The scheduler's tile count for a swizzle cap `s`.
int64_t scheduled_tiles(int64_t bm, int64_t bn, const TileShape2& t, int s) {
  const int64_t smaller = bm < bn ? bm : bn;
  const int eff = s >= 8 && smaller >= 6 ? 8 : (s >= 4 && smaller >= 3 ? 4 : (s >= 2 && smaller >= 2 ? 2 : 1));
  return round_up(bm, eff * t.cluster_m) * round_up(bn, eff * t.cluster_n);
}

// The widest swizzle (8 groups the tiles that share operands in L2, best or
// tied at 16,384 x 4096) that pads the problem by at most 1/32 more tiles
// than no swizzle does. Swizzle 8 with a 1x2 cluster pads N to 16 tiles:
// at N = 1024 (8 tiles of 128) that ran every GEMM twice over, at N = 1536
// and 3072 a third more (benchmarks/NOTES.md).
int swizzle_for(Config c, int64_t m, int64_t n) {
  const TileShape2 t = tile_shape(c);
  const int64_t bm = (m + t.tile_m - 1) / t.tile_m, bn = (n + t.tile_n - 1) / t.tile_n;
  const int64_t floor = scheduled_tiles(bm, bn, t, 1);
  for (int s : {8, 4, 2}) {
    if (scheduled_tiles(bm, bn, t, s) * 32 <= floor * 33) return s;
  }
  return 1;
}

}  // namespace

Choice choose(Program p, DType t, int64_t m, int64_t n, int64_t k) {
  Choice c;
  switch (pass_of(p)) {  // one rule per pass: kernels/table.def gives every program its pass
    case Pass::kForward:
      // Ping-pong hides one warp group's epilogue behind the other's mainloop:
      // at 8,192 x d 1024-2048 and 2,048 x d 4096 it ran every forward 0.93-1.11x
      // cuBLAS (swizzle as below), the cooperative 128x256 tiles 1.04-1.6x.
      // fc2's shape (N < K) at 16,384 x 4096 is the exception, 1.028x against
      // 1.055x. With K <= 1024 (16 k-blocks a tile) or M <= 512 (4 row tiles)
      // the cooperative 128x128 tiles beat both for the plain forward: fc1 at
      // 8,192 x d 1024 1.34x against 1.61x, o-proj at 512 x d 2048 1.47x
      // against 1.89x.
      if ((k <= 1024 || m <= 512) && p == Program::kLinearAct && is_built(p, t, Config::kCooperative128x128)) {
        c.config = Config::kCooperative128x128;
      } else if (n < k && m * n >= (int64_t(1) << 26)) {
        c.config = first_built(p, t, {Config::kCooperative128x256, Config::kPingpong128x128});
      } else {
        c.config = first_built(p, t, {Config::kPingpong128x128, Config::kCooperative128x256});
      }
      c.raster = 1;
      break;
    case Pass::kDgrad:
      // The cooperative 128x256 tiles where built; a program built in ping-pong only (the GLU
      // dgrad: kernels/table.def says why) takes that.
      c.config = first_built(p, t, {Config::kCooperative128x256, Config::kPingpong128x128});
      c.raster = n > k ? 2 : 1;
      break;
    case Pass::kWgrad:
      c.config = first_built(p, t, {Config::kCooperative128x256, Config::kPingpong128x128});
      c.raster = 2;
      break;
  }
  const int oc = override_config.load(std::memory_order_relaxed);
  if (oc >= 0 && oc < kConfigCount && is_built(p, t, static_cast<Config>(oc))) c.config = static_cast<Config>(oc);
  c.swizzle = swizzle_for(c.config, m, n);
  const int orr = override_raster.load(std::memory_order_relaxed);
  if (orr >= 0) c.raster = orr;
  const int os = override_swizzle.load(std::memory_order_relaxed);
  if (os > 0) c.swizzle = os;
  return c;
}

// coda's value is the epilogue; a plain GEMM has none. A wgrad's 128x256
// tiles over (out features, in features) are few where the features are
// (d = 1024: QKV's wgrad 96 tiles, o-proj's 32, on 132 SMs), each a long
// K = tokens loop, and most SMs idle; cuBLAS splits such GEMMs. With two full
// waves or more coda's own ran 0.98-0.99x cuBLAS's (16,384 x 4096). A plain
// dgrad (no activation, no bias gradient) ran 1.03-1.12x cuBLAS at 8,192 x
// d 1024-2048 and 2,048 x d 4096, 0.97-1.02x at 16,384 x 4096: cuBLAS's
// everywhere (benchmarks/NOTES.md).
bool prefer_vendor_gemm(Program p, int64_t m, int64_t n, int64_t /*k*/, int sms) {
  if (override_config.load(std::memory_order_relaxed) >= 0) return false;  // an override times coda's own kernel
  if (p == Program::kDActDBias) return true;
  if (p != Program::kWgradStore) return false;
  const int64_t tiles = ((m + 127) / 128) * ((n + 255) / 256);
  return tiles < 2 * int64_t(sms);
}

void set_override(int config, int raster, int swizzle) {
  override_config.store(config, std::memory_order_relaxed);
  override_raster.store(raster, std::memory_order_relaxed);
  override_swizzle.store(swizzle, std::memory_order_relaxed);
}

}  // namespace coda::kernels
