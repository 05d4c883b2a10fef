#!/usr/bin/env bash
# The GPU check, in one call on an sm_90 machine with no network: install the
# carried wheels, build with all cores, run the GPU tests, the C++ example
# against the installed package and the benchmarks; logs and the stamped
# results files they write go to OUT_DIR.
#
#   tools/gpu_check.sh WHEEL_DIR OUT_DIR [--quick | --loss | --sweep | --sweep-shipped | --scripts | --power | --profile]
#
# WHEEL_DIR holds nvidia-cutlass (and liger-kernel) wheels: ../shared/device/carry-wheels.sh.
# CODA_COMMIT names the commit the results files are stamped with (a copied tree's .git
# may point elsewhere). The tests fail, not skip, where coda._C does not load;
# Each test draws from its own fixed seed; CODA_SEED=<n> (or random) mixes n into
# every test's seed, for other inputs.
# BENCH_ARGS (e.g. "--only mlp,norm"; empty: the training comparison) go to coda.bench, CODA_CMAKE_ARGS to the build;
# EXTRA_KERNELS="program:dtype:config;..." builds those beside the library's table
# (-DCODA_EXTRA_KERNELS, in build/gpu-extra) for the sweep, the probe and the profile;
# ONLY_KERNELS="kLinearAct:kBFloat16:kPingpong128x128" builds only those (build/gpu-only, ~1 min):
# a quick check of work that needs no other CUTLASS kernel (the loss), with TESTS naming its tests;
# SCRIPTS="variants.py --variant raster=2;max_autotune.py" runs those benchmarks/
# scripts, each with --out OUT_DIR, after the benchmarks in every mode.
# (no mode): tests, C++ example, coda.bench, its fused_gemm and generate sections (KERNEL_SECTIONS="" leaves
#   them out, KERNEL_BENCH_ARGS adds to them), the small GPT-2 with CUDA graphs (GRAPHS_BENCH=0 leaves it
#   out), then benchmarks/sweep.py (SWIZZLES,
#   SWEEP_ARGS, SWEEP_SHAPES="tokens:d:ffn ..."); --quick leaves the sweep out.
# --loss: the LM head + loss alone (issue 43), as --quick with these defaults: only its CUTLASS kernels and the
#   C++ example's built (ONLY_KERNELS), its GPU tests (TESTS=tests/test_gpu_loss.py), the lm_head section as the
#   benchmark (BENCH_ARGS), no other section, no graphed row.
# --sweep: the tests (SWEEP_TESTS=0 leaves them out), again under each override in
#   CODA_TEST_TUNING="config,raster,swizzle ..." before anything is timed, the per-kernel
#   breakdown (SWEEP_BREAKDOWN=0 leaves it out), coda.bench where BENCH_ARGS is set, the sweep.
# --sweep-shipped: the sweep alone; raster and swizzle need no extra kernels.
# --scripts: the GPU tests, then SCRIPTS alone.
# --power: benchmarks/power_probe.py alone (POWER_ARGS); POWER_TESTS=1 runs the tests
#   (under CODA_TEST_TUNING) before it, PROFILE_VARIANTS the profile and BENCH_ARGS coda.bench after it.
# --profile: Nsight Compute on each variant in PROFILE_VARIANTS ("case:impl;case:impl",
#   benchmarks/profile_kernel.py --list names them; PROFILE_CONFIGS adds candidates,
#   PROFILE_RASTER sets their raster order, PROFILE_ARGS="--swizzles 4" adds variants),
#   one report in profile.log.
# TESTS="tests/test_gpu.py ..." runs those test files only (default: all of tests/).
# TESTS_TIMEOUT, BENCH_TIMEOUT, SWEEP_TIMEOUT, SCRIPT_TIMEOUT, TUNED_TIMEOUT, PROFILE_TIMEOUT bound those steps (s).
set -uo pipefail
WHEELS=${1:?wheel folder}
OUT=${2:?output folder}
MODE=${3:-}
if [ "$MODE" = "--loss" ]; then
  : "${ONLY_KERNELS:=kLinearCeGrad:kBFloat16:kPingpong128x128;kLinearCeGrad:kFloat16:kPingpong128x128;kLinearAct:kBFloat16:kPingpong128x128}"
  : "${TESTS:=tests/test_gpu_loss.py}"
  : "${BENCH_ARGS:=--kernels --only lm_head}"
  KERNEL_SECTIONS=${KERNEL_SECTIONS-}
  GRAPHS_BENCH=${GRAPHS_BENCH:-0}
  MODE=--quick
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1
export CODA_REQUIRE_EXTENSION=1  # the tests fail, not skip, where coda._C does not load
export CODA_REQUIRE_GPU=1        # and GPU tests fail, not skip, where no sm_90 GPU is usable
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "environment"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH="$ROOT/python:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export CUTLASS_INCLUDE_DIR="$SITE/cutlass_library/source/include"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.log"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee -a "$OUT/gpu.log"
[ -n "${CODA_SEED:-}" ] && export CODA_SEED && echo "tests seeded with CODA_SEED=$CODA_SEED" | tee -a "$OUT/gpu.log"

