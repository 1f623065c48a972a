"""bench/bench_gpu.py on CPU tensors with a tiny shape: it runs, every step is bit-exact, and a wrong bit is caught.
Correctness only, never timings (the figures come from a GPU run: bench/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_runs_on_cpu_and_is_bit_exact(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")  # the Triton scatter too, where installed
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--device", "cpu", "--shape", "tiny",
                        "--steps", "1", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "every step bit-exact" in r.stdout and "pause / full reload" in r.stdout
    (out,) = tmp_path.glob("gpu-tiny-*.json")
    report = json.loads(out.read_text())
    (res,) = report["results"]
    assert report["ok"] and res["exact"] and all(row["exact"] and row["changed"] > 0 for row in res["rows"])
    has_triton = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0
    assert ("scatter_triton_s" in res["medians"]) == has_triton


def test_gpu_bench_catches_a_wrong_bit():
    sys.path.insert(0, str(ROOT))
    from bench.bench_gpu import mismatches

    masters = {"w": torch.randn(100), "b": torch.randn(3)}
    engine = {n: t.bfloat16() for n, t in masters.items()}
    assert mismatches(engine, masters) == []
    engine["w"].view(torch.int16)[17] ^= 1
    assert mismatches(engine, masters) == ["w"]
