"""The deltasync weight-transfer engine inside real vLLM (registered by the ``vllm.general_plugins`` entry point).

A server started with ``--weight-transfer-config '{"backend": "deltasync"}'`` follows a stream on S3 (SeaweedFS)
through vLLM's own routes, driven by ``deltasync follow --server`` without vLLM installed and without access to
the server's files: ``/weight_info`` names each step, a restarted follower goes on from the step the server
holds, and greedy output equals a fresh engine loaded from the replayed step. The offline ``LLM`` path
(``llm.init_weight_transfer_engine`` / ``update_weights``) applies anchors and deltas, verified, and refuses a
bad step without changing the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader, replay_to_folder
from deltasync.engine import tensor_checksum
from tests.integration.conftest import (
    PROMPTS,
    build_checkpoint,
    engine,
    load_state,
    perturb,
    perturbed_names,
    save_like,
)
from tests.integration.seaweedfs import s3_server  # noqa: F401 - fixture
from tests.integration.test_vllm_server import _completions
from tests.integration.test_vllm_server_errors import vllm_server
from tests.test_cli_errors import assert_one_line_error, run_cli

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.s3]


def _steps_printed(stdout: str) -> list[str]:
    return [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")]


def _weight_version(base: str) -> str:
    with urllib.request.urlopen(f"{base}/weight_info", timeout=10) as r:
        return json.loads(r.read())["weight_version"]


def _s3_options(server) -> list[str]:
    """The S3 storage options as ``-S KEY=VALUE`` arguments (sent on to the vLLM server in init_info)."""
    args = []
    for key, value in server.storage_options.items():
        args += ["-S", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return args


def _publish(pub: DeltaPublisher, state: dict[str, torch.Tensor], steps: range, *, tie: bool = False) -> None:
    for step in steps:
        if step:
            for name, t in perturb(state, perturbed_names(tie), seed=100 + step, density=0.02).items():
                state[name].copy_(t)
        pub.publish(step)
    pub.flush()


def test_server_follows_a_stream_on_s3_through_vllm_routes(s3_server, tmp_path):  # noqa: F811
    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=False)
    url, opts = s3_server.new_url(), s3_server.storage_options
    state = load_state(model_dir)
    with DeltaPublisher(url, state, storage_options=opts, anchor_every=100, on_backlog="block") as pub, \
            vllm_server(model_dir, tmp_path, dev_mode=True, extension=False, weight_transfer=True) as base:
        assert _weight_version(base) == "default"
        # a client without vLLM installed: mistakes are one line each, the server untouched
        r = run_cli("follow", str(tmp_path / "no-stream-here"), "--server", base, block_vllm=True)
        assert_one_line_error(r.returncode, r.stderr, "StreamNotFoundError", "no deltasync stream at")
        r = run_cli("follow", url, "--server", base, "--verify", "everything", block_vllm=True)
        assert_one_line_error(r.returncode, r.stderr, "--verify", "'everything'")
        assert _weight_version(base) == "default"
        _publish(pub, state, range(0, 3))
        follow = ["follow", url, "--server", base, "--verify", "all", *_s3_options(s3_server)]
        r = run_cli(*follow, "--until", "2", block_vllm=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert _steps_printed(r.stdout) == ["0", "1", "2"]
        assert _weight_version(base) == "2"

        # the trainer goes on; a new follower asks the server where it is instead of replaying from step 0
        _publish(pub, state, range(3, 6))
        r = run_cli(*follow, "--until", "5", block_vllm=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert _steps_printed(r.stdout) == ["3", "4", "5"]
        assert _weight_version(base) == "5"
        r = run_cli(*follow, "--until", "5", block_vllm=True)  # nothing to do: nothing paused, nothing printed
        assert r.returncode == 0 and _steps_printed(r.stdout) == [], r.stdout + r.stderr
        served = _completions(base, PROMPTS)  # the long prompt proves the prefix cache was dropped

        # a step that is not in the stream: refused by the server's engine, which keeps step 5
        r = run_cli(*follow, "--until", "7", "--timeout-s", "3", block_vllm=True)
        assert_one_line_error(r.returncode, r.stderr, "WaitTimeoutError", "holds step 5")
        assert _weight_version(base) == "5" and _completions(base, PROMPTS) == served

        # the trainer goes on written against vLLM's trainer API (issue 28, item 3): deltasync's trainer engine from
        # vLLM's registry drives the server through vLLM's own HTTP client (step 6), then through a framework's own
        # client with only the protocol's four methods (step 7); the stream goes on where it was
        pub.close()  # the trainer engine's publisher takes the stream's lease
        state = _trainer_engine_steps(url, opts, model_dir, state, base)
        assert _weight_version(base) == "7"
        served = _completions(base, PROMPTS)

    last = 7
    replayed = replay_to_folder(url, last, str(tmp_path / "step7"), storage_options=opts)
    with StreamReader(url, storage_options=opts) as reader:
        assert {k: tensor_checksum(v) for k, v in reader.state_dict(last).items()} == \
               {k: tensor_checksum(v) for k, v in state.items()}  # the trainer's bits at the last step
    fresh_dir = save_like(model_dir, tmp_path / "fresh", load_state(Path(replayed.path)))
    with engine(fresh_dir, "bfloat16", live=True) as fresh:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert [o.outputs[0].text for o in fresh.generate(PROMPTS, sp, use_tqdm=False)] == served


class _FrameworkClient:
    """A framework's own weight-sync client: vLLM's four-method ``VLLMWeightSyncClient`` protocol and nothing more
    (here over vLLM's HTTP routes through vLLM's own client), so deltasync drives it as a plain protocol client."""

    def __init__(self, base: str) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self._http = HTTPVLLMWeightSyncClient(base)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._http.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._http.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self._http.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._http.finish_weight_update(weight_version)


def _trainer_engine_steps(url: str, opts: dict, model_dir: Path, state: dict[str, torch.Tensor],
                          base: str) -> dict[str, torch.Tensor]:
    """Steps 6 and 7 through vLLM's trainer factory; returns the trainer's weights at step 7."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rollout_loader.vllm import HttpWeightTransfer, SyncClientTransfer
    from rollout_loader.vllm.trainer import DeltasyncTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    model.load_state_dict(state)  # the trainer's weights at step 5
    info = DeltasyncTrainerInitInfo(url=url, storage_options=opts, rank=0, engine={"verify": "all"})
    for step, client, kind in ((6, HTTPVLLMWeightSyncClient(base), HttpWeightTransfer),
                               (7, _FrameworkClient(base), SyncClientTransfer)):
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        try:
            assert isinstance(engine.target.client, kind)
            with torch.no_grad():
                now = model.state_dict()
                for name, t in perturb(now, perturbed_names(False), seed=200 + step, density=0.02).items():
                    now[name].copy_(t)
            assert engine.send_weights() == step  # published, committed, applied and verified by the server
        finally:
            engine.shutdown()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_OFFLINE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import SamplingParams
    from rollout_loader.vllm import start_engine

    if __name__ == "__main__":
        model, url, prompts, out = sys.argv[1:5]
        llm = start_engine(model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                           seed=0, in_process=True)
        sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True)
        gen = lambda: [list(o.outputs[0].token_ids) for o in llm.generate(json.loads(prompts), sp, use_tqdm=False)]
        res = {"before": gen()}
        from deltasync.notify import EventServer
        events = EventServer()  # a mirror's feed: the prefetcher hears of steps from it
        llm.init_weight_transfer_engine({"init_info": {"url": url, "verify": "incremental", "notify": events.url}})
        engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]  # in-process: the object
        events.announce(5)
        feed = engine._prefetcher.watch.notifier
        deadline = time.monotonic() + 60
        while not (feed.alive and feed.newest == 5) and time.monotonic() < deadline:
            time.sleep(0.01)
        res["feed"] = [type(feed).__name__, feed.alive, feed.newest]
        for step in (2, 4, "latest"):
            if step == "latest":  # the prefetcher seals step 5 against step 4's bits: the pause only scatters
                deadline = time.monotonic() + 60
                while not engine.is_staged(5) and time.monotonic() < deadline:
                    time.sleep(0.01)
            llm.start_weight_update()
            llm.update_weights({"update_info": {"step": step}})
            llm.finish_weight_update(weight_version=str(step))
            llm.reset_prefix_cache()
            res.setdefault("versions", []).append(llm.get_weight_version())
            res.setdefault("tokens", []).append(gen())
        errors = []
        for info in ({"step": 99}, {"step": -1}, {"stp": 3}):
            llm.start_weight_update()
            try:
                llm.update_weights({"update_info": info})
            except Exception as e:
                errors.append(str(e))
        try:
            llm.init_weight_transfer_engine({"init_info": {"url": url, "notify": "ftp://mirror/events"}})
        except Exception as e:
            errors.append(str(e))
        res["errors"] = errors
        res["after_errors"] = gen()
        res["sealed"] = engine.sealed_steps
        json.dump(res, open(out, "w"))
    """
)


def test_offline_llm_follows_through_weight_transfer_methods(tmp_path):
    """Anchors (step 0: weights that differ from the engine's, and step 3) are written as a dense XOR against
    the held bits, deltas in place; a delta the prefetcher sealed against the held bits (step 5) is a plain
    scatter; every step verified; bad requests change nothing."""
    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=True)
    url = str(tmp_path / "stream")
    state = {k: v.clone() for k, v in load_state(model_dir).items()}
    for name, t in perturb(state, perturbed_names(True), seed=5, density=0.5).items():  # the anchor is not the model
        state[name].copy_(t)
    states = {}
    with DeltaPublisher(url, state, anchor_every=3, on_backlog="block") as pub:
        for step in range(6):
            if step:
                for name, t in perturb(state, perturbed_names(True), seed=step).items():
                    state[name].copy_(t)
            pub.publish(step)
            states[step] = {k: v.clone() for k, v in state.items()}
    script, out = tmp_path / "offline.py", tmp_path / "out.json"
    script.write_text(_OFFLINE_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script), str(model_dir), url, json.dumps(PROMPTS), str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["versions"] == ["2", "4", "latest"]
    assert res["tokens"][0] != res["before"]
    assert res["errors"][0].startswith("StepNotFoundError") or "step 99" in res["errors"][0]
    assert "step must be a step number" in res["errors"][1]
    assert "Invalid update_info" in res["errors"][2]
    from deltasync.errors import ConfigError, in_text

    relayed = in_text(res["errors"][3])  # the engine's error as data: its class travels with its text
    assert type(relayed) is ConfigError and not relayed.retryable
    assert "setting notify: expected an event feed URL (http://HOST:PORT/events), got 'ftp://mirror/events'" in str(
        relayed)
    assert res["feed"] == ["EventFeed", True, 5]  # init_info's notify: the prefetcher listens to the mirror's feed
    assert res["after_errors"] == res["tokens"][2]
    assert res["tokens"][0] != res["tokens"][1] != res["tokens"][2]
    assert 5 in res["sealed"]
    # one in-process engine per test here (vLLM's distributed state does not survive a second in this process
    # after the S3 server tests): the last step, reached through the anchor at step 3 and the sealed step 5,
    # against a fresh engine
    with engine(save_like(model_dir, tmp_path / "fresh", states[5]), "bfloat16", live=True) as fresh:
        from tests.integration.conftest import generate

        assert generate(fresh) == res["tokens"][2]
