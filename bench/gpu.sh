#!/usr/bin/env bash
# GPU run of issue 22, one command (a few minutes on an H100): correctness first, then the device benchmark.
#   bench/gpu.sh [PYTHON]        (default: .venv/bin/python, else python3)
# Prints the card, gpu_check.py's verdict, then bench_gpu.py's tables; JSON goes to bench/results/.
# Extra arguments for bench_gpu.py: BENCH_GPU_ARGS="--shape 8b --steps 6" bench/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("card:", torch.cuda.get_device_name(), "| torch", torch.__version__)'
mkdir -p bench/results
"$PY" bench/gpu_check.py --steps 6 --out "bench/results/gpu-check-$(date +%F).json"
# shellcheck disable=SC2086
"$PY" bench/bench_gpu.py ${BENCH_GPU_ARGS:-}
