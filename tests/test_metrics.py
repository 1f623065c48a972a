"""The follower's provenance and Prometheus metrics: scraped over HTTP on loopback, parsed by prometheus-client's own
text-format parser; the expected figures come from the stream's folder (object file sizes) and the steps applied."""

from __future__ import annotations

import math
import os
import socket
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("prometheus_client", reason="the metrics endpoint needs prometheus-client (deltasync[metrics])")
from prometheus_client.parser import text_string_to_metric_families

from deltasync import DeltaPublisher
from deltasync.errors import ConfigError, MissingDependencyError
from rollout_loader import Follower, StateDictTarget
from rollout_loader.metrics import FollowerStats, serve


def scrape(url: str) -> dict[str, float]:
    """Every sample of the endpoint, by name (counters as ``NAME_total``), checked to carry the stream label."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("deltasync_follower_") and not sample.name.endswith("_created"):
                assert set(sample.labels) == {"stream"}
                samples[sample.name] = sample.value
    return samples


def publish(url: str, steps: range) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    with DeltaPublisher(url, model, anchor_every=10, on_backlog="block") as pub:
        for step in steps:
            with torch.no_grad():
                model[0].weight[step % 16] += 1.0
            pub.publish(step)


def object_bytes(stream: Path, steps: list[int]) -> int:
    """What the follower fetched, from the folder itself: every object file of those steps."""
    return sum(f.stat().st_size for s in steps for f in (stream / "steps" / f"{s:012d}").iterdir()
               if f.suffix == ".safetensors")


class FlakyTarget(StateDictTarget):
    """A state-dict target whose engine refuses ``bad_step`` once (a retried failure)."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.bad_step = bad_step

    def apply(self, obj) -> None:
        if obj.header.step == self.bad_step:
            self.bad_step = -1
            raise RuntimeError("engine refused (injected)")
        super().apply(obj)


def test_follower_serves_held_newest_lag_bytes_and_errors(tmp_path):
    stream = tmp_path / "stream"
    publish(str(stream), range(3))
    follower = Follower(str(stream), FlakyTarget(bad_step=3), metrics_port=0)
    try:
        url = follower.metrics_server.url
        assert url.startswith("http://127.0.0.1:")
        before = scrape(url)  # nothing applied, nothing listed yet: unknown, not zero
        assert math.isnan(before["deltasync_follower_held_step"]) and math.isnan(before["deltasync_follower_lag_steps"])
        assert before["deltasync_follower_steps_applied_total"] == 0 and before["deltasync_follower_errors_total"] == 0
        assert follower.lag_steps is None

        assert follower.sync() == [0, 1, 2]
        got = scrape(url)
        assert got["deltasync_follower_held_step"] == 2 and got["deltasync_follower_newest_step"] == 2
        assert got["deltasync_follower_lag_steps"] == 0 and follower.lag_steps == 0
        assert got["deltasync_follower_steps_applied_total"] == 3
        assert got["deltasync_follower_applied_bytes_total"] == object_bytes(stream, [0, 1, 2])
        assert got["deltasync_follower_last_apply_seconds"] > 0
        assert math.isnan(got["deltasync_follower_last_pause_seconds"])  # a state dict never pauses generation

        publish(str(stream), range(3, 6))  # the trainer goes on (a new publisher resumes after step 2)
        with pytest.raises(RuntimeError, match="engine refused"):
            follower.sync()  # lists step 5, fails applying step 3: the target stays at step 2
        got = scrape(url)
        assert got["deltasync_follower_held_step"] == 2 and got["deltasync_follower_newest_step"] == 5
        assert got["deltasync_follower_lag_steps"] == 3 and follower.lag_steps == 3 and follower.newest_step == 5
        assert got["deltasync_follower_errors_total"] == 1

        applied = follower.sync()  # retried from the nearest anchor (step 0) after the failure
        got = scrape(url)
        assert applied[-1] == 5
        assert got["deltasync_follower_held_step"] == 5 and got["deltasync_follower_lag_steps"] == 0
        assert got["deltasync_follower_steps_applied_total"] == 3 + len(applied)
        assert got["deltasync_follower_applied_bytes_total"] == object_bytes(stream, [0, 1, 2, *applied])
        status = follower.status()
        assert (status.held_step, status.newest_step, status.errors) == (5, 5, 1)
    finally:
        follower.close()
    with pytest.raises(OSError):  # closing the follower freed the port
        urllib.request.urlopen(url, timeout=5)


def test_a_port_in_use_is_a_config_error_and_leaves_nothing(tmp_path):
    publish(str(tmp_path / "stream"), range(1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics endpoint: cannot listen on 127.0.0.1:{port}"):
            Follower(str(tmp_path / "stream"), StateDictTarget(), metrics_port=port)


def test_serve_takes_any_status_source_and_several_run_at_once():
    """Each endpoint has a registry of its own: two followers in one process each serve their own figures."""
    a, b = FollowerStats("file:///a"), FollowerStats("s3://b/run")
    a.applied(4, nbytes=100, apply_s=0.5, pause_s=0.25)
    b.saw_newest(9)
    b.applied(7, nbytes=10, apply_s=0.1)
    b.failed()

    class Source:
        def __init__(self, stats: FollowerStats, held: int) -> None:
            self.stats, self.held = stats, held

        def status(self):
            return self.stats.status(self.held)

    with serve(Source(a, 4), 0) as sa, serve(Source(b, 7), 0) as sb:
        assert sa.port != sb.port
        ga, gb = scrape(sa.url), scrape(sb.url)
    p = "deltasync_follower_"
    assert (ga[p + "held_step"], ga[p + "lag_steps"], ga[p + "last_pause_seconds"]) == (4, 0, 0.25)
    assert (gb[p + "newest_step"], gb[p + "lag_steps"], gb[p + "errors_total"]) == (9, 2, 1)
    assert gb["deltasync_follower_applied_bytes_total"] == 10


def test_without_prometheus_client_the_error_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name.startswith("prometheus_client"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    with pytest.raises(MissingDependencyError, match=r"pip install 'deltasync\[metrics\]'"):
        serve(FollowerStats("x"), 0)


def test_follow_command_prints_the_lag_and_serves_metrics(tmp_path):
    """``deltasync follow URL --server S --metrics-port 0``: each step's line says how far it is behind the newest
    committed step; the endpoint is announced, and gone once the command ends. The server is a loopback stub
    that accepts vLLM's weight-transfer routes (the real server: tests/integration/test_vllm_engine.py)."""
    import subprocess
    import sys

    from tests.test_vllm_client import fake_server

    publish(str(tmp_path / "stream"), range(3))
    with fake_server() as (_, url):
        proc = subprocess.run([sys.executable, "-m", "deltasync_cli", "follow", str(tmp_path / "stream"), "--server",
                               url, "--until", "2", "--metrics-port", "0", "--timeout-s", "60"],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "COLUMNS": "400"})  # one line per step, unwrapped
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("metrics at http://127.0.0.1:") and lines[0].endswith("/metrics")
    steps = [line for line in lines if line.startswith("step ")]
    assert steps[0].startswith("step 0 live in ") and steps[0].endswith(", 2 steps behind step 2")
    assert steps[1].endswith(", 1 step behind step 2")
    assert steps[-1].startswith("step 2 live in ") and steps[-1].endswith("checksums match), the newest committed step")
    with pytest.raises(OSError):
        urllib.request.urlopen(lines[0].removeprefix("metrics at "), timeout=5)
