#!/usr/bin/env bash
# The one-command check of a GPU machine: run from a checkout with the test and bench dependencies
# (pytest, pytest-xdist, pytest-timeout, hypothesis, cupy-cuda12x or -13x, torch with CUDA):
#
#     bash benchmarks/gpu_check.sh OUT_DIR
#
# writes into OUT_DIR: device.txt (GPU, driver, CUDA, CuPy, PyTorch), gpu_tests.log (the GPU test
# suite, in parallel with per-test timeouts), bench/ and bench.log (the benchmark suite on CuPy and
# PyTorch: JSON, markdown, PNG; the GPU-size, float16 and CUDA-graph cases included), bench-tf32/ and
# bench-tf32.log (the float32 training steps again with TF32 in both libraries), profile_*.txt (kernel counts and the top kernels of one training
# step), and summary.txt (each stage's exit status and time). Every stage runs even if one before it
# failed; the script exits non-zero if any did.
set -uo pipefail
out="${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
jobs="${JOBS:-$(nproc)}"
status=0
: > "$out/summary.txt"

stage() {   # stage NAME COMMAND...: run, log the exit status and the time
    local name="$1"; shift
    local t0=$SECONDS
    "$@"
    local rc=$?
    printf '%-12s exit %d  %4ds\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$out/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

device() {
    nvidia-smi || true
    python - <<'PY'
import cupy, platform
props = cupy.cuda.runtime.getDeviceProperties(0)
print("GPU:", props["name"].decode(), "| memory", props["totalGlobalMem"] // 2**20, "MiB")
print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver", cupy.cuda.runtime.driverGetVersion())
print("CuPy", cupy.__version__, "| Python", platform.python_version())
try:
    import torch
    print("PyTorch", torch.__version__, "| CUDA available", torch.cuda.is_available())
except ImportError:
    print("PyTorch: not installed (the benchmark's reference column and the kernel profile need it)")
PY
}

stage device      bash -c "$(declare -f device); device > '$out/device.txt' 2>&1"
stage gpu-tests   bash -c "python -m pytest -m gpu -n '$jobs' --timeout=300 -q -p no:cacheprovider > '$out/gpu_tests.log' 2>&1"
# every case: the small ones, the issue's GPU sizes, the float16 row (autocast + GradScaler), the CUDA-graph row
stage bench       bash -c "python benchmarks/run.py --backends cupy,torch --out '$out/bench' > '$out/bench.log' 2>&1"
stage bench-tf32  bash -c "python benchmarks/run.py --backends cupy,torch --tf32 --paths fast \
                           --only gpt-medium,gpt-d768-t512,gpt2-124m,seq2seq-d512 \
                           --out '$out/bench-tf32' > '$out/bench-tf32.log' 2>&1"
stage profile     bash -c "python benchmarks/profile_step.py --model gpt2-124m --out '$out/profile_gpt2-124m.txt' > /dev/null \
                           && python benchmarks/profile_step.py --model gpt-medium --seq 128 --out '$out/profile_gpt-medium.txt' > /dev/null"
tail -n 3 "$out/gpu_tests.log" 2>/dev/null
echo "results in $out"
exit $status
