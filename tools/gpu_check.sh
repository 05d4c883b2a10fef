#!/usr/bin/env bash
# The GPU check, in one call on an sm_90 machine with no network:
# install the carried wheels, build with all cores, run the GPU tests, the C++
# example against the installed package, and the benchmarks; logs and results
# go to OUT_DIR.
#
#   tools/gpu_check.sh WHEEL_DIR OUT_DIR [--quick | --sweep | --sweep-shipped | --power | --profile]
#
# WHEEL_DIR holds nvidia-cutlass (and liger-kernel) wheels: ../shared/device/carry-wheels.sh.
# --quick skips the kernel-configuration sweep; BENCH_ARGS (e.g. "--only norm") go to coda.bench,
# SWEEP_ARGS to its sweep, CODA_CMAKE_ARGS to the build.
# --sweep builds the candidate configurations too (CODA_SWEEP_CONFIGS) and
# runs the GPU tests, the norm ops' per-kernel breakdown and the sweep, each
# candidate checked against the default configuration's output before it is timed.
# There SWEEP_TESTS=0 / SWEEP_BREAKDOWN=0 leave those steps out,
# CODA_TEST_TUNING="config,raster,swizzle ..." runs the GPU tests once more
# per override, on the kernels it picks, before anything is timed, and
# BENCH_ARGS runs coda.bench with them before the sweep.
# --sweep-shipped builds only the shipped kernels and runs only the sweep
# (SWIZZLES, SWEEP_ARGS): raster and swizzle choices need no other build.
# --power builds them and runs only benchmarks/power_probe.py (clock and
# power per GEMM variant); POWER_SWEEP=1 builds the sweep's candidates too,
# for POWER_ARGS="--configs 15" and the like; POWER_TESTS=1 runs the GPU
# tests before it, PROFILE_VARIANTS the profile below and BENCH_ARGS coda.bench after it.
# --profile builds as --power does and runs Nsight Compute on each variant
# named in PROFILE_VARIANTS ("case:impl;case:impl", benchmarks/profile_kernel.py
# --list names them; PROFILE_CONFIGS adds candidates, PROFILE_RASTER sets their
# raster order, PROFILE_ARGS="--store-l2 0,2 --alternate-k 0" and the like
# add tuning variants), one report in profile.log.
set -uo pipefail
WHEELS=${1:?wheel folder}
OUT=${2:?output folder}
QUICK=${3:-}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "environment"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH="$ROOT/python:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export CUTLASS_INCLUDE_DIR="$SITE/cutlass_library/source/include"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.log"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee -a "$OUT/gpu.log"

step "build"
export CODA_BUILD_DIR="$ROOT/build/gpu"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ "$QUICK" = "--sweep" ] || [ "${POWER_SWEEP:-0}" = 1 ] || [ -n "${PROFILE_CONFIGS:-}" ]; then
  export CODA_BUILD_DIR="$ROOT/build/gpu-sweep" CODA_CMAKE_ARGS="-DCODA_SWEEP_CONFIGS=ON"
fi
start=$SECONDS
python3 setup.py -q build_ext --inplace >> "$OUT/gpu.log" 2>&1 || { tail -50 "$OUT/gpu.log"; exit 1; }
echo "built in $((SECONDS - start)) s"
grep -c "C7510" "$OUT/gpu.log" | sed 's/^/C7510 warnings: /'

# coda.bench with BENCH_ARGS, killed after BENCH_TIMEOUT seconds (a hung
# candidate leaves the rest of the call its time).
run_bench() {
  step "benchmarks ${BENCH_ARGS:-}"
  timeout -k 10 ${BENCH_TIMEOUT:-540} python3 -m coda.bench --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || status=1
  grep -A200 "^case " "$OUT/bench.log" || tail -30 "$OUT/bench.log"
}

# Nsight Compute on each variant in PROFILE_VARIANTS, one report in profile.log.
run_profile() {
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "no ncu on this machine"; status=1; return; }
  IFS=';' read -ra variants <<< "${PROFILE_VARIANTS:?case:impl;...}"
  sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
            --section SchedulerStats --section WarpStateStats --section LaunchStats)
  metrics=(--metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_alu.sum,sm__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum)
  # The clocks stay as the GPU sets them (device rules); replay restores memory between passes.
  ncu_on() {
    timeout -k 10 ${PROFILE_TIMEOUT:-120} "$NCU" --clock-control none --launch-skip 2 --launch-count 1 \
      -k 'regex:device_kernel|nvjet' "${sections[@]}" "${@:2}" \
      python3 benchmarks/profile_kernel.py "${1%%:*}" "${1#*:}" --configs "${PROFILE_CONFIGS:-}" \
      --raster "${PROFILE_RASTER:--1}" ${PROFILE_ARGS:-} >> "$OUT/profile.log" 2>&1
  }
  for v in "${variants[@]}"; do
    step "ncu: $v"
    # a metric this ncu does not know fails the whole call: once more with the sections alone
    ncu_on "$v" "${metrics[@]}" || ncu_on "$v" || { status=1; echo "ncu failed on $v"; }
    echo "=== end of $v" >> "$OUT/profile.log"
  done
  grep -E "^  [a-zA-Z_]|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|=== end|bank_conflicts|inst_executed|dram__bytes|lts__t_bytes|Registers Per|Shared Memory Config" "$OUT/profile.log" | head -400
}

