"""``DeltasyncWeightTransfer`` without a server: each bad setting is one ConfigError naming it, the TRL version
is pinned by its protocol, nothing is touched before TRL calls it (other ranks build it too), and the trainer's
tensors are always read to the end. Against a real vLLM server and TRL's real train(): tests/integration/
test_trl_async.py."""

from __future__ import annotations

import importlib.metadata
import socket
import subprocess
import sys
from typing import Protocol

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install 'deltasync[trl]')")

from deltasync.errors import ConfigError, EngineUnreachableError, MissingDependencyError
from deltasync.signing import keygen
from rollout_loader.integrations import trl as integration
from rollout_loader.integrations.trl import TESTED_TRL, DeltasyncWeightTransfer, check_trl
from rollout_loader.vllm import VllmTarget

SERVER = "http://127.0.0.1:8000"


def closed_port_url() -> str:
    """A server URL nothing listens at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_the_installed_trl_is_the_pinned_one_and_this_class_speaks_its_protocol():
    from trl.experimental.async_grpo.async_grpo_trainer import WeightTransferProtocol

    assert check_trl() == TESTED_TRL == importlib.metadata.version("trl")
    ours = integration._methods(DeltasyncWeightTransfer)
    theirs = integration._methods(WeightTransferProtocol)
    assert {name: ours[name] for name in theirs} == theirs


def test_another_trl_with_the_same_protocol_is_used_with_a_warning(monkeypatch, caplog):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.17.0" if name == "trl" else real(name))
    with caplog.at_level("WARNING", logger=integration.__name__):
        assert check_trl() == "1.17.0"
    assert f"tested with trl=={TESTED_TRL}" in caplog.text


def test_a_trl_whose_protocol_differs_is_refused(monkeypatch):
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module

    class StepProtocol(Protocol):  # a future TRL passing the step to send_weights
        def init_weight_transfer(self) -> None: ...
        def pause(self) -> None: ...
        def send_weights(self, iterator, step) -> None: ...  # noqa: ANN001
        def resume(self) -> None: ...
        def destroy(self) -> None: ...

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.0.0" if name == "trl" else real(name))
    monkeypatch.setattr(trainer_module, "WeightTransferProtocol", StepProtocol)
    with pytest.raises(MissingDependencyError, match=r"trl 2.0.0's WeightTransferProtocol .*'send_weights': "
                                                     r"\['iterator', 'step'\].*pip install 'deltasync\[trl\]' "
                                                     r"\(trl==1.16.0\)"):
        DeltasyncWeightTransfer("stream", SERVER)


def test_no_trl_is_a_missing_dependency(monkeypatch):
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "trl":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(MissingDependencyError, match=r"needs TRL, which is not installed: pip install"):
        check_trl()


def test_importing_rollout_loader_imports_no_trl():
    code = ("import sys, rollout_loader, rollout_loader.vllm, rollout_loader.integrations\n"
            "print(sorted(m for m in ('trl', 'transformers', 'vllm') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"url": ""}, "url must be the stream's URL"),
    ({"url": 7}, "url must be the stream's URL"),
    ({"server": "127.0.0.1:8000"}, r"server must be the vLLM server's URL \(http://host:port"),
    ({"server": "ftp://host:8000"}, "server must be the vLLM server's URL"),
    ({"server": 8000}, "server must be the vLLM server's URL .* or a VllmTarget, got int"),
    ({"storage_options": "key=x"}, "storage_options must be a dict with string keys"),
    ({"storage_options": {1: "x"}}, "storage_options must be a dict with string keys"),
    ({"step_fn": 3}, "step_fn must be a function"),
    ({"timeout_s": 0}, "timeout_s must be seconds > 0"),
    ({"timeout_s": True}, "timeout_s must be seconds > 0"),
    ({"sharded": True}, "sharded=True cannot apply: TRL hands the full tensors to rank 0"),
    ({"anchor_every": 0}, "publish option anchor_every must be a whole number"),
    ({"dtype": "bf16"}, "publish option dtype must be a torch.dtype"),
])
def test_each_bad_setting_is_a_config_error_naming_it(kwargs, message):
    args = {"url": "stream", "server": SERVER} | kwargs
    with pytest.raises(ConfigError, match=message):
        DeltasyncWeightTransfer(args.pop("url"), args.pop("server"), **args)


def test_an_unknown_publisher_option_is_a_type_error():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['anchor_evry'\]"):
        DeltasyncWeightTransfer("stream", SERVER, anchor_evry=5)


def test_trusted_keys_need_a_signing_key_and_go_to_a_given_target(tmp_path):
    _, public = keygen(tmp_path / "trainer.key")
    with pytest.raises(ConfigError, match="trusted_keys makes the server apply signed steps only, and no "
                                          "signing_key= signs them"):
        DeltasyncWeightTransfer("stream", SERVER, trusted_keys=[public])
    with pytest.raises(ConfigError, match="trusted_keys goes to the VllmTarget given as server"):
        DeltasyncWeightTransfer("stream", VllmTarget(SERVER), trusted_keys=[public])
    _, other = keygen(tmp_path / "other.key")
    with pytest.raises(ConfigError, match="none of trusted_keys is the public half of signing_key"):
        DeltasyncWeightTransfer("stream", SERVER, trusted_keys=[other], signing_key=tmp_path / "trainer.key")
    signed = DeltasyncWeightTransfer("stream", SERVER, trusted_keys=[public], signing_key=tmp_path / "trainer.key")
    # the server's trust is the publisher's (its key, pinned to its stream), given when the stream is opened
    assert signed.target.settings.trusted_keys is None


def test_construction_touches_nothing(tmp_path):
    """TRL builds no weight transfer on ranks other than 0, but the user's script builds this one on every rank:
    making it contacts no server and writes no stream."""
    transfer = DeltasyncWeightTransfer(str(tmp_path / "stream"), closed_port_url())
    assert transfer.publisher is None and transfer.steps == [] and list(tmp_path.iterdir()) == []
    transfer.pause(), transfer.resume(), transfer.destroy()  # no-ops before anything was opened


def test_a_sync_that_cannot_reach_the_server_reads_every_tensor_and_publishes_nothing(tmp_path):
    """On FSDP2 each tensor TRL hands over is a collective the other ranks are in: a failing sync still reads
    them all, then raises."""
    transfer = DeltasyncWeightTransfer(str(tmp_path / "stream"), closed_port_url())
    read: list[str] = []

    def tensors():
        for name in ("a", "b", "c"):
            read.append(name)
            yield name, torch.zeros(4)

    with pytest.raises(EngineUnreachableError, match="cannot connect to the vLLM server"):
        transfer.send_weights(tensors())
    assert read == ["a", "b", "c"]
    assert transfer.publisher is None and not (tmp_path / "stream").exists()
