"""Runtime fingerprints (issue 33): a real vLLM CPU engine proves the bytes it computes with, after each update.

One tiny Qwen3-MoE, whose experts vLLM's CPU kernel prepacks after loading (a transformed parameter: the engine
shadows them and re-loads them through vLLM at every update, docs/MODELS.md). A fresh engine loaded from step 3's
replayed checkpoint stores the reference (the ``deltasync fingerprint`` command, in a process of its own); then
one followed engine:

* a corruption injected into the prepacked experts right after vLLM's reload (what a reload bug leaves) is caught
  against a sibling replica without any reference (``deltasync status`` flags it: exit status 1, the Prometheus
  metric), and against the reference, in both places the engine computes it: inside the pause (the update is
  undone whole) and after it (the engine says it is unhealthy; the next update undoes the step first);
* the followed engine's fingerprint at step 3 equals the fresh engine's (the independent reference).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch

from deltasync.errors import FingerprintMismatchError
from tests.integration.conftest import update_to
from tests.integration.families import build_family
from tests.test_cli_errors import run_cli, run_main

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ENGINE = dict(in_process=True, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0)
EXPERTS = "w13_weight"  # the CPU MoE kernel prepacks it after loading: a transformed parameter


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The stream (steps 0-3, every tensor changing), the reference of step 3 from a fresh engine, and the
    followed engine (in-process: one at a time, so the fresh one is closed before it starts)."""
    from vllm import envs

    from rollout_loader.vllm import start_engine
    from tests.integration.test_vllm_models import _close, _publish

    saved = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    root = tmp_path_factory.mktemp("fingerprint")
    model_dir = build_family("qwen3_moe", root / "model")
    url = str(root / "stream")
    _publish(model_dir, url)
    path, reference = _reference_by_cli(url, 3, model_dir)
    llm = start_engine(str(model_dir), **ENGINE)
    try:
        yield {"url": url, "model_dir": model_dir, "llm": llm, "reference": reference, "path": path}
    finally:
        _close(llm)
        del llm
        gc.collect()
        if saved is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
        envs.disable_envs_cache()


def _reference_by_cli(url: str, step: int, model_dir: Path) -> tuple[str, object]:
    """``deltasync fingerprint ... --json`` as a user runs it, in a fresh process (its stdout, vLLM's logs and all,
    must be the JSON alone), then the reference it stored, read back from the stream as a follower reads it."""
    from deltasync.fingerprints import read_reference
    from deltasync.store import Store

    engine_args = [a for k, v in ENGINE.items() for a in ("-E", f"{k}={json.dumps(v)}")]
    done = run_cli("fingerprint", url, "--step", str(step), "--files-from", str(model_dir), *engine_args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["step"] == step and summary["signed"] is False and summary["tensors"] > 0
    with Store(url) as store:
        reference = read_reference(store, summary["config_key"], step, trusted=None)
    assert reference is not None and reference.fingerprint == summary["fingerprint"]
    assert reference.config_key == summary["config_key"] and len(reference.ranks) == summary["ranks"]
    return summary["path"], reference


def _engine(llm):
    return llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]


def _settled(llm, timeout_s: float = 120.0) -> dict:
    """The engine's fingerprint record once it is computed (``fingerprint="after"`` computes it on a thread)."""
    from rollout_loader.vllm import LocalWeightTransfer

    deadline = time.monotonic() + timeout_s
    while True:
        fp = LocalWeightTransfer(llm).status(checksums=False)["fingerprint"]
        if fp["check"] != "pending" or time.monotonic() > deadline:
            return fp
        time.sleep(0.05)


def _corrupt_next_reload(llm) -> dict:
    """Flip one bit of a prepacked expert weight right after vLLM's next reload of the experts (once): what a
    reload that leaves a transformed weight wrong without an error does. Returns what was hit."""
    engine = _engine(llm)
    state, hit = engine._state, {}
    original = state.reload

    def reload(weights, modules):
        original(weights, modules)
        for name, p in engine.model.named_parameters():
            if name.endswith(EXPERTS) and name.rpartition(".")[0] in modules and not hit:
                with torch.no_grad():
                    p.data.view(-1).view(torch.int16)[7] ^= 1
                hit["name"] = name
        if hit:
            state.reload = original

    state.reload = reload
    return hit


