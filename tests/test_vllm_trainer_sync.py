"""What every framework seam does on the trainer's side (rollout_loader/vllm/trainer_sync.py), as far as a server's
replies decide it: the dtype every step is published in comes from the server's ``/server_info`` when the publish
options name none, and that reply is input like any other. The server is the loopback stub of
tests/test_vllm_client.py answering as vLLM 0.32 does (tests/integration/test_trl_async.py runs a real one)."""

from __future__ import annotations

import pytest
import torch

from deltasync import PublishOptions, StreamReader
from deltasync.errors import ConfigError
from rollout_loader.vllm import VllmTarget
from rollout_loader.vllm.trainer_sync import TrainerSync
from tests.test_vllm_client import fake_server


def _server_info(dtype: object) -> tuple[int, dict]:
    return 200, {"vllm_config": {"model_config": {"dtype": dtype}}}


def test_steps_are_published_in_the_dtype_the_server_serves(tmp_path):
    url = str(tmp_path / "stream")
    with fake_server() as (fake, base):
        fake.replies["/server_info"] = _server_info("torch.float16")
        sync = TrainerSync(url, target=VllmTarget(base))
        try:
            assert sync.send([("w", torch.ones(4, dtype=torch.float32))]) == 0
        finally:
            sync.close()
    with StreamReader(url) as reader:
        assert reader.state_dict(0)["w"].dtype == torch.float16


@pytest.mark.parametrize("dtype", ["torch.int8", "bool", "torch.float64", "torch.complex64", "torch.Tensor", "finfo",
                                   "torch.float8_e4m3fn"])
def test_a_server_that_names_a_dtype_no_vllm_serves_is_refused_before_anything_is_written(dtype, tmp_path):
    """A wrong or hostile server's ``/server_info`` would otherwise decide that every step is cast to int8 or bool:
    the trainer's weights destroyed in a stream every other follower applies. Naming the dtype still works."""
    url = tmp_path / "stream"
    with fake_server() as (fake, base):
        fake.replies["/server_info"] = _server_info(dtype)
        with pytest.raises(ConfigError, match=f"says it serves dtype '{dtype}', not one of"):
            TrainerSync(str(url), target=VllmTarget(base)).open()
        assert not url.exists()
        sync = TrainerSync(str(url), target=VllmTarget(base), options=PublishOptions(dtype=torch.bfloat16),
                           served_dtype=False)
        try:
            assert sync.send([("w", torch.ones(4))]) == 0
        finally:
            sync.close()


def test_the_trainers_credentials_sent_to_the_engines_are_warned_about(tmp_path, caplog):
    """Engines that name no stream of their own read the trainer's, with the trainer's storage options: its
    credentials (which may write) then reach every engine, and the trainer says so. A secret-named option is held
    as a Secret on both sides (deltasync/secrets.py), and is recognised all the same."""
    url = str(tmp_path / "stream")
    options = {"auto_mkdir": True, "token": "trainer-write-token"}  # a folder ignores them; the engine gets them
    with fake_server() as (fake, base), caplog.at_level("WARNING", logger="rollout_loader.vllm.trainer_sync"):
        fake.replies["/server_info"] = _server_info("torch.bfloat16")
        sync = TrainerSync(url, target=VllmTarget(base), storage_options=options)
        try:
            sync.open()
        finally:
            sync.close()
    assert any("get the trainer's storage options" in r.getMessage() for r in caplog.records), caplog.text
