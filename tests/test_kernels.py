"""``warm_kernels()``: after it, nothing a publisher, a replica or an engine does compiles (or loads) a kernel.

A kernel's first call with a new signature costs a compilation (seconds) or a disk-cache load (milliseconds);
inside an engine's pause either is too much. The check: every numba dispatcher's signatures after
``warm_kernels()`` are all the signatures the whole pipeline then uses, on every dtype width, sparse and
dense, compressed and raw, host chunks, slices, verified both ways.
"""

from __future__ import annotations

import io

import numpy as np
import torch

from deltasync.format import _kernels
from deltasync.format.checksum import checksum_elements
from deltasync.format.objects import StepObject
from deltasync.publish.steps import snapshot_headers, write_step_object
from deltasync.stages.apply import Replica, apply_staged, xor_apply
from deltasync.stages.diff import Snapshot, _diff_host_chunks, _Scratch
from deltasync.stages.staging import layout_of, stage

DTYPES = [torch.uint8, torch.bool, torch.int8, torch.bfloat16, torch.float16, torch.int16, torch.float32,
          torch.int32, torch.float64, torch.int64]


def signatures() -> dict[str, list]:
    return {name: list(d.signatures) for name, d in _kernels.dispatchers().items()}


def _state(rng: np.random.Generator, n: int) -> dict[str, torch.Tensor]:
    out = {}
    for dtype in DTYPES:
        width = torch.empty(0, dtype=dtype).element_size()
        for shape in ((n,), (3, 7), (1,), (0,)):
            numel = int(np.prod(shape))
            raw = rng.integers(0, 2 if dtype == torch.bool else 256, numel * width, dtype=np.uint8)
            out[f"{dtype}.{shape}"] = (torch.from_numpy(raw).view(dtype).reshape(shape) if numel
                                       else torch.empty(shape, dtype=dtype))
    return out


def _changed(state: dict[str, torch.Tensor], rng: np.random.Generator, fraction: float) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        new = t.clone()
        bits = new.reshape(-1).view(torch.uint8)
        if bits.numel():
            hit = torch.from_numpy(rng.random(bits.numel()) < fraction)
            bits[hit] ^= 1  # low bit of some byte: a change of the element (bool stays 0/1)
        out[name] = new
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _exercise(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], tmp_path) -> None:
    """Everything a publisher, a replica, replay and a vLLM worker do with one step, checked bit for bit."""
    for device in ("same", "cpu"):  # a slice of a larger tensor (a rank's shard) hashes from its offset
        sharded = Snapshot(old, device=device, offsets=dict.fromkeys(old, 11))
        sharded.diff(new)
    snap = Snapshot(old)
    headers = snapshot_headers(snap)
    changes = [c for c in snap.diff(new) if c.changed]
    for level in (1, 3):
        buf = io.BytesIO()
        write_step_object(buf, kind="delta", step=1, base_step=0, headers=snapshot_headers(snap), changes=changes,
                          zstd_level=level)
        for source in (buf.getvalue(), bytearray(buf.getvalue())):  # immutable and writable buffers
            staged = stage(StepObject(source, where="warm test"), layout_of(old), base_step=0)
            for verify in ("incremental", "full"):
                target = {k: t.clone() for k, t in old.items()}
                sums = {k: int(h.checksum, 16) for k, h in headers.items()}
                apply_staged(staged, target, checksums=sums if verify == "incremental" else None)
                assert all(_same_bits(target[k], t) for k, t in new.items())
    path = tmp_path / "step.safetensors"
    with open(path, "wb") as f:
        write_step_object(f, kind="delta", step=1, base_step=0, headers=snapshot_headers(snap), changes=changes)
    with StepObject(path, where="warm test") as obj:
        for verify in ("incremental", "full"):
            rep = Replica.from_tensors({k: t.clone() for k, t in old.items()}, step=0)
            rep.apply(obj, verify=verify)
            assert all(_same_bits(rep.tensors[k], t) for k, t in new.items())
    for c in changes:  # the calls a vLLM worker and replay make, NumPy and torch inputs
        t = old[c.name].clone()
        xor_apply(t, c.positions, c.xor, index=3)
        xor_apply(t, torch.from_numpy(c.positions), torch.from_numpy(c.xor.view(f"i{c.xor.itemsize}")),
                  index=torch.from_numpy(c.positions + 3))
        xor_apply(t, c.positions, c.xor, checksum=False)
        xor_apply(t, None, np.zeros(t.numel(), c.xor.dtype), index=2)
        checksum_elements(t, torch.arange(t.numel()))
        signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        snap_bits = old[c.name].clone().reshape(-1).view(torch.uint8).numpy().view(c.xor.dtype)
        _diff_host_chunks(t.reshape(-1).view(torch.uint8).view(signed), snap_bits, 13, _Scratch())


def test_after_warm_kernels_nothing_compiles(tmp_path):
    _kernels.warm_kernels()
    before = signatures()
    assert all(before.values()), [n for n, s in before.items() if not s]  # every kernel has been loaded
    rng = np.random.default_rng(0)
    for n, fraction in ((5000, 0.02), (5000, 0.6), (300, 0.0), (40000, 0.01)):
        old = _state(rng, n)
        _exercise(old, _changed(old, rng, fraction), tmp_path)
    after = signatures()
    grown = {n: [s for s in after[n] if s not in before[n]] for n in after}
    assert not any(grown.values()), f"compiled after warm_kernels(): { {n: s for n, s in grown.items() if s} }"


