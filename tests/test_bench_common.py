"""bench/_common.py: a benchmark stopped by SIGTERM (``kill``, ``timeout``) cleans up as on Ctrl-C. Its default
ended the process at once, with no ``finally`` and no ``atexit``: bench_codec's work folder stayed in the temp
folder (reproduced with ``timeout``). Correctness only, never timings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_benchmark_stopped_by_sigterm_leaves_no_work_folder(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    cmd = [sys.executable, str(ROOT / "bench" / "bench_codec.py"), "--hidden", "64", "--layers", "1", "--vocab", "512",
           "--steps", "1000000", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("deltasync-bench-*")):  # its work folder exists: it is mid-run
            assert proc.poll() is None and time.monotonic() < deadline, "the benchmark ended before its work folder"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out[-2000:]  # unwound, as on Ctrl-C
    assert not list(tmp_path.glob("deltasync-bench-*")), out[-2000:]


def test_the_handler_is_set_only_where_nothing_chose_one():
    code = ("import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); import bench._common;"
            "print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=300, check=True)
    assert r.stdout.strip() == "True"
    code = "import signal, bench._common; print(signal.getsignal(signal.SIGTERM) is signal.default_int_handler)"
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=300, check=True)
    assert r.stdout.strip() == "True"
