"""The engine's host-memory budget (rollout_loader/vllm/plan.py: ``max_host_bytes``), without an engine: what the
refusal says for an FP8 engine fed the checkpoint's tensors and for other shadowed layers. The refusal inside a real
FP8 engine, before anything is read, is tests/integration/test_vllm_fp8.py."""

from __future__ import annotations

import logging

import pytest

from deltasync.errors import ConfigError
from rollout_loader.vllm.plan import _check_host_bytes

FEEDS = {"model.layers.0.mlp.experts": ("model.layers.0.mlp.experts.0.up_proj.weight",)}
WHY = {"model.layers.0.mlp.experts.w13_weight": "its bits are a permutation or transform of the checkpoint's"}


def test_host_copies_are_stated_and_refused_above_the_budget(caplog):
    with caplog.at_level(logging.INFO, logger="rollout_loader.vllm.plan"):
        _check_host_bytes(3 << 30, None, ["a", "b"], FEEDS, WHY, fp8=False)
        _check_host_bytes(3 << 30, 3 << 30, ["a", "b"], FEEDS, WHY, fp8=False)
    assert "host copies of 2 checkpoint tensor(s) for 1 module(s)" in caplog.text and "3.000 GiB" in caplog.text
    with pytest.raises(ConfigError) as e:
        _check_host_bytes(3 << 30, 1 << 30, ["a", "b"], FEEDS, WHY, fp8=False)
    text = str(e.value)
    assert "deltasync engine setting max_host_bytes: this engine would keep host copies of 2 checkpoint tensor(s) " \
           "(3221225472 bytes, 3.000 GiB) for 1 module(s)" in text
    assert "['model.layers.0.mlp.experts']: its bits are a permutation" in text
    assert "above the budget of 1073741824 bytes (1.000 GiB)" in text and "keep CPU linear weights live" in text
    with pytest.raises(ConfigError, match="This is an FP8 engine fed the checkpoint's tensors.*representation='fp8'"):
        _check_host_bytes(3 << 30, 0, ["a", "b"], FEEDS, WHY, fp8=True)