def test_a_corrupted_reload_is_flagged_against_a_sibling_without_a_reference(world, monkeypatch, capsys):
    """Two replicas of one configuration at step 2 (no reference for it): one healthy, one whose expert weights
    vLLM's reload left wrong. Both followed through a Follower with a consumer id; ``deltasync status`` says which
    disagree, exits 1 and exports the metric."""
    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget

    llm, url = world["llm"], world["url"]
    follower = Follower(url, VllmTarget(llm, step=0), consumer_id="replica-0")  # no thread: it stays at step 2
    try:
        follower.sync(2)
        fp = _settled(llm)
        assert fp["step"] == 2 and fp["check"] == "no reference" and fp["fingerprint"]
        assert fp["config_key"] == world["reference"].config_key  # the fresh engine's configuration is this one's
        assert follower.heartbeat(force=True)
    finally:
        follower.close()
    healthy = fp["fingerprint"]

    update_to(llm, 1)  # back, then forward again through a reload that leaves an expert weight wrong
    hit = _corrupt_next_reload(llm)
    update_to(llm, 2)
    assert hit, "the experts were not reloaded"
    follower = Follower(url, VllmTarget(llm), consumer_id="replica-1")
    try:
        follower.sync(2)
        bad = _settled(llm)
        assert follower.heartbeat(force=True)
    finally:
        follower.close()
    assert bad["step"] == 2 and bad["fingerprint"] != healthy  # the checkpoint checksums matched all along
    assert bad["check"] == "no reference"

    code, out, _ = run_main(monkeypatch, capsys, "status", url, "--json")
    assert code == 1

    report = json.loads(out)
    assert report["healthy"] is False
    (d,) = report["disagreements"]
    assert d["step"] == 2 and sorted(d["groups"].values()) == [["replica-0"], ["replica-1"]]
    assert {c["consumer_id"]: c["disagrees"] for c in report["consumers"]} == {"replica-0": True, "replica-1": True}
    code, out, _ = run_main(monkeypatch, capsys, "status", url, "--prometheus")
    line = next(x for x in out.splitlines() if x.startswith("deltasync_fleet_disagreeing_consumers{"))
    assert code == 1 and line.endswith(" 2")
    code, out, _ = run_main(monkeypatch, capsys, "status", url)
    assert code == 1 and "disagree at step 2" in out


def test_a_corrupted_reload_inside_the_pause_is_undone_against_the_reference(world):
    """``fingerprint="pause"``: the update to step 3 compares with the reference before it returns; a wrong expert
    weight undoes the whole update (the engine holds step 2 again) and the error names the tensor."""
    from rollout_loader.vllm import LocalWeightTransfer

    llm, url = world["llm"], world["url"]
    llm.init_weight_transfer_engine({"init_info": {"url": url, "fingerprint": "pause"}})  # same stream: step kept
    engine = _engine(llm)
    assert engine.held_step == 2
    hit = _corrupt_next_reload(llm)
    with pytest.raises(FingerprintMismatchError, match=r"not the reference's.*holds step 2 again") as e:
        LocalWeightTransfer(llm).update(3)
    assert hit["name"] in str(e.value)
    assert engine.held_step == 2


def test_a_followed_engine_holds_the_fresh_engines_fingerprint(world):
    """The update to step 3 without a fault: the followed engine's runtime fingerprint equals the one a fresh
    engine loaded from step 3's replayed checkpoint holds (the reference), tensor for tensor."""
    from rollout_loader.vllm import LocalWeightTransfer

    llm, reference = world["llm"], world["reference"]
    client = LocalWeightTransfer(llm)
    client.update(3)
    st = client.status(checksums=True)
    fp = st["fingerprint"]
    assert (fp["step"], fp["check"]) == (3, "match")
    assert fp["fingerprint"] == reference.fingerprint
    mine = fp["tensors"][0]
    assert {n: t.checksum for n, t in reference.ranks[0].tensors.items()} == {n: v[0] for n, v in mine.items()}
    assert any(EXPERTS in n for n in mine)
    assert _engine(llm).pause_parts[-1]["fingerprint"] > 0  # inside the pause in this mode
    # which step produced a completion (docs/INTEGRATIONS.md): vLLM's own spans name the deltasync step
    from vllm import SamplingParams

    (out,) = llm.generate(["provenance"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [(s.version, s.start, s.end) for s in out.outputs[0].weight_versions] == [("3", 0, 4)]


def test_a_mismatch_found_after_the_pause_marks_the_engine_unhealthy_and_the_next_update_undoes_it(world):
    """``fingerprint="after"`` (the default): the update returns, the fingerprint runs on its own thread and finds
    the mismatch; the engine says it is unhealthy (status, heartbeat record) until the next update, which undoes
    the step first and raises; the update after that goes through and matches."""
    from rollout_loader.vllm import LocalWeightTransfer, VllmTarget

    llm, url = world["llm"], world["url"]
    llm.init_weight_transfer_engine({"init_info": {"url": url, "fingerprint": "after"}})
    client = LocalWeightTransfer(llm)
    client.update(2)
    _corrupt_next_reload(llm)
    client.update(3)  # returns: the fingerprint is computed after the pause
    fp = _settled(llm)
    assert fp["check"] == "mismatch" and fp["unhealthy"]
    record = VllmTarget(llm).record()
    assert record.fingerprint_check == "mismatch" and "not the reference's" in (record.last_error or "")
    with pytest.raises(FingerprintMismatchError, match="found after the update to step 3 returned.*holds step 2 "
                                                       "again"):
        client.update(3)
    assert _engine(llm).held_step == 2
    client.update(3)
    fp = _settled(llm)
    assert fp["check"] == "match" and fp["fingerprint"] == world["reference"].fingerprint
    assert Path(world["url"], world["path"]).is_file()
