#!/usr/bin/env bash
# Entry point of the one-shot GPU check (see benchmark/gpu_check/__main__.py), e.g. from anywhere:
#
#     OUT=/some/dir bash benchmark/gpu_check.sh            # all defaults: batch 16, 32K context
#     bash benchmark/gpu_check.sh --shapes smollm2 --batches 16
#
# Nothing is installed: our kernels need only torch + triton, both present on the GPU machine;
# SGLang's kernels and FlashInfer are timed where they import. GPU state is only read (nvidia-smi
# with no options); no clock, power, persistence or MIG setting is touched.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT="${OUT:-benchmark/results/gpu}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"

if command -v nvidia-smi >/dev/null 2>&1; then
    # A failing nvidia-smi should not stop the check; torch reports the device too.
    nvidia-smi || echo "nvidia-smi failed (exit $?)"
else
    echo "nvidia-smi: not found"
fi
"$PYTHON" - <<'PY'
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
try:
    import triton

    print(f"triton {triton.__version__}")
except ImportError as error:
    print(f"triton not importable: {error}")
PY

# -u: progress lines reach the log as they happen, should the time limit cut the run short.
exec "$PYTHON" -u -m benchmark.gpu_check "$@"