step "build"
export CODA_BUILD_DIR="$ROOT/build/gpu"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -n "${ONLY_KERNELS:-}" ]; then
  export CODA_BUILD_DIR="$ROOT/build/gpu-only"
  export CODA_CMAKE_ARGS="-DCODA_ONLY_KERNELS=${ONLY_KERNELS}${CODA_CMAKE_ARGS:+ $CODA_CMAKE_ARGS}"
  echo "only these kernels: $ONLY_KERNELS"
fi
if [ -n "${EXTRA_KERNELS:-}" ]; then
  export CODA_BUILD_DIR="$ROOT/build/gpu-extra"
  export CODA_CMAKE_ARGS="-DCODA_EXTRA_KERNELS=${EXTRA_KERNELS}${CODA_CMAKE_ARGS:+ $CODA_CMAKE_ARGS}"
  echo "extra kernels: $EXTRA_KERNELS"
fi
start=$SECONDS
python3 setup.py -q build_ext --inplace >> "$OUT/gpu.log" 2>&1 || { tail -50 "$OUT/gpu.log"; exit 1; }
echo "built in $((SECONDS - start)) s"
grep -c "C7510" "$OUT/gpu.log" | sed 's/^/C7510 warnings: /'

# The GPU tests into LOG, conftest's stamped errors file into DIR, then the
# worst coda/torch error ratio from it: run_tests LOG DIR [TUNING [TIMEOUT]].
run_tests() {
  mkdir -p "$2"
  CODA_TEST_TUNING=${3:-} CODA_ERRORS_DIR="$2" timeout -k 10 "${4:-1800}" \
    python3 -m pytest ${TESTS:-tests} -q -rs > "$1" 2>&1 || status=1
  python3 - "$2" <<'EOF' || true
import glob, json, os, sys
paths = sorted(glob.glob(os.path.join(sys.argv[1], "*errors*.json")), key=os.path.getmtime)
if not paths:
    sys.exit("no errors file written")
d = json.load(open(paths[-1]))
print(f"worst coda/torch error ratio over {len(d.get('checks', []))} checks: {d.get('worst_ratio_to_torch')}"
      f" ({os.path.basename(paths[-1])})")
EOF
}

# coda.bench with BENCH_ARGS, killed after BENCH_TIMEOUT seconds; it writes its own stamped file.
run_bench() {
  step "benchmarks ${BENCH_ARGS:-}"
  timeout -k 10 "${BENCH_TIMEOUT:-540}" python3 -m coda.bench --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 ||
    status=1
  sed -n '/^case /,$p' "$OUT/bench.log" | grep . || tail -30 "$OUT/bench.log"
  print_bars
}

