"""A vLLM engine follows a training run over NIXL: the deltasync weight-transfer engine, given a controller in
``init_info``, reads each step's object from the trainer's ring (real NIXL agents, UCX over loopback, separate
processes), verifies it against the trainer's checksums, and acknowledges it; the controller advances the
engine's version only then. The engine's final weights are compared with checksums computed here from the
trainer's own tensors."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deltasync import tensor_checksum
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


def trainer(address: str, url: str, model_dir: str, out) -> None:
    """Publish steps 0..STEPS of the checkpoint's weights, changed a little each step, over NIXL and the store."""
    import time

    from deltasync import DeltaPublisher, Store
    from deltasync.transports.nixl import NixlTransport

    state = load_state(Path(model_dir))
    rdma = {"controller": address, "slot_bytes": 4 << 20, "plan_wait_s": 60.0, "ack_deadline_s": 30.0}
    with NixlTransport.trainer(url, rdma=rdma) as transport:
        with DeltaPublisher(Store(url, transport=transport), state, anchor_every=100, on_backlog="block") as pub:
            for step in range(STEPS + 1):
                if step:
                    for name, t in perturb(state, perturbed_names(False), seed=step, density=0.03).items():
                        state[name].copy_(t)
                pub.publish(step)
                pub.flush()
                time.sleep(0.2)
        out.put({"announced": list(transport.trainer.stats.announced),
                 "checksums": {n: tensor_checksum(t) for n, t in state.items()}})


ENGINE = textwrap.dedent(
    """
    import json, sys, time
    from rollout_loader.vllm import start_engine

    if __name__ == "__main__":
        model, url, address, out = sys.argv[1:5]
        llm = start_engine(model, weight_transfer=True, in_process=True, dtype="bfloat16", enforce_eager=True,
                           max_model_len=512, seed=0)
        llm.init_weight_transfer_engine({"init_info": {
            "url": url, "verify": "incremental",
            "rdma": {"controller": address, "capacity_bytes": 4 << 20, "plan_wait_s": 60, "engine": "e0"}}})
        deadline = time.monotonic() + 120
        while llm.get_weight_version() != str(%d) and time.monotonic() < deadline:
            llm.start_weight_update()
            try:
                llm.update_weights({"update_info": {"step": "latest"}})
            except Exception as e:  # nothing committed yet
                if "no committed step" not in str(e):
                    raise
                llm.finish_weight_update()
                time.sleep(0.2)
                continue
            engine = llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine
            llm.finish_weight_update(weight_version=str(engine.held_step))
            time.sleep(0.1)
        engine = llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine
        arrived = dict(engine._rdma.arrived)
        from rollout_loader.vllm.state import checksums
        sums = checksums(engine._state)  # the engine's own bits, one rank: whole tensors
        json.dump({"version": llm.get_weight_version(), "arrived": {str(k): v for k, v in arrived.items()},
                   "checksums": {n: str(v) for n, v in sums.items()}}, open(out, "w"))
    """ % STEPS
)


def test_engine_follows_a_training_run_over_nixl(tmp_path):
    from deltasync.rdma.controller import Controller

    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=False)
    url = str(tmp_path / "stream")
    controller = Controller(trainers=1, consumers=1)
    out = CTX.Queue()
    proc = CTX.Process(target=trainer, args=(controller.address, url, str(model_dir), out), daemon=True)
    proc.start()
    try:
        result = tmp_path / "engine.json"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "DELTASYNC_CPU_LIVE_WEIGHTS": "1"}
        r = subprocess.run([sys.executable, "-c", ENGINE, str(model_dir), url, controller.address, str(result)],
                           capture_output=True, text=True, timeout=400, check=False, env=env)
        assert r.returncode == 0, r.stderr[-4000:]
        report = out.get(timeout=120)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        controller.close()
    got = json.loads(result.read_text())
    assert got["version"] == str(STEPS)
    over_rdma = [int(s) for s, how in got["arrived"].items() if how == "rdma"]
    assert over_rdma and set(over_rdma) <= set(report["announced"]), got["arrived"]
    assert controller.versions.get("e0") == STEPS
    assert {n: int(v) for n, v in got["checksums"].items()} == report["checksums"]
