#!/usr/bin/env bash
# The one prepared GPU check (under 5 minutes on an H200): the kernel tests on CUDA with compiled
# Triton (not the interpreter), the kernel benchmark with its targets, then a training step end
# to end (bench/gpu_step.py: node processes on the GPU with qcomm's named settings against the
# torch optimizer alone) with its targets.
#
#   bash bench/gpu_check.sh            # from anywhere; runs in the repository root
#
# Expects torch (CUDA), triton, pytest and hypothesis in `python3` (or $PYTHON); qcomm need not
# be installed (PYTHONPATH). Writes $OUT/gpu_check.log, $OUT/kernels-cuda.json and
# $OUT/gpu-step.json, OUT defaulting to bench/out. Exit status: 0 only if the tests passed and
# every target of both benchmarks passed. Each step has its own time limit so one hang cannot
# eat the budget of the others (the three add up to under 5 minutes); both benchmarks write
# their JSON as they go (after every group, after every setting), so a timeout still leaves
# partial figures.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-bench/out}"
PY="${PYTHON:-python3}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-110}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-125}"
STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-60}"
mkdir -p "$OUT"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0            # compiled kernels on CUDA tensors (tests/conftest.py)
export HYPOTHESIS_PROFILE=ci         # derandomized, fixed example budget: reproducible runs
unset QCOMM_BACKEND                  # automatic choice: Triton on CUDA

main() {
    local t0=$SECONDS tests_rc=0 bench_rc=0 step_rc=0
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $PWD"
    echo "== nvidia-smi"
    nvidia-smi || echo "(nvidia-smi failed)"
    echo "== versions"
    "$PY" - <<'EOF'
import os, platform, sys
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda",
      torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
import pytest, hypothesis
print("pytest", pytest.__version__, "| hypothesis", hypothesis.__version__)
print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"), "| cpus", os.cpu_count())
if not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False: this check needs a GPU")
print("device", torch.cuda.get_device_name(0), "| capability",
      torch.cuda.get_device_capability(0))
EOF

    # The kernel tests plus the public-API tests that exist in this checkout (tests/compress;
    # tests/test_compress*.py in checkouts from before it; a glob that matches nothing must
    # not reach pytest as a literal path).
    local tests=(tests/kernels) f
    for f in tests/compress tests/test_compress*.py; do
        [[ -e "$f" ]] && tests+=("$f")
    done
    echo "== tests (${tests[*]}), limit ${TEST_TIMEOUT_S}s"
    # pytest-timeout may be missing here: pyproject's `timeout` key then only warns, and
    # `timeout` below is the real limit.
    timeout -k 10 "$TEST_TIMEOUT_S" "$PY" -m pytest -q -x "${tests[@]}" -p no:cacheprovider \
        || tests_rc=$?
    echo "== tests exit ${tests_rc} ($((SECONDS - t0)) s so far)"

    echo "== benchmark, limit ${BENCH_TIMEOUT_S}s"
    timeout -k 10 "$BENCH_TIMEOUT_S" "$PY" bench/kernels.py --check-targets \
        --time-budget "$((BENCH_TIMEOUT_S - 45))" \
        --json "$OUT/kernels-cuda.json" || bench_rc=$?
    echo "== benchmark exit ${bench_rc} ($((SECONDS - t0)) s so far)"

    # The settings share the step's limit less 10 s (to print the table and exit): none starts
    # after it and each gets at most what is left, so a hung setting is reported by name (exit
    # 2) before `timeout` kills the step; those not run are named too.
    echo "== training step end to end, limit ${STEP_TIMEOUT_S}s"
    timeout -k 10 "$STEP_TIMEOUT_S" "$PY" bench/gpu_step.py --check-targets \
        --time-budget "$((STEP_TIMEOUT_S - 10))" --json "$OUT/gpu-step.json" || step_rc=$?
    echo "== training step exit ${step_rc} ($((SECONDS - t0)) s in all)"
    [[ $tests_rc -eq 124 || $bench_rc -eq 124 || $step_rc -eq 124 ]] \
        && echo "== a step hit its time limit"
    echo "== summary: tests ${tests_rc}, benchmark ${bench_rc}, training step ${step_rc}"
    [[ $tests_rc -eq 0 && $bench_rc -eq 0 && $step_rc -eq 0 ]]
}

main 2>&1 | tee "$OUT/gpu_check.log"
