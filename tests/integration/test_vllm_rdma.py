"""A vLLM engine in multiprocess mode follows a training run over NIXL: the deltasync weight-transfer engine in
the engine's worker(s), given a controller in ``init_info``, reads each step's object from the trainer's ring
(real NIXL agents, UCX over loopback, the trainer in its own process), verifies it against the trainer's
checksums, and acknowledges it; the controller advances the engine's version only then. The engine's final
weights are compared with checksums computed in the trainer process from its own tensors.

The engine runs as vLLM runs in production, its engine core and worker(s) in processes of their own (reached
from the driver through ``collective_rpc`` only). TP=2 (two workers, two NIXL consumers grouped as one
engine) runs with ``DELTASYNC_TEST_TP2=1``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deltasync.engine import tensor_checksum
from deltasync.rdma.agent import nixl_available
from tests.integration.conftest import (
    build_checkpoint,
    load_state,
    perturb,
    perturbed_names,
)

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not nixl_available(), reason="needs NIXL: pip install 'deltasync[rdma]'")]

STEPS = 4
CTX = mp.get_context("spawn")
SECRET = "the-cluster-secret-of-this-engine-test-0123456789"  # the control plane is authenticated


def trainer(address: str, url: str, model_dir: str, out) -> None:
    """Publish steps 0..STEPS of the checkpoint's weights, changed a little each step, over NIXL and the store."""
    import time

    from deltasync import DeltaPublisher

    state = load_state(Path(model_dir))
    committed: list[float] = []  # when each step was committed and offered (unix time, for a failure's story)
    rdma = {"secret": SECRET, "controller": address, "slot_bytes": 4 << 20, "plan_wait_s": 600.0,
            "ack_deadline_s": 30.0}
    with DeltaPublisher(url, state, anchor_every=100, on_backlog="block", rdma=rdma) as pub:
        for step in range(STEPS + 1):
            if step:
                for name, t in perturb(state, perturbed_names(False), seed=step, density=0.03).items():
                    state[name].copy_(t)
            pub.publish(step)
            pub.flush()
            committed.append(round(time.time(), 2))
            time.sleep(0.2)
        stats = pub.rdma.stats  # the ring stays up until the publisher closes
    out.put({"announced": list(stats.announced), "committed_at": committed,
             "store_only": list(stats.store_only),
             "checksums": {n: tensor_checksum(t) for n, t in state.items()}})


# the driver, in a fresh process: an LLM in this pytest process would share vLLM's settings with in-process
# engines of other tests (VLLM_ENABLE_V1_MULTIPROCESSING, cached once an engine starts)
ENGINE = textwrap.dedent(
    """
    import json, sys, time
    from deltasync import StreamReader
    from rollout_loader.vllm import start_engine
    from rollout_loader.vllm.worker import transfer_status

    if __name__ == "__main__":
        model, url, address, out, tp, last = sys.argv[1:7]
        llm = start_engine(model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                           seed=0, tensor_parallel_size=int(tp))
        try:
            llm.init_weight_transfer_engine({"init_info": {
                "url": url, "verify": "incremental",
                "rdma": {"controller": address, "capacity_bytes": 4 << 20, "engine": "e0"}}})
            versions = []
            with StreamReader(url) as reader:
                reader.wait_for(0, timeout_s=300)
                deadline = time.monotonic() + 300  # a loaded 2-core machine: generous, the test is not a timing
                while llm.get_weight_version() != last and time.monotonic() < deadline:
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"step": "latest"}})
                    llm.finish_weight_update(weight_version=str(transfer_status(llm, checksums=False)["held_step"]))
                    if not versions or versions[-1][1] != llm.get_weight_version():
                        versions.append((round(time.time(), 2), llm.get_weight_version()))
                    time.sleep(0.1)
            status = transfer_status(llm)  # every rank's parts added up: whole tensors
            json.dump({"version": llm.get_weight_version(), "versions": versions,
                       "arrived": {str(k): v for k, v in status["arrived"].items()},
                       "checksums": {n: str(v) for n, v in status["checksums"].items()}}, open(out, "w"))
        finally:
            llm.shutdown_weight_transfer_engine()
            llm.llm_engine.engine_core.shutdown(timeout=60)
    """
)


def run_alone(cmd: list[str], *, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` in a process group of its own; its exit code and stderr once no process of the group is
    left (vLLM's engine core and workers included), the whole group killed if it overruns ``timeout_s``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return proc.returncode, stderr
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"processes of {cmd[:2]} outlived it by 30 s (killed now)")


@pytest.mark.parametrize("tp", [
    1, pytest.param(2, marks=pytest.mark.skipif(os.environ.get("DELTASYNC_TEST_TP2") != "1",
                                                reason="TP=2 (two vLLM workers): set DELTASYNC_TEST_TP2=1"))])
def test_multiprocess_engine_follows_a_training_run_over_nixl(tmp_path, tp):
    from deltasync.rdma.controller import Controller

    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=False)
    url = str(tmp_path / "stream")
    controller = Controller(trainers=1, consumers=tp, secret=SECRET)
    out = CTX.Queue()
    proc = CTX.Process(target=trainer, args=(controller.address, url, str(model_dir), out), daemon=True)
    proc.start()
    try:
        result = tmp_path / "engine.json"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
               "DELTASYNC_RDMA_SECRET": SECRET}  # the engine's workers inherit the cluster secret
        if tp > 1:  # vLLM's CPU workers bind their threads per NUMA node unless told which cores: one each
            cores = sorted(os.sched_getaffinity(0))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cores[r % len(cores)]) for r in range(tp)))
        code, stderr = run_alone([sys.executable, "-c", ENGINE, str(model_dir), url, controller.address, str(result),
                                  str(tp), str(STEPS)], env=env, timeout_s=900)
        assert code == 0, stderr[-4000:]
        report = out.get(timeout=120)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        controller.close()
    got = json.loads(result.read_text())
    why = f"engine (unix time, version): {got['versions']}, arrived: {got['arrived']}\n" \
          f"trainer committed at: {report['committed_at']}, store only: {report['store_only']}\n" \
          f"engine stderr: {stderr[-6000:]}"
    assert got["version"] == str(STEPS), why
    held = [int(v) for _, v in got["versions"]]
    assert held == sorted(held), why
    over_rdma = [int(s) for s, how in got["arrived"].items() if how == "rdma"]
    assert over_rdma and set(over_rdma) <= set(report["announced"]), why
    assert controller.versions.get("e0") == STEPS
    assert {n: int(v) for n, v in got["checksums"].items()} == report["checksums"]