if [ "$QUICK" = "--power" ]; then
  if [ "${POWER_TESTS:-0}" = 1 ]; then  # the GPU tests first (CODA_TEST_TUNING applies)
    step "GPU tests"
    CODA_ERRORS_JSON="$OUT/errors.json" python3 -m pytest tests -q -rs > "$OUT/tests.log" 2>&1 || status=1
    tail -4 "$OUT/tests.log"
  fi
  step "clock and power per GEMM variant"
  python3 benchmarks/power_probe.py --out "$OUT" ${POWER_ARGS:-} > "$OUT/power.log" 2>&1 || status=1
  cat "$OUT/power.log"
  [ -n "${PROFILE_VARIANTS:-}" ] && run_profile  # then Nsight Compute, as --profile
  # and coda.bench, e.g. BENCH_ARGS="--only mlp --mlp-variant swizzle=4"
  [ -n "${BENCH_ARGS:-}" ] && run_bench
  step "done, status $status"
  exit $status
fi

if [ "$QUICK" = "--profile" ]; then
  run_profile
  step "done, status $status"
  exit $status
fi

if [ "$QUICK" = "--sweep-shipped" ]; then
  step "kernel-configuration sweep of the shipped kernels, swizzles ${SWIZZLES:-8}"
  timeout -k 10 ${SWEEP_TIMEOUT:-420} python3 -m coda.bench --only-sweep --swizzles "${SWIZZLES:-8}" --rep-ms 100 \
    --warmup-ms 25 --out "$OUT" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1 || status=1
  tail -160 "$OUT/sweep.log"
  step "done, status $status"
  exit $status
fi

if [ "$QUICK" = "--sweep" ]; then
  # The sweep build dispatches as the shipped one does unless tuning asks
  # otherwise, so its GPU tests are those of the shipped choices.
  if [ "${SWEEP_TESTS:-1}" != 0 ]; then  # SWEEP_TESTS=0: the sweep alone, where the shipped kernels did not change
    step "GPU tests"
    CODA_TEST_TUNING= CODA_ERRORS_JSON="$OUT/errors.json" python3 -m pytest tests -q -rs > "$OUT/tests.log" 2>&1 || status=1
    tail -8 "$OUT/tests.log"
  fi
  # Every GPU test again on the kernels each override picks (space-separated),
  # before any timing: a candidate that computes something else, or hangs
  # (a stream-K variant once did; TUNED_TIMEOUT kills it), is not worth timing.
  for tuning in ${CODA_TEST_TUNING:-}; do
    step "GPU tests with tuning $tuning"
    first=${tuning%%,*}
    if [ "$first" -ge 0 ] 2>/dev/null; then tag=c$first; else tag=t$(echo "$tuning" | tr ',' '_' | sed 's/-1/x/g'); fi
    CODA_TEST_TUNING=$tuning CODA_ERRORS_JSON="$OUT/errors-tuned-$tag.json" timeout -k 10 ${TUNED_TIMEOUT:-240} \
      python3 -m pytest tests -q -rs > "$OUT/tests-tuned-$tag.log" 2>&1 || status=1
    tail -4 "$OUT/tests-tuned-$tag.log"
  done
  if [ "${SWEEP_BREAKDOWN:-1}" != 0 ]; then
    step "per-kernel breakdown of the norm ops"
    python3 -m coda.bench --only breakdown --rep-ms 100 --warmup-ms 25 --out "$OUT/breakdown" > "$OUT/breakdown.log" 2>&1 || status=1
    grep -E "^  " "$OUT/breakdown.log" | tail -40
  fi
  # e.g. BENCH_ARGS="--only mlp --mlp-variant key=value": a candidate in the whole step
  [ -n "${BENCH_ARGS:-}" ] && run_bench
  step "kernel-configuration sweep"
  # A candidate that hangs is killed; the results file holds every case
  # finished before it.
  timeout -k 10 ${SWEEP_TIMEOUT:-300} python3 -m coda.bench --only-sweep --rep-ms 100 --warmup-ms 25 --out "$OUT" \
    ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1 || status=1
  tail -120 "$OUT/sweep.log"
  step "done, status $status"
  exit $status
fi

step "GPU tests"
CODA_TEST_TUNING= CODA_ERRORS_JSON="$OUT/errors.json" python3 -m pytest tests -q -rs > "$OUT/tests.log" 2>&1 || status=1
python3 -c "import json; d=json.load(open('$OUT/errors.json')); print('worst coda/torch error ratio over', len(d['checks']), 'checks:', d['worst_ratio_to_torch'])" || true
tail -25 "$OUT/tests.log"

step "C++ example against the installed package"
cmake --build "$CODA_BUILD_DIR" --target coda > "$OUT/cpp.log" 2>&1 &&
  cmake --install "$CODA_BUILD_DIR" --prefix "$ROOT/build/install" >> "$OUT/cpp.log" 2>&1 &&
  cmake -S examples/cpp -B build/example -G Ninja -DCMAKE_PREFIX_PATH="$ROOT/build/install" >> "$OUT/cpp.log" 2>&1 &&
  cmake --build build/example >> "$OUT/cpp.log" 2>&1 &&
  LD_LIBRARY_PATH="$ROOT/build/install/lib:$ROOT/build/install/lib64:${LD_LIBRARY_PATH:-}" build/example/linear_gelu 2>&1 | tee -a "$OUT/cpp.log" ||
  { status=1; tail -20 "$OUT/cpp.log"; }

run_bench
if [ "$QUICK" != "--quick" ]; then
  step "kernel-configuration sweep"
  # SWEEP_ARGS narrows it (--sweep-cases, --sweep-configs); candidates need
  # CODA_CMAKE_ARGS=-DCODA_SWEEP_CONFIGS=ON.
  python3 -m coda.bench --only-sweep --swizzles "${SWIZZLES:-8}" --rep-ms 200 --warmup-ms 50 --out "$OUT" ${SWEEP_ARGS:-} \
    > "$OUT/sweep.log" 2>&1 || status=1
  tail -100 "$OUT/sweep.log"
fi
step "done, status $status"
exit $status
