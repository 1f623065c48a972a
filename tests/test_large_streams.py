"""Readers stay bounded in memory on a legitimate large stream (issue 19, item 6): 256 ranks x 500 steps of
version-2 manifests (docs/FORMAT.md section 5b), written here from the format, objects left out (these
readers read only manifests).

A manifest of 256 parts parses to about a megabyte of Python objects; a follower that cached every one, or
a garbage collection that held them all at once, would need half a gigabyte. The ceilings below are what
the bounds promise: the reader's manifest cache (``MANIFEST_CACHE_BYTES``, lowered here) plus one manifest
being parsed; a garbage collection, one manifest at a time.
"""

from __future__ import annotations

import gc as python_gc
import hashlib
import json
import tracemalloc
from pathlib import Path

import pytest

from deltasync import StreamReader
from deltasync.history.gc import collect_garbage
from deltasync.store import Store

RANKS = 256
STEPS = 500
ANCHOR_EVERY = 100
TENSORS = [f"model.layers.{i}.mlp.weight" for i in range(4)]
ROWS = 4096  # elements per rank of each tensor
MIB = 1 << 20


def _manifest(step: int) -> dict:
    kind = "anchor" if step % ANCHOR_EVERY == 0 else "delta"
    parts = []
    for r in range(RANKS):
        sha = hashlib.sha256(b"%d-%d" % (step, r)).hexdigest()
        parts.append({"object": f"{kind}-r{r:05d}-{sha[:16]}.safetensors", "object_bytes": 1000 + r,
                      "object_sha256": sha, "tensors": {n: [r * ROWS, (r + 1) * ROWS] for n in TENSORS}})
    return {"format_version": 2, "step": step, "base_step": None if kind == "anchor" else step - 1, "kind": kind,
            "object_bytes": sum(p["object_bytes"] for p in parts), "state_checksum": "0" * 64,
            "created_unix_s": 1.7e9 + step, "aliases": {}, "parts": parts, "stats": {}}


@pytest.fixture(scope="module")
def large_stream(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("large") / "stream"
    (root / "steps").mkdir(parents=True)
    (root / "stream.json").write_text(json.dumps({"format_version": 2, "created_unix_s": 1.7e9}))
    for step in range(STEPS):
        folder = root / "steps" / f"{step:012d}"
        folder.mkdir()
        (folder / "manifest.json").write_text(json.dumps(_manifest(step), separators=(",", ":")))
    (root / "latest.json").write_text(json.dumps({"step": STEPS - 1}))
    return root


def _held_mib(fn) -> float:
    """What the value ``fn`` returns holds in memory (traced allocations still alive after the call)."""
    python_gc.collect()
    tracemalloc.start()
    try:
        kept = fn()
        held = tracemalloc.get_traced_memory()[0] / MIB
        del kept
        return held
    finally:
        tracemalloc.stop()


def _peak_mib(fn) -> float:
    python_gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()


def test_a_long_running_reader_keeps_manifests_within_its_byte_bound(large_stream, monkeypatch):
    import deltasync.follow.reader as reader_module

    one = _held_mib(lambda: Store(str(large_stream)).manifest(STEPS - 1))  # what one parsed manifest holds
    monkeypatch.setattr(reader_module, "MANIFEST_CACHE_BYTES", 32 * MIB)
    reader = StreamReader(str(large_stream))

    def follow_every_step() -> None:
        for step in range(STEPS):  # what a follower reads over a long run, and a chain walk back
            reader.manifest(step)
        reader.chain(STEPS - 1)

    peak = _peak_mib(follow_every_step)
    reader.close()
    assert one > 0.2, one  # the stream is as heavy as meant: 500 of these held would be hundreds of MiB
    assert peak < 32 + 3 * one, f"peak {peak:.0f} MiB with a 32 MiB manifest cache (one manifest: {one:.1f} MiB)"


def test_garbage_collection_plans_a_long_stream_one_manifest_at_a_time(large_stream):
    one = _held_mib(lambda: Store(str(large_stream)).manifest(STEPS - 1))
    plans = []
    peak = _peak_mib(lambda: plans.append(collect_garbage(str(large_stream), keep_last=10, dry_run=True)))
    plan = plans[0]
    assert sorted(plan.keep) == list(range(400, 500))  # the last 10 steps and their chain back to anchor 400
    assert len(plan.delete) == 400 and plan.freed_bytes == sum(_manifest(s)["object_bytes"] for s in range(400))
    assert peak < 8 + 3 * one, f"peak {peak:.0f} MiB planning 500 steps (one manifest: {one:.1f} MiB)"
    assert (large_stream / "steps" / f"{0:012d}" / "manifest.json").exists()  # a dry run deletes nothing