# --- the byte-shuffle and gap16 kernels against NumPy references written from FORMAT.md ---


def test_span_is_numpys_min_and_max():
    """The one-pass bounds of a patch's positions against NumPy's two passes, on any layout and sign."""
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 1000, 70001):
        a = rng.integers(-(1 << 62), 1 << 62, n, dtype=np.int64)
        frozen = a.copy()
        frozen.flags.writeable = False
        for x in (a, frozen, a[::2], np.sort(a), np.sort(a)[::-1]):
            assert _kernels.span(x) == (int(x.min()), int(x.max()))


def test_a_long_first_use_says_it_compiles_and_a_slow_load_says_nothing(monkeypatch, caplog):
    """The first use compiles for up to a minute: after two seconds the log says what is happening and where the
    cache goes. A load from the cache that is merely slow (a busy machine) says nothing. (The real compile is what
    ./run.sh setup and `deltasync warm` run; this checks the message, with the wait stood in for.)"""
    import time
    from collections import Counter
    from types import SimpleNamespace

    monkeypatch.setattr(_kernels, "SAY_AFTER_S", 0.05)
    monkeypatch.setattr(_kernels, "_warm_width", lambda t: time.sleep(0.1))
    monkeypatch.setattr(_kernels, "_warm_common", lambda: None)
    # the last: `deltasync warm` says what it does itself; it must not tell the user to run `deltasync warm`
    for misses, explain, said in ((Counter({"sig": 1}), True, True), (Counter(), True, False),
                                  (Counter({"sig": 1}), False, False)):
        monkeypatch.setattr(_kernels, "_warmed", set())
        monkeypatch.setattr(_kernels, "dispatchers",
                            lambda m=misses: {"k": SimpleNamespace(stats=SimpleNamespace(cache_misses=m))})
        caplog.clear()
        _kernels.warm_kernels(explain=explain)
        messages = [r.getMessage() for r in caplog.records if "compiling its CPU kernels" in r.getMessage()]
        assert bool(messages) == said, messages
        if said:
            assert _kernels.kernel_cache_dir() in messages[0] and "deltasync warm" in messages[0]
    _kernels.warm_kernels()  # once done, it returns at once


def test_warming_for_some_widths_loads_only_those_and_each_once(monkeypatch):
    """A bf16 model's replica or engine loads the 2-byte kernels only (a first use compiles a quarter of
    them); a later call for more widths loads just the missing ones; the widthless kernels load once."""
    calls: list[int] = []
    reported: list[int] = []
    monkeypatch.setattr(_kernels, "_warmed", set())
    monkeypatch.setattr(_kernels, "_warm_width", lambda t: calls.append(np.dtype(t).itemsize))
    monkeypatch.setattr(_kernels, "_warm_common", lambda: calls.append(0))
    _kernels.warm_kernels({2}, on_width=lambda width, seconds: reported.append(width))
    _kernels.warm_kernels({2})
    _kernels.warm_kernels(on_width=lambda width, seconds: reported.append(width))
    _kernels.warm_kernels({4, 8})
    assert calls == reported == [2, 0, 1, 4, 8]  # (0: the kernels of no width, once)


# --- the kernel cache survives a reinstall (issue 31, item 2) ---

COMPILE_ONE = """
import json, numpy as np
from deltasync.format import _kernels, _kernel_cache
_kernels.checksum_at(np.zeros(8, np.uint8), np.arange(8))
stats = _kernels.checksum_at.stats
print(json.dumps({"compiled": sum(stats.cache_misses.values()), "loaded": sum(stats.cache_hits.values()),
                  "dir": _kernels.kernel_cache_dir(), "state": _kernel_cache.cache_state()}))
"""


def test_the_kernel_cache_survives_a_reinstall_and_never_serves_a_changed_kernel(tmp_path):
    """``pip install './deltasync[EXTRA]'`` reinstalls the package: every file is written anew (new times) and the
    package's own ``__pycache__`` is gone. The kernels compiled before are loaded, not compiled again: the cache is
    a user cache folder keyed by the kernels' source. A kernel whose source changed compiles afresh. (One small
    kernel, in a fresh interpreter each time; the README's install lines are run for real with a reinstall in
    tests/test_install.py.)"""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    site, cache = tmp_path / "site", tmp_path / "cache"

    def install() -> None:  # as pip does: the files written anew, nothing of the old copy kept
        shutil.rmtree(site, ignore_errors=True)
        shutil.copytree(root / "deltasync", site / "deltasync", copy_function=shutil.copyfile,
                        ignore=shutil.ignore_patterns("__pycache__"))

    def run() -> dict:
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
        env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(cache))
        r = subprocess.run([sys.executable, "-c", COMPILE_ONE], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    install()
    first = run()
    assert first["compiled"] == 1 and first["loaded"] == 0, first
    assert first["dir"].startswith(str(cache / "deltasync" / "kernels")), first  # a user cache, not the package
    assert first["state"]["cached_kernels"] >= 1 and first["state"]["writable"], first
    install()  # the same version again
    again = run()
    assert again["compiled"] == 0 and again["loaded"] == 1, again
    assert again["dir"] == first["dir"]
    kernels = site / "deltasync" / "format" / "_kernels.py"
    kernels.write_text(kernels.read_text() + "\n# a change to the kernels' source\n")
    changed = run()
    assert changed["compiled"] == 1 and changed["dir"] != first["dir"], changed  # never the old code
    assert not list((site / "deltasync" / "format").glob("__pycache__/*.nb*"))  # nothing beside the package
