"""Server mode against a real `vllm` OpenAI server process (default multiprocess engine), following a local
stream by a relative path from another working directory.

Outside CI's budget (``./run.sh test -m outside_ci``): CI follows a server from a client without vLLM over S3
in tests/integration/test_vllm_engine.py, and the relative path's resolution is tested in tests/test_vllm_client.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deltasync import StreamReader
from deltasync.format.checksum import parse_checksum
from rollout_loader.vllm import HttpWeightTransfer
from tests.integration.conftest import PROMPTS, build_checkpoint, engine, save_like
from tests.integration.seaweedfs import _free_port
from tests.integration.test_vllm_follow import train_and_publish

pytestmark = [pytest.mark.vllm, pytest.mark.outside_ci]


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _completions(base: str, prompts: list[str]) -> list[str]:
    out = []
    for p in prompts:
        request = {"model": "m", "prompt": p, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        body = json.dumps(request).encode()
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(json.loads(r.read())["choices"][0]["text"])
    return out


@contextmanager
def vllm_server(model_dir: Path, log_path: Path, *, served_name: str = "m") -> Iterator[str]:
    """A vLLM OpenAI server process on a free port serving ``model_dir`` with the deltasync engine and the
    status extension (CPU: live weights, 1 GiB KV cache); yields its base URL and stops it afterwards. Its log
    goes to ``log_path`` (the tail is raised when it fails to start). Starting takes about a minute here."""
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", DELTASYNC_CPU_LIVE_WEIGHTS="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--served-model-name", served_name, "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512",
             "--host", "127.0.0.1", "--port", str(port),
             "--worker-extension-cls", "rollout_loader.vllm.worker.DeltaWorkerExtension",
             "--weight-transfer-config", '{"backend": "deltasync"}'],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            try:
                _get(f"{base}/health")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log_path.read_text(errors="replace")[-3000:]) from None
                time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def server(tmp_path):
    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=False)
    with vllm_server(model_dir, tmp_path / "server.log") as base:
        yield base, model_dir


def test_follow_keeps_a_running_server_in_sync(server, tmp_path):
    base, model_dir = server
    url = str(tmp_path / "stream")
    states = train_and_publish(model_dir, url, 6)
    before = _completions(base, PROMPTS)

    # the command a user runs next to the server, from another working directory than the server's: the
    # relative stream path reaches the server as an absolute one
    repo = str(Path(__file__).resolve().parents[2])
    cli = subprocess.run(
        [sys.executable, "-m", "deltasync_cli", "follow", "stream", "--server", base, "--until", "5", "--verify",
         "all"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))},
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    # from the nearest anchor (step 4, anchor_every=4), written by the server's engine, then step 5
    assert [line.split()[1] for line in cli.stdout.splitlines() if line.startswith("step ")] == ["4", "5"]

    with StreamReader(url).open(5) as obj:
        want = {n: parse_checksum(t.checksum) for n, t in obj.header.tensors.items()}
    status = HttpWeightTransfer(base).status()  # the server's engine, every tensor checksummed again
    assert status["held_step"] == 5 and status["checksums"] == want  # the trainer's weights, bit for bit
    served = _completions(base, PROMPTS)  # the long prompt proves the prefix cache was reset
    assert served != before

    with engine(save_like(model_dir, tmp_path / "trained", states[5]), "bfloat16", live=True) as fresh:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert [o.outputs[0].text for o in fresh.generate(PROMPTS, sp, use_tqdm=False)] == served
