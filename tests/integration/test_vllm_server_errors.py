"""Real vLLM servers started without what deltasync needs, and a client without vLLM installed.

A server without ``VLLM_SERVER_DEV_MODE=1`` answers 404 on ``/weight_info`` and ``/pause``; one without
``--weight-transfer-config`` answers 500 saying weight transfer is not configured (an offline ``LLM`` raises).
Either way the user is told which flag is missing, in one line, before anything is paused. ``deltasync follow
--server`` needs no vLLM package (tests/integration/test_vllm_engine.py follows a server from a client without it).
One server at a time (each test starts its own; ~20-60 s each on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import EngineConfigError, StoreError
from deltasync.format.checksum import parse_checksum
from rollout_loader import Follower
from rollout_loader.vllm import VllmTarget
from tests.integration.conftest import PROMPTS, build_checkpoint, load_state, perturb, perturbed_names
from tests.integration.seaweedfs import _free_port
from tests.test_cli_errors import assert_one_line_error, run_cli

pytestmark = pytest.mark.vllm

DEV_MODE_NEEDLE = "VLLM_SERVER_DEV_MODE=1"
WEIGHT_TRANSFER_NEEDLE = "--weight-transfer-config '{\"backend\": \"deltasync\"}'"


@pytest.fixture(scope="module")
def model_and_stream(tmp_path_factory) -> tuple[Path, str, dict[str, int]]:
    """A tiny checkpoint, and a stream of it: step 0 (an anchor: these weights), step 1 (a delta); with the
    trainer's checksums of step 1."""
    root = tmp_path_factory.mktemp("server-errors")
    model_dir = root / "model"
    build_checkpoint(model_dir, tie=False)
    url = str(root / "stream")
    state = load_state(model_dir)
    with DeltaPublisher(url, state, on_backlog="block") as pub:
        pub.publish(0)
        for name, t in perturb(state, perturbed_names(False), seed=3).items():
            state[name].copy_(t)
        pub.publish(1)
    with StreamReader(url) as reader, reader.open(1) as obj:
        want = {n: parse_checksum(t.checksum) for n, t in obj.header.tensors.items()}
    return model_dir, url, want


@contextmanager
def vllm_server(model_dir: Path, log_dir: Path, *, dev_mode: bool, extension: bool,
                weight_transfer: bool = False) -> Iterator[str]:
    """A vLLM OpenAI server process started as a user would, with or without what deltasync needs: dev mode and
    the weight-transfer engine (``deltasync follow --server``), and the read-only status extension."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    env.update(DELTASYNC_CPU_LIVE_WEIGHTS="1", VLLM_CPU_KVCACHE_SPACE="1")
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           "m",
           "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512", "--host", "127.0.0.1", "--port",
           str(port)]
    if extension:
        cmd += ["--worker-extension-cls", "rollout_loader.vllm.worker.DeltaWorkerExtension"]
    if weight_transfer:
        cmd += ["--weight-transfer-config", '{"backend": "deltasync"}']
    log_path = log_dir / f"server-dev{int(dev_mode)}-ext{int(extension)}-wt{int(weight_transfer)}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log_path.read_text()[-3000:]) from None
                time.sleep(1)
        yield base
    finally:
        _stop_group(proc)
        # vLLM ends its engine-core process without running its exit handlers, so a download cache the
        # deltasync engine made there outlives it; the library's promise is that the next process reclaims
        # folders whose owner died: this test process is that next process.
        from deltasync.store.scratch import reclaim_abandoned

        reclaim_abandoned("cache", older_than_s=0)


def _stop_group(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM the server's whole process group (API server and engine core), SIGKILL what is left after
    ``timeout_s``, and wait until no process of the group remains."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        try:
            os.killpg(proc.pid, 0)  # anyone left in the group?
        except ProcessLookupError:
            break
        if time.monotonic() >= deadline:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    proc.wait()


def serves(base: str) -> bool:
    """The server answers a completion: it is up and not paused (a paused server holds requests)."""
    body = json.dumps({"model": "m", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return bool(json.loads(r.read())["choices"][0]["text"] is not None)


@pytest.mark.parametrize(
    ("dev_mode", "weight_transfer", "needle"),
    # a server of its own each (~1 min on CPU): outside CI's budget (-m outside_ci); CI checks the client's
    # reading of both answers against stand-in servers (tests/test_vllm_client.py) and the offline engine's below
    [pytest.param(False, True, DEV_MODE_NEEDLE, marks=pytest.mark.outside_ci),
     pytest.param(True, False, WEIGHT_TRANSFER_NEEDLE, marks=pytest.mark.outside_ci)],
    ids=["without-dev-mode", "without-weight-transfer"],
)
def test_server_not_set_up_for_deltasync(model_and_stream, tmp_path, dev_mode, weight_transfer, needle):
    model_dir, url, _ = model_and_stream
    with vllm_server(model_dir, tmp_path, dev_mode=dev_mode, extension=False, weight_transfer=weight_transfer) as base:
        follower = Follower(url, VllmTarget(base))
        with pytest.raises(EngineConfigError, match=needle) as e:
            follower.connect()
        follower.close()
        assert not isinstance(e.value, StoreError)
        r = run_cli("follow", url, "--server", base, "--until", "1")
        assert_one_line_error(r.returncode, r.stderr, "EngineConfigError", needle)
        assert r.stdout == ""
        assert serves(base)  # still serving, and not left paused
        if dev_mode:  # the weights were never touched (the route is a dev-mode one)
            with urllib.request.urlopen(f"{base}/weight_info", timeout=10) as info:
                assert json.loads(info.read())["weight_version"] == "default"


def test_offline_engine_without_weight_transfer(model_and_stream, tmp_path):
    """An in-process ``LLM`` created without ``weight_transfer_config``: following it names the setting, and the
    engine keeps serving its weights. Runs in its own process: an in-process engine that is never closed
    leaves vLLM's distributed state half set up for the next one."""
    model_dir, url, _ = model_and_stream
    script = textwrap.dedent(
        """
        import sys
        from vllm import LLM
        from deltasync.errors import EngineConfigError
        from rollout_loader import Follower
        from rollout_loader.vllm import VllmTarget
        llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0,
                  distributed_executor_backend="uni")
        follower = Follower(sys.argv[2], VllmTarget(llm))
        try:
            follower.sync()
        except EngineConfigError as e:
            print("RAISED", e)
        follower.close()
        print("VERSION", llm.get_weight_version())
        """
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script, str(model_dir), url], capture_output=True, text=True, env=env,
                          timeout=300)
    raised = [line for line in proc.stdout.splitlines() if line.startswith("RAISED")]
    assert proc.returncode == 0 and raised, proc.stderr[-3000:]
    assert "weight_transfer_config=" in raised[0] and "start_engine" in raised[0]
    assert "VERSION default" in proc.stdout  # nothing was applied
