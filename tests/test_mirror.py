"""Mirroring a stream (deltasync/history/mirror.py, `deltasync mirror`): verified, in commit order, idempotent,
safe to kill at any point and to run twice at once; the copy replays bit-exactly and followers follow it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader, verify
from deltasync.errors import CorruptObjectError, StepExistsError
from deltasync.follow.watch import PollPolicy
from deltasync.history.mirror import mirror, mirror_follow
from deltasync.store import Store, step_dir
from rollout_loader import Follower, StateDictTarget
from tests.conftest import states_equal
from tests.test_cli_errors import assert_one_line_error, run_main

ROOT = Path(__file__).resolve().parents[1]


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(40_000, generator=g).bfloat16(), "b": torch.randn(16, generator=g).bfloat16()}


def _publish(url: str, steps: range, *, anchor_every: int = 4, files: dict | None = None) -> None:
    with DeltaPublisher(url, _state(steps[0]), anchor_every=anchor_every, on_backlog="block", files=files) as pub:
        for s in steps:
            pub.source = _state(s)
            pub.publish(s)


def _same_stream(src: str, dst: str) -> None:
    a, b = StreamReader(src), StreamReader(dst)
    assert b.steps() == a.steps()
    for s in a.steps():
        assert b.manifest(s) == a.manifest(s)
        assert states_equal(b.state_dict(s), a.state_dict(s))
    assert verify(dst).ok


def test_a_mirror_copies_every_step_and_then_only_what_is_new(tmp_path, monkeypatch, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _publish(src, range(6), files={"config.json": b'{"model_type": "x"}'})
    r = mirror(src, dst)
    assert r.copied == (0, 1, 2, 3, 4, 5) and r.present == 0 and r.files_copied and r.bytes_copied > 0
    _same_stream(src, dst)
    assert Store(dst).read_bytes("files/config.json") == b'{"model_type": "x"}'
    assert mirror(src, dst).copied == ()  # nothing new: nothing written
    with DeltaPublisher(src, _state(5), on_backlog="block") as pub:  # the trainer goes on
        for s in (6, 7):
            pub.source = _state(s)
            pub.publish(s)
    code, out, _ = run_main(monkeypatch, capsys, "mirror", src, dst, "--once")
    assert code == 0 and "step 6 copied" in out and "2 step(s) copied" in out and "6 already there" in out
    _same_stream(src, dst)
    # a follower of the copy never touches the source
    target = StateDictTarget()
    Follower(dst, target).sync()
    assert target.step == 7 and states_equal(target.state_dict(), _state(7))


def test_a_source_object_that_does_not_match_is_never_copied(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _publish(src, range(4))
    store = Store(src)
    m = store.manifest(2)
    (Path(src) / step_dir(2) / m.object).write_bytes(b"x" * m.object_bytes)  # damaged at the source
    with pytest.raises(CorruptObjectError, match="step 2 .*digest blake3:.* differs"):
        mirror(src, dst)
    assert StreamReader(dst).steps() == [0, 1]  # everything before it, nothing of it
    assert verify(dst).ok


def test_another_stream_under_the_same_name_is_refused(tmp_path, monkeypatch, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _publish(src, range(3))
    with DeltaPublisher(dst, _state(100), on_backlog="block") as pub:  # another trainer's steps 0..2 there
        for s in range(3):
            pub.source = _state(100 + s)
            pub.publish(s)
    with pytest.raises(StepExistsError, match="holds another stream .* two different streams"):  # by stream.json's id
        mirror(src, dst)
    code, _, err = run_main(monkeypatch, capsys, "mirror", src, dst, "--once")
    assert_one_line_error(code, err, "StepExistsError", "two different streams")
    code, _, err = run_main(monkeypatch, capsys, "mirror", str(tmp_path / "nowhere"), dst, "--once")
    assert_one_line_error(code, err, "StreamNotFoundError")


def test_killed_at_random_moments_the_copy_converges_and_shows_nothing_half_done(tmp_path):
    """Kill a mirror process (SIGKILL: no cleanup) at random moments while it copies, again and again, then let
    one finish: the copy equals the source, and every step committed in between is whole."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _publish(src, range(30), anchor_every=5)
    rng = random.Random(7)
    cmd = [sys.executable, "-m", "deltasync_cli", "mirror", src, dst, "--once"]
    killed_mid_copy = 0
    for _ in range(4):
        before = len(StreamReader(dst).steps()) if (Path(dst) / "stream.json").exists() else 0
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "TMPDIR": str(tmp_path)})
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:  # kill once it has started copying
            if len(list(Path(dst).glob("steps/*/manifest.json"))) > before:
                time.sleep(rng.uniform(0.0, 0.03))
                break
            time.sleep(0.002)
        killed_mid_copy += proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader = StreamReader(dst)
        for s in reader.steps():  # whatever is committed is whole and verified
            with reader.open(s):
                pass
        reader.close()
    assert killed_mid_copy >= 2
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300).returncode == 0
    _same_stream(src, dst)


def test_two_mirrors_at_once_commit_each_step_once(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _publish(src, range(10))
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(mirror(src, dst))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s for r in reports for s in r.copied) == list(range(10))  # each step committed by one of them
    _same_stream(src, dst)


def test_follow_mode_copies_steps_as_they_are_committed(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _publish(src, range(2))
    copied: list[int] = []
    done: list[int | None] = []
    t = threading.Thread(target=lambda: done.append(mirror_follow(
        src, dst, until=5, policy=PollPolicy(fast_s=0.05, idle_max_s=0.2), on_step=lambda s, n: copied.append(s))))
    t.start()
    with DeltaPublisher(src, _state(1), on_backlog="block") as pub:
        for s in range(2, 6):
            time.sleep(0.2)
            pub.source = _state(s)
            pub.publish(s)
    t.join(timeout=60)
    assert done == [5] and copied == [0, 1, 2, 3, 4, 5]
    _same_stream(src, dst)