# The LM head's variants against issue 43's bars and their time/memory frontier, from the lm_head file of this run.
print_bars() {
  local f
  f=$(ls -t "$OUT"/*-lm_head-*.json 2>/dev/null | head -1)
  [ -n "$f" ] || return 0
  step "LM head against issue 43's bars ($(basename "$f"))"
  python3 tools/results_table.py --bars "$f" || status=1
}

# Every fused GEMM of the LLaMA and GPT-2 training steps against cuBLAS's plain GEMM of the same operands,
# kernel by kernel, then generate()'s prefill and decode with and without coda's kernels: coda.bench's
# fused_gemm and generate sections, each into its own results file (KERNEL_SECTIONS picks, empty: none;
# "lm_head" adds the LM head + loss with its chunk sweep and kernel breakdown, issue 43).
run_kernel_bench() {
  local section
  for section in ${KERNEL_SECTIONS-fused_gemm generate}; do
    step "coda.bench --only $section ${KERNEL_BENCH_ARGS:-}"
    timeout -k 10 "${KERNEL_BENCH_TIMEOUT:-480}" python3 -m coda.bench --kernels --only "$section" --out "$OUT" \
      ${KERNEL_BENCH_ARGS:-} > "$OUT/$section.log" 2>&1 || status=1
    grep -E "^  (fused_gemm|generate|lm_head)_" "$OUT/$section.log" || tail -30 "$OUT/$section.log"
    [ "$section" != lm_head ] || print_bars
  done
}

# The main job's graphed row (issue 40): the small GPT-2, where the host bounds a step, with and without
# CUDA graphs (torch.compile mode="reduce-overhead"), unpatched and patched; GRAPHS_BENCH=0 leaves it out.
run_graphs_bench() {
  [ "${GRAPHS_BENCH:-1}" != 0 ] || return 0
  step "coda.bench --models gpt2small, CUDA graphs"
  timeout -k 10 "${GRAPHS_TIMEOUT:-420}" python3 -m coda.bench --models gpt2small \
    --impls hf,compile,coda,compile_graphs,coda_graphs --out "$OUT" > "$OUT/graphs.log" 2>&1 || status=1
  sed -n '/^model /,$p' "$OUT/graphs.log" | grep . || tail -20 "$OUT/graphs.log"
}

# The benchmarks/ scripts in SCRIPTS, each with --out OUT, logged to <script>.log.
run_scripts() {
  [ -n "${SCRIPTS:-}" ] || return 0
  IFS=';' read -ra scripts <<< "$SCRIPTS"
  for s in "${scripts[@]}"; do
    read -ra words <<< "$s"
    [ ${#words[@]} -gt 0 ] || continue
    step "benchmarks/$s"
    log="$OUT/$(basename "${words[0]}" .py).log"
    timeout -k 10 "${SCRIPT_TIMEOUT:-540}" python3 "benchmarks/${words[0]}" "${words[@]:1}" --out "$OUT" > "$log" 2>&1 ||
      status=1
    tail -40 "$log"
  done
}

# The configuration sweep, killed after SWEEP_TIMEOUT seconds: a candidate that hangs
# is stopped, and the results file holds every case finished before it.
# SWEEP_SHAPES="tokens:d:ffn ..." runs it once per shape (each its own results file).
run_sweep() {
  local shapes=${SWEEP_SHAPES:-default} shape
  for shape in $shapes; do
    step "kernel-configuration sweep, swizzles ${SWIZZLES:-8}, shape $shape"
    local dims=()
    [ "$shape" != default ] && IFS=: read -r tk hd ff <<< "$shape" && dims=(--tokens "$tk" --hidden "$hd" --ffn "$ff")
    timeout -k 10 "${SWEEP_TIMEOUT:-420}" python3 benchmarks/sweep.py --swizzles="${SWIZZLES:-8}" --out "$OUT" \
      "${dims[@]}" ${SWEEP_ARGS:-} >> "$OUT/sweep.log" 2>&1 || status=1
  done
  grep -E "cublas|auto" "$OUT/sweep.log" | tail -120
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
    timeout -k 10 "${PROFILE_TIMEOUT:-120}" "$NCU" --clock-control none --launch-skip 2 --launch-count 1 \
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

finish() {
  step "done, status $status"
  exit $status
}

case "$MODE" in
  --power)
    if [ "${POWER_TESTS:-0}" = 1 ]; then
      step "GPU tests"
      run_tests "$OUT/tests.log" "$OUT" "${CODA_TEST_TUNING:-}"
      tail -4 "$OUT/tests.log"
    fi
    step "clock and power per GEMM variant"
    python3 benchmarks/power_probe.py --out "$OUT" ${POWER_ARGS:-} > "$OUT/power.log" 2>&1 || status=1
    cat "$OUT/power.log"
    [ -n "${PROFILE_VARIANTS:-}" ] && run_profile
    [ -n "${BENCH_ARGS:-}" ] && run_bench
    run_scripts
    finish ;;
  --profile)
    run_profile
    finish ;;
  --scripts)
    step "GPU tests"
    run_tests "$OUT/tests.log" "$OUT"
    tail -8 "$OUT/tests.log"
    run_scripts
    finish ;;
  --sweep-shipped)
    run_sweep
    finish ;;
  --sweep)
    # Extra kernels leave the rule's choices as shipped unless an override asks
    # otherwise, so these tests are those of the shipped kernels.
    if [ "${SWEEP_TESTS:-1}" != 0 ]; then
      step "GPU tests"
      run_tests "$OUT/tests.log" "$OUT"
      tail -8 "$OUT/tests.log"
    fi
    # Every GPU test again on the kernels each override picks, before any timing:
    # a candidate that computes something else, or hangs (TUNED_TIMEOUT), is not worth timing.
    for tuning in ${CODA_TEST_TUNING:-}; do
      step "GPU tests with override $tuning"
      tag=t$(echo "$tuning" | tr ',' '_' | sed 's/-1/x/g')
      run_tests "$OUT/tests-$tag.log" "$OUT/tests-$tag" "$tuning" "${TUNED_TIMEOUT:-240}"
      tail -4 "$OUT/tests-$tag.log"
    done
    if [ "${SWEEP_BREAKDOWN:-1}" != 0 ]; then
      step "per-kernel breakdown"
      python3 benchmarks/breakdown.py --out "$OUT" > "$OUT/breakdown.log" 2>&1 || status=1
      grep -E "^  " "$OUT/breakdown.log" | tail -40
    fi
    [ -n "${BENCH_ARGS:-}" ] && run_bench
    run_scripts
    run_sweep
    finish ;;
esac

step "GPU tests"
run_tests "$OUT/tests.log" "$OUT" "" "${TESTS_TIMEOUT:-1800}"
tail -25 "$OUT/tests.log"

step "C++ example against the installed package"
cmake --build "$CODA_BUILD_DIR" --target coda > "$OUT/cpp.log" 2>&1 &&
  cmake --install "$CODA_BUILD_DIR" --prefix "$ROOT/build/install" >> "$OUT/cpp.log" 2>&1 &&
  cmake -S examples/cpp -B build/example -G Ninja -DCMAKE_PREFIX_PATH="$ROOT/build/install" >> "$OUT/cpp.log" 2>&1 &&
  cmake --build build/example >> "$OUT/cpp.log" 2>&1 &&
  LD_LIBRARY_PATH="$ROOT/build/install/lib:$ROOT/build/install/lib64:${LD_LIBRARY_PATH:-}" build/example/linear_gelu 2>&1 | tee -a "$OUT/cpp.log" ||
  { status=1; tail -20 "$OUT/cpp.log"; }

run_bench
run_kernel_bench
run_graphs_bench
run_scripts
[ "$MODE" != "--quick" ] && run_sweep
finish
