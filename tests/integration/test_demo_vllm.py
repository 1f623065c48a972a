"""The README's main job as it runs: a real vLLM engine follows the trainer, every step verified."""

import pytest

from deltasync_cli.demo import DemoConfig, run_demo

pytestmark = pytest.mark.vllm


def test_demo_with_vllm_engine_is_bit_exact(tmp_path):
    lines = []
    rows = run_demo(str(tmp_path / "s"), DemoConfig(steps=5, anchor_every=3, hidden_size=128, layers=2), echo=lines.append)
    assert [r["kind"] for r in rows] == ["anchor", "delta", "delta", "anchor", "delta"]
    assert all(r["exact"] and r["engine_paused_ms"] is not None for r in rows)
    assert lines[-1] == "BIT-EXACT: every step verified"
    assert "vLLM engine weights at step 4" in lines[-2]
