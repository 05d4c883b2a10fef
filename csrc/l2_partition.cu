// Which L2 partition each SM reads through, measured once per device, for
// the partition-aware tile order (partition_scheduler.cuh).
//
// NVIDIA documents two L2 partitions on GA100/GH100 and no SM-to-partition
// map. The probe: one block per SM. A reference block reads a set of lines
// for every other block (they are now cached where the reference reads
// through), then every block times a dependent chain over its own set with
// ld.global.cg. SMs that read through the reference's partition hit; the
// others go through the far partition or to DRAM. Two latency groups with a
// clear gap between them give the map; anything less clear gives no map, and
// the GEMMs run CUTLASS's tile order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "kernels.h"

namespace coda::kernels {
namespace {

constexpr int kMaxSms = 256;
constexpr int kChain = 64;          // lines each block times
constexpr int kLineWords = 64;      // 256 bytes from one line to the next
constexpr long long kTimeout = 2000000000LL;  // cycles (~1 s): blocks that never became resident

__device__ __forceinline__ uint32_t load_cg(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// flags[0]: 1 once the reference has read every set (2: it gave up);
// flags[1]: blocks checked in.
__global__ void partition_probe_kernel(const uint32_t* lines, int blocks, unsigned* flags, float* latency,
                                       int* smid_of) {
  extern __shared__ char one_block_per_sm[];
  if (threadIdx.x != 0) return;
  one_block_per_sm[0] = 0;
  uint32_t smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const int b = blockIdx.x;
  smid_of[b] = int(smid);
  latency[b] = -1.f;
  atomicAdd(&flags[1], 1u);
  const long long t0 = clock64();
  uint32_t sink = 0;
  if (b == 0) {
    while (atomicAdd(&flags[1], 0u) < unsigned(blocks)) {
      if (clock64() - t0 > kTimeout) {
        atomicExch(&flags[0], 2u);
        return;
      }
    }
    for (int i = kChain; i < blocks * kChain; ++i) sink += load_cg(lines + size_t(i) * kLineWords);
    __threadfence();
    atomicExch(&flags[0], 1u);
  } else {
    unsigned f;
    while ((f = atomicAdd(&flags[0], 0u)) == 0u) {
      if (clock64() - t0 > 2 * kTimeout) return;
      __nanosleep(200);
    }
    if (f != 1u) return;
  }
  // The reference times its own set right after reading it the first time:
  // its latency is a hit in its own partition.
  if (b == 0) {
    for (int i = 0; i < kChain; ++i) sink += load_cg(lines + size_t(i) * kLineWords);
  }
  uint32_t next = uint32_t(b) * kChain;
  const long long start = clock64();
  for (int i = 0; i < kChain; ++i) next = load_cg(lines + size_t(next) * kLineWords);
  const long long stop = clock64();
  latency[b] = float(stop - start) / kChain;
  if (next == 0xffffffffu && sink == 0xffffffffu) smid_of[b] = -1;  // never true; keeps both live
}

struct Probe {
  bool done = false;
  uint8_t* table = nullptr;  // device, kMaxSms entries
  L2PartitionReport report;
};

std::mutex g_mutex;
Probe g_probe[64];

bool disabled_by_env() {
  const char* v = std::getenv("CODA_L2_PARTITION");
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// Two groups by the widest gap in the sorted latencies, each at least a
// quarter of the SMs, the gap at least 25 cycles and wider than either
// group's spread from its edge to its median; the reference must fall in the
// lower group.
bool classify(const std::vector<float>& lat, std::vector<uint8_t>& part, float& threshold, float& gap) {
  const int n = int(lat.size());
  std::vector<float> s(lat);
  std::sort(s.begin(), s.end());
  const int q = std::max(1, n / 4);
  int cut = -1;
  gap = 0.f;
  for (int i = q - 1; i + q < n; ++i) {  // i + 1 values below the cut, n - i - 1 above
    if (s[i + 1] - s[i] > gap) {
      gap = s[i + 1] - s[i];
      cut = i;
    }
  }
  if (cut < 0) return false;
  threshold = 0.5f * (s[cut] + s[cut + 1]);
  const float lo_spread = s[cut] - s[cut / 2], hi_spread = s[(cut + 1 + n - 1) / 2] - s[cut + 1];
  if (gap < 25.f || gap < std::max(lo_spread, hi_spread)) return false;
  if (lat[0] > threshold) return false;
  part.resize(n);
  for (int i = 0; i < n; ++i) part[i] = lat[i] > threshold ? 1 : 0;
  return true;
}

#define PROBE_CHECK(expr)                 \
  do {                                    \
    if ((expr) != cudaSuccess) {          \
      ok = false;                         \
      goto cleanup;                       \
    }                                     \
  } while (0)

// Runs the probe on the current device; fills p. False when a CUDA call failed
// (nothing is cached then, so a later call tries again).
bool run_probe(int device, Probe& p) {
  bool ok = true;
  int sms = 0, smem_per_sm = 0;
  uint32_t* lines = nullptr;
  unsigned* flags = nullptr;
  float* latency = nullptr;
  int* smid_of = nullptr;
  uint8_t* table = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<uint32_t> host_lines;
  std::vector<float> lat;
  std::vector<int> smid;
  size_t smem = 0;
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  PROBE_CHECK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  if (sms < 2 || sms > kMaxSms) {
    p.report.status = "unsupported SM count";
    return true;
  }
  smem = size_t(smem_per_sm) / 2 + 1024;  // two blocks never fit on one SM
  PROBE_CHECK(cudaFuncSetAttribute(partition_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  PROBE_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  host_lines.assign(size_t(sms) * kChain * kLineWords, 0u);
  for (int b = 0; b < sms; ++b) {
    for (int i = 0; i < kChain; ++i) {
      host_lines[(size_t(b) * kChain + i) * kLineWords] = uint32_t(b * kChain + (i + 1) % kChain);
    }
  }
  PROBE_CHECK(cudaMalloc(&lines, host_lines.size() * sizeof(uint32_t)));
  PROBE_CHECK(cudaMalloc(&flags, 2 * sizeof(unsigned)));
  PROBE_CHECK(cudaMalloc(&latency, sms * sizeof(float)));
  PROBE_CHECK(cudaMalloc(&smid_of, sms * sizeof(int)));
  PROBE_CHECK(cudaMemcpyAsync(lines, host_lines.data(), host_lines.size() * sizeof(uint32_t), cudaMemcpyHostToDevice,
                              stream));
  PROBE_CHECK(cudaMemsetAsync(flags, 0, 2 * sizeof(unsigned), stream));
  partition_probe_kernel<<<sms, 32, smem, stream>>>(lines, sms, flags, latency, smid_of);
  PROBE_CHECK(cudaGetLastError());
  lat.resize(sms);
  smid.resize(sms);
  PROBE_CHECK(cudaMemcpyAsync(lat.data(), latency, sms * sizeof(float), cudaMemcpyDeviceToHost, stream));
  PROBE_CHECK(cudaMemcpyAsync(smid.data(), smid_of, sms * sizeof(int), cudaMemcpyDeviceToHost, stream));
  PROBE_CHECK(cudaStreamSynchronize(stream));
  {
    p.report.sms = sms;
    std::fill(std::begin(p.report.partition), std::end(p.report.partition), int8_t(-1));
    std::fill(std::begin(p.report.latency), std::end(p.report.latency), -1.f);
    bool all = true;
    for (int b = 0; b < sms; ++b) {
      if (lat[b] < 0.f || smid[b] < 0 || smid[b] >= kMaxSms) all = false;
      else p.report.latency[smid[b]] = lat[b];
    }
    std::vector<uint8_t> part;
    if (!all) {
      p.report.status = "not every block was resident at once";
    } else if (!classify(lat, part, p.report.threshold, p.report.gap)) {
      p.report.status = "no two clear latency groups";
    } else {
      uint8_t host_table[kMaxSms];
      std::memset(host_table, 0, sizeof(host_table));
      for (int b = 0; b < sms; ++b) {
        host_table[smid[b]] = part[b];
        p.report.partition[smid[b]] = int8_t(part[b]);
      }
      PROBE_CHECK(cudaMalloc(&table, kMaxSms));
      PROBE_CHECK(cudaMemcpyAsync(table, host_table, kMaxSms, cudaMemcpyHostToDevice, stream));
      PROBE_CHECK(cudaStreamSynchronize(stream));
      p.table = table;
      table = nullptr;
      p.report.status = "mapped";
    }
  }
cleanup:
  if (!ok) cudaGetLastError();  // the failure is reported by returning false, not left for the next launch check
  if (lines) cudaFree(lines);
  if (flags) cudaFree(flags);
  if (latency) cudaFree(latency);
  if (smid_of) cudaFree(smid_of);
  if (table) cudaFree(table);
  if (stream) cudaStreamDestroy(stream);
  return ok;
}

}  // namespace

const uint8_t* l2_partition_map(int device, cudaStream_t stream) {
  if (device < 0 || device >= 64 || disabled_by_env()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  Probe& p = g_probe[device];
  if (p.done) return p.table;
  // The probe allocates and synchronizes, which a stream being captured into
  // a graph cannot take; such launches run CUTLASS's order and the next
  // launch outside a capture probes.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return nullptr;
  }
  p.done = run_probe(device, p);
  return p.table;
}

L2PartitionReport l2_partition_report(int device) {
  if (device < 0 || device >= 64) return {};
  l2_partition_map(device, nullptr);
  std::lock_guard<std::mutex> lock(g_mutex);
  L2PartitionReport r = g_probe[device].report;
  if (disabled_by_env()) r.status = "disabled (CODA_L2_PARTITION=0)";
  return r;
}

}  // namespace coda::kernels
