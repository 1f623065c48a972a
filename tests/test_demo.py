"""The README's main job, small: trains, publishes, follows and verifies (a state-dict follower here;
tests/integration/test_demo_vllm.py runs it with the real vLLM engine, as the README does)."""

from deltasync_cli.demo import DemoConfig, run_demo


def test_demo_is_bit_exact(tmp_path):
    lines = []
    rows = run_demo(str(tmp_path / "s"), DemoConfig(steps=6, anchor_every=4, hidden_size=128, layers=2, engine="torch"), echo=lines.append)
    assert [r["kind"] for r in rows] == ["anchor", "delta", "delta", "delta", "anchor", "delta"]
    assert all(r["exact"] for r in rows)
    assert all(0 < r["density"] < 0.2 for r in rows if r["kind"] == "delta")
    assert lines[-1] == "BIT-EXACT: every step verified"
