"""Leave nothing behind: publishers, readers, followers and CLI commands remove their temporary folders
on close, on error, when dropped, at interpreter exit and on Ctrl-C (issue 8, "Long runs must not fill
the disk"). ``tests/conftest.py`` checks every other test the same way."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltasync import DeltaPublisher
from deltasync.errors import PublishError, WriterConflictError
from deltasync.store.scratch import ScratchFolder
from deltasync_cli import app
from tests.conftest import LEAK_PREFIX, leftovers
from tests.http_server import serving
from tests.remote_cli import register, remote_url
from tests.test_publisher import train

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def ours(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(LEAK_PREFIX))


# --- publishers ---


def test_a_closed_publisher_removes_its_spool(tmp_path, small_state, gen):
    before = leftovers()
    pub = DeltaPublisher(str(tmp_path / "s"), small_state, on_backlog="block")
    for s in range(3):
        train(small_state, gen)
        pub.publish(s)
    pub.flush()
    assert any(n.startswith("deltasync-spool-") for n in leftovers() - before)
    pub.close()
    assert leftovers() == before


def test_a_publisher_closed_after_losing_its_stream_removes_its_spool(tmp_path, small_state, gen):
    url = str(tmp_path / "s")
    before = leftovers()
    pub = DeltaPublisher(url, small_state, on_backlog="block")
    pub.publish(0)
    pub.flush()
    thief = DeltaPublisher(url, small_state, take_over=True)
    train(small_state, gen)
    pub.publish(1)
    with pytest.raises(PublishError, match="lost the stream"):
        pub.close()
    thief.close()
    assert leftovers() == before


def test_a_publisher_refused_at_start_leaves_nothing(tmp_path, small_state):
    url = str(tmp_path / "s")
    with DeltaPublisher(url, small_state):
        before = leftovers()
        with pytest.raises(WriterConflictError):
            DeltaPublisher(url, small_state)
        assert leftovers() == before


# --- the interpreter-exit safety net ---

FORGETFUL = textwrap.dedent(
    """
    import os, tempfile, torch
    from deltasync import DeltaPublisher, StreamReader
    from rollout_loader import Follower, PollPolicy, StateDictTarget

    url = "memory://forgotten"
    pub = DeltaPublisher(url, {"w": torch.randn(64, 64)}, on_backlog="block")
    pub.publish(0)
    pub.flush()
    reader = StreamReader(url)
    obj = reader.open(0)
    follower = Follower(url, StateDictTarget(), policy=PollPolicy(fast_s=0.01)).start()
    follower.wait_for(0, timeout_s=30)
    kept = [pub, reader, obj, follower]  # none closed: the process just ends
    print(sorted(n for n in os.listdir(tempfile.gettempdir()) if n.startswith("deltasync-")))
    """
)


def test_objects_never_closed_are_cleaned_at_exit(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-c", FORGETFUL], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    during = eval(r.stdout.strip().splitlines()[-1])
    assert len([n for n in during if n.startswith("deltasync-cache-")]) == 2
    assert any(n.startswith("deltasync-spool-") for n in during)
    assert ours(tmp) == []


# --- a process killed outright (SIGKILL, the OOM killer) ---

SPOOL_THEN_WAIT = textwrap.dedent(
    """
    import sys, torch
    from deltasync import DeltaPublisher

    pub = DeltaPublisher(sys.argv[1], {"w": torch.randn(64, 64)}, on_backlog="block")
    pub.publish(0)
    pub.flush()
    print(pub._spool.name, flush=True)
    sys.stdin.read()  # until the test kills it, or closes stdin
    """
)


def test_folders_of_killed_processes_are_reclaimed_by_the_next_one(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    procs = [subprocess.Popen([sys.executable, "-c", SPOOL_THEN_WAIT, str(tmp_path / f"s{i}")], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(2)]
    try:
        dead, alive = (p.stdout.readline().strip() for p in procs)
        assert dead.startswith("deltasync-spool-") and alive.startswith("deltasync-spool-")
        procs[0].kill()  # SIGKILL: no cleanup runs
        procs[0].wait()
        old = time.time() - 3600
        for name in (dead, alive):
            os.utime(tmp / name, (old, old))  # both look abandoned by age; only the lock tells them apart
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        spool = ScratchFolder("spool")  # the next process to make a spool folder
        mine = spool.path.name
        assert ours(tmp) == sorted([alive, mine])  # the dead one's folder was removed, the live one's kept
        spool.remove()
        procs[1].stdin.close()  # the live one ends normally
        assert procs[1].wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert ours(tmp) == []  # and cleaned up after itself


# --- CLI commands on a remote store ---


@pytest.fixture
def remote_stream(qwen_stream):
    register()
    return remote_url(qwen_stream.url)


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "{url}"],
        ["show", "{url}", "5"],
        ["replay", "{url}", "--step", "6", "-o", "{out}"],
        ["verify", "{url}"],
        ["compare", "{url}", "1", "6"],
        ["stats", "{url}", "--plot", "{out}.png"],
    ],
    ids=lambda a: a[0],
)
def test_cli_commands_on_a_remote_store_leave_nothing(args, remote_stream, tmp_path):
    if "--plot" in args:
        pytest.importorskip("matplotlib")
    before = leftovers()
    r = runner.invoke(app, [a.format(url=remote_stream, out=tmp_path / "out") for a in args])
    assert r.exit_code == 0, r.output
    assert leftovers() == before  # closed by the command, not left to the garbage collector


def test_push_on_a_remote_store_leaves_nothing(stream_copy, qwen_stream):
    register()
    before = leftovers()
    r = runner.invoke(app, ["push", remote_url(stream_copy), str(qwen_stream.model_dir), "--step", "10"])
    assert r.exit_code == 0, r.output
    assert "as step 10 (delta on step 9)" in r.output
    assert leftovers() == before


# --- Ctrl-C ---


def interruptible() -> None:
    """In the child, before the command starts: Ctrl-C as a terminal delivers it. A test run started in the
    background of a non-interactive shell inherits SIGINT ignored (bash ignores it for asynchronous commands), and
    Python then keeps it ignored in every child: these tests would test the shell, not the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def interrupt_after_first_download(args: list[str], tmp_path: Path, pause_s: float = 3.0,
                                   sig: int = signal.SIGINT) -> tuple[int, str, list[str], list[str]]:
    """Run ``deltasync ARGS`` in a subprocess with a private TMPDIR, send ``sig`` once it downloaded its first
    object (the download thread then pauses ``pause_s``); returns (exit code, output, TMPDIR then, TMPDIR at the
    end)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = tmp_path / "downloaded"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.remote_cli", str(marker), str(pause_s), *args],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=interruptible,
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"deltasync {args[0]} exited before its first download: {proc.stdout.read()}")
            assert time.monotonic() < deadline, "no download within 90s"
            time.sleep(0.01)
        during = ours(tmp)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, during, ours(tmp)


@pytest.mark.parametrize(
    "args", [["show", "{url}", "8"], ["verify", "{url}"], ["replay", "{url}", "--step", "9", "-o", "{out}"]],
    ids=lambda a: a[0],
)
def test_ctrl_c_leaves_nothing(args, qwen_stream, tmp_path):
    out = tmp_path / "out"
    code, output, during, after = interrupt_after_first_download(
        [a.format(url=remote_url(qwen_stream.url), out=out) for a in args], tmp_path
    )
    assert any(n.startswith("deltasync-cache-") for n in during), during  # the interrupt hit a live download cache
    assert code == 130 and "Traceback" not in output, output  # interrupted (128 + SIGINT), not finished
    assert after == [], output
    assert not out.exists()


def test_kill_leaves_nothing_either(qwen_stream, tmp_path):
    """SIGTERM (``kill``, a scheduler, ``docker stop``) cleans up as Ctrl-C does: it left the download cache."""
    out = tmp_path / "out"
    args = ["replay", remote_url(qwen_stream.url), "--step", "9", "-o", str(out)]
    code, output, during, after = interrupt_after_first_download(args, tmp_path, sig=signal.SIGTERM)
    assert any(n.startswith("deltasync-cache-") for n in during), during
    assert code == 143 and "Traceback" not in output, output  # 128 + SIGTERM, as a shell reports a kill
    assert after == [], output
    assert not out.exists()


@pytest.fixture
def busy_server():
    """An HTTP server that passes ``follow``'s set-up (a vLLM server with the deltasync weight-transfer engine
    that holds no step yet) and answers every update with 503: the follower fails to apply, and retries."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            route = self.path.split("?", 1)[0]
            if route == "/weight_info":
                reply, status = json.dumps({"weight_version": "default"}).encode(), 200
            elif route in ("/init_weight_transfer_engine", "/pause", "/resume", "/reset_prefix_cache"):
                reply, status = b"{}", 200
            else:
                reply, status = b"busy", 503
            self.send_response(status)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_GET = do_POST = _reply

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_follow_and_leaves_nothing(qwen_stream, tmp_path, busy_server, sig):
    """``follow`` reads only manifests here (the server's engine fetches the objects): Ctrl-C (or a kill) while it
    retries a server that refuses every update ends it at once, with no traceback and nothing left in TMPDIR, and
    with 130 (143): ``deltasync follow ... --until 9 && start_eval`` must not go on (it exited 0)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltasync_cli", "follow", qwen_stream.url, "--server", busy_server,
         "--poll-s", "0.05", "--until", "9"],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=interruptible,
    )
    lines: list[str] = []
    reading = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reading.start()
    try:
        deadline = time.monotonic() + 120  # started (imports take long on a busy machine), connected, failing
        while not any("retrying" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        reading.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines)
    assert "retrying" in output and "HTTP 503" in output, output
    assert proc.returncode == 128 + sig, output
    assert "Traceback" not in output, output
    assert ours(tmp) == [], output
