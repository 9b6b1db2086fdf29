#!/usr/bin/env bash
# The one-command check of a GPU machine (benchmarks/gpu_check.py says what it runs and writes):
#
#     bash benchmarks/gpu_check.sh OUT_DIR [--budget SECONDS] [--jobs N]
#
# Stages in priority order (device facts, warp primitives, the GPU tests of the kernels and training, the
# training steps on CuPy and PyTorch, the attention sweep, the other GPU tests, NumPy beside CuPy on this
# machine, a kernel profile), each writing its results as it ends; with --budget (480 fits one 10-minute
# call of a GPU lease) a stage that no longer fits is skipped and says so. At most 8 files in OUT_DIR,
# summary.txt (failing tests by name) printed last. Installs nothing; PYTHON picks the interpreter.
set -uo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_check.py" "$@"
