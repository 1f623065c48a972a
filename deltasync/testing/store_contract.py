"""The store contract: the conformance suite a store backend runs to prove itself, with pytest.

Subclass ``StoreContract`` in a test module of your own and say where a new, empty stream lives; every
``test_*`` method of the contract then runs against your backend (as fsspec ships ``fsspec.tests.abstract``)::

    # test_my_store.py, run with: pytest test_my_store.py
    import uuid

    from deltasync.testing.store_contract import StoreContract

    class TestMyStore(StoreContract):
        storage_options = {"endpoint_url": "http://127.0.0.1:9000"}  # what Store(url, storage_options=) gets

        def make_url(self, tmp_path) -> str:
            return f"myscheme://test-bucket/{uuid.uuid4().hex}"  # a new, empty stream for each test

What a subclass gives: ``make_url(tmp_path)`` (required), ``storage_options`` (a class attribute, or set on
``self`` in an autouse fixture when they come from a fixture, e.g. a server started for the session); it may
override the ``url`` fixture instead of ``make_url``, and ``store(url)`` to build its ``Store`` differently.
The scheme must reach a transport: a ``register_transport`` call or a ``deltasync.transports`` entry point for
a ``Transport`` of your own, or any fsspec protocol (deltasync's generic fsspec transport then runs).

It runs through ``Store`` and the store's ``Transport`` (deltasync/transports/base.py): the primitives'
semantics first (keys, ranges, listings, conditions), then everything a stream needs on top of them.
Expected values are written out here, not computed by the code under test. A backend whose
``capabilities.create_only`` is false skips the race test (its create-only write is a check then a write).

This module imports pytest, which the library itself does not need: import it from test code only
(``deltasync.testing`` does not import it).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import (
    CorruptObjectError,
    StepExistsError,
    StepNotFoundError,
    WriterConflictError,
)
from deltasync.format import digest as digests
from deltasync.format.documents import ManifestStats, object_digest_fields
from deltasync.store import Manifest, Store, step_dir
from deltasync.store.scratch import OWNER_LOCK

__all__ = ["StoreContract"]


class StoreContract:
    """Every test a store backend must pass; a subclass says where its streams live (module docstring)."""

    storage_options: dict = {}

    def make_url(self, tmp_path: Path) -> str:
        """The URL of a new, empty stream (each test gets its own); ``tmp_path`` is pytest's, for local ones."""
        raise NotImplementedError(f"{type(self).__name__} must define make_url(tmp_path) or the url fixture")

    @pytest.fixture
    def url(self, tmp_path: Path) -> str:
        return self.make_url(tmp_path)

    def store(self, url: str) -> Store:
        """The ``Store`` each test opens on ``url`` (several per test: they must see one another's writes)."""
        return Store(url, storage_options=self.storage_options, retries=1, retry_base_s=0.01)

    @pytest.fixture
    def gen(self) -> torch.Generator:
        return torch.Generator().manual_seed(1234)

    @pytest.fixture
    def small_state(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return every_shape(gen)

    def publish(self, url, state, gen, steps=4, **kw):
        truth = []
        with DeltaPublisher(self.store(url), state, on_backlog="block", **kw) as pub:
            for s in range(steps):
                for v in state.values():
                    v.copy_(perturb(v, 0.03, gen))
                pub.publish(s)
                truth.append({k: v.clone() for k, v in state.items()})
        return truth

    # --- the transport's primitives ---

    def test_put_get_list_delete(self, url, tmp_path):
        t = self.store(url).transport
        assert t.list() == [] and t.list("steps") == [] and not t.exists("steps")
        t.put("a/one.bin", b"0123456789")
        t.put("a/b/two.bin", memoryview(bytearray(b"xy")))
        local = tmp_path / "three.bin"
        local.write_bytes(b"from a file")
        t.put("three.bin", local)
        assert t.get("a/one.bin") == b"0123456789" and t.get("three.bin") == b"from a file"
        assert t.get("a/one.bin", start=2, end=5) == b"234" and t.get("a/one.bin", end=100) == b"0123456789"
        assert t.get("a/one.bin", start=7) == b"789"
        assert sorted((e.key, e.size) for e in t.list()) == [("a/b/two.bin", 2), ("a/one.bin", 10), ("three.bin", 11)]
        assert sorted(e.key for e in t.list("a")) == ["a/b/two.bin", "a/one.bin"] == sorted(e.key for e in t.list("a/"))
        assert [e.key for e in t.list("a/b")] == ["a/b/two.bin"] and t.list("nothing") == []
        assert t.children() == ["a", "three.bin"] and t.children("a") == ["b", "one.bin"]
        assert t.exists("a") and t.exists("a/one.bin") and t.exists("a/b") and not t.exists("a/o")
        with pytest.raises(FileNotFoundError):
            t.get("a/missing.bin")
        out = tmp_path / "downloaded"
        t.get_file("a/b/two.bin", out)
        assert out.read_bytes() == b"xy"
        with pytest.raises(FileNotFoundError):
            t.get_file("a/missing.bin", tmp_path / "never")
        t.delete("three.bin")
        t.delete("three.bin")  # absent: nothing happens
        t.delete_tree("a")
        assert t.list() == [] and not t.exists("a/one.bin")

    def test_downloads_are_bounded(self, url, tmp_path):
        """``get_file(max_bytes=n)`` refuses an object larger than ``n`` with ``CorruptObjectError`` (the key, ``n``
        expected, the size or ``n + 1`` found) having written at most ``n + 1`` bytes: a bucket writer who swaps a
        step's object for a huge one cannot fill a follower's disk (docs/SECURITY.md). Through the store, the
        download of such a step is refused naming the stream, the step and the object, and leaves no file."""
        store = self.store(url)
        t = store.transport
        data = bytes(range(256)) * 1024  # 256 KiB
        t.put("big.bin", data)
        out = tmp_path / "bounded"
        t.get_file("big.bin", out, max_bytes=len(data))
        assert out.read_bytes() == data
        for max_bytes in (0, 1000, len(data) - 1):
            out.unlink(missing_ok=True)
            with pytest.raises(CorruptObjectError, match="more than") as refused:
                t.get_file("big.bin", out, max_bytes=max_bytes)
            assert (refused.value.key, refused.value.expected) == ("big.bin", max_bytes)
            assert refused.value.found in (max_bytes + 1, len(data))
            assert not out.exists() or out.stat().st_size <= max_bytes + 1
        with pytest.raises(FileNotFoundError):
            t.get_file("missing.bin", tmp_path / "never", max_bytes=10)
        m = _manifest(3, data)
        store.commit(m, data)
        store.write_bytes(f"{step_dir(3)}/{m.object}", data * 16)  # replaced behind the manifest's back
        with pytest.raises(CorruptObjectError, match=f"step 3 object {m.object}: .* manifest says {len(data)}") as e:
            store.fetch_object(m)
        assert (e.value.url, e.value.step, e.value.key, e.value.expected) == (store.url, 3, m.object, len(data))
        assert e.value.found in (len(data) + 1, len(data) * 16)
        if not t.capabilities.local_files:  # downloaded into the cache: nothing of it is left there (but its lock)
            assert [p.name for p in store.cache_dir.iterdir() if p.name != OWNER_LOCK] == []
        store.close()

    def test_create_only_and_compare_and_swap(self, url):
        t = self.store(url).transport
        t.put("doc.json", b"first", if_absent=True)
        with pytest.raises(FileExistsError):
            t.put("doc.json", b"second", if_absent=True)
        data, v1 = t.get_versioned("doc.json")
        assert data == b"first"
        t.put("doc.json", b"third", if_version=v1)
        data, v3 = t.get_versioned("doc.json")
        assert data == b"third" and v3 != v1
        with pytest.raises(FileExistsError):  # still at v1? no: somebody wrote it meanwhile
            t.put("doc.json", b"stale writer", if_version=v1)
        assert t.get("doc.json") == b"third"
        with pytest.raises(FileNotFoundError):
            t.get_versioned("none.json")

    def test_create_only_races_have_one_winner(self, url):
        t = self.store(url).transport
        if not t.capabilities.create_only:
            pytest.skip(f"{type(t).__name__}: create-only is a check then a write")
        won, lost = [], []
        start = threading.Barrier(6)

        def race(i: int) -> None:
            start.wait()
            try:
                self.store(url).transport.put("manifest.json", f"writer {i}".encode(), if_absent=True)
                won.append(i)
            except FileExistsError:
                lost.append(i)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len(won) == 1 and len(lost) == 5 and t.get("manifest.json") == f"writer {won[0]}".encode()

    def test_keys_stay_inside_the_store(self, url):
        t = self.store(url).transport
        for key in ("../escape", "a/../../b", "/abs", "a//b"):
            with pytest.raises(ValueError, match="not a store key"):
                t.put(key, b"x")

    # --- the stream on top ---

    def test_commit_from_bytes_and_read_back_as_bytes(self, url, tmp_path):
        store = self.store(url)
        data = b"an object's bytes " * 1000
        m = _manifest(3, data)
        store.commit(m, memoryview(data))
        assert store.steps() == [3] and store.manifest(3) == m
        assert store.read_object(m) == data and Path(store.fetch_object(m)).read_bytes() == data
        with pytest.raises(StepExistsError, match="never replaced"):
            store.commit(m, data)
        with pytest.raises(CorruptObjectError, match="manifest says"):
            store.put_object(_manifest(4, data), data[:-1])
        store.write_bytes(f"{step_dir(3)}/{m.object}", data + b"!")
        with pytest.raises(CorruptObjectError, match="more than"):
            store.read_object(m)
        store.write_bytes(f"{step_dir(3)}/{m.object}", data[:-1] + b"!")
        with pytest.raises(CorruptObjectError, match="differs from the manifest's blake3:"):
            store.read_object(m)
        old = _manifest(5, data, algorithm="sha256")  # a step of format version 1 (SHA-256) reads as before
        store.commit(old, data)
        assert store.read_object(old) == data and old.format_version == 1 and store.manifest(5) == old
        store.delete(f"{step_dir(3)}/{m.object}")
        with pytest.raises(CorruptObjectError, match="missing"):
            store.read_object(m)
        store.close()

    def test_lease_is_one_writer_at_a_time(self, url):
        a, b = self.store(url), self.store(url)
        a.acquire_lease("writer-a", ttl_s=60)
        with pytest.raises(WriterConflictError, match="held by writer 'writer-a'"):
            b.acquire_lease("writer-b", ttl_s=60)
        b.acquire_lease("writer-b", ttl_s=60, take_over=True)
        with pytest.raises(WriterConflictError, match="lost the stream to 'writer-b'"):
            a.hold_lease("writer-a")
        b.hold_lease("writer-b")
        b.release_lease("writer-b")
        assert a.lease() is None and a.stream_info() is not None

    def test_empty_stream(self, url):
        store = self.store(url)
        assert store.steps() == [] and store.latest_step() is None
        with pytest.raises(StepNotFoundError, match="no committed steps"):
            store.manifest(3)

    def test_publish_and_read_back_every_step(self, url, small_state, gen):
        truth = self.publish(url, small_state, gen, steps=5, anchor_every=3)
        reader = StreamReader(self.store(url))
        assert reader.steps() == [0, 1, 2, 3, 4] and reader.latest_step() == 4
        assert [reader.manifest(s).kind for s in range(5)] == ["anchor", "delta", "delta", "anchor", "delta"]
        for s in range(5):
            assert states_equal(reader.state_dict(s), truth[s])

    def test_uncommitted_step_is_invisible_and_cleaned(self, url, small_state, gen):
        self.publish(url, small_state, gen, steps=2)
        store = self.store(url)
        store.write_bytes(f"{step_dir(2)}/delta.safetensors", b"half-written")
        assert store.steps() == [0, 1] and store.latest_step() == 1
        with pytest.raises(StepNotFoundError, match="nearest committed: 1"):
            store.manifest(2)
        assert store.remove_uncommitted() == [2]
        assert store.step_folders() == [0, 1]

    def test_files_no_manifest_names_are_removed_once_old(self, url, small_state, gen):
        truth = self.publish(url, small_state, gen, steps=2)
        store = self.store(url)
        store.write_bytes(f"{step_dir(1)}/delta-0000000000000000.safetensors", b"a killed writer's upload")
        store.write_bytes(f"{step_dir(1)}/manifest.json.tmp-0123", b"{")
        store.write_bytes(f"{step_dir(2)}/delta.safetensors", b"half-written")
        assert store.remove_uncommitted(older_than_s=3600) == []  # young: their writer may still be at work
        assert store.remove_uncommitted(older_than_s=0) == [2]
        names = sorted(e.key.rsplit("/", 1)[-1] for e in store.list(step_dir(1)))
        assert names == sorted(["manifest.json", store.manifest(1).object])
        assert states_equal(StreamReader(self.store(url)).state_dict(1), truth[1])

    def test_a_committed_steps_own_files_survive_cleaning(self, url, small_state, gen):
        """An anchor's own delta and a step's signature are the step's: a restarted writer's cleaning keeps them
        (it deleted every anchor's delta older than a lease: followers then had to download whole anchors)."""
        truth = self.publish(url, small_state, gen, steps=4, anchor_every=3)
        store = self.store(url)
        m = store.manifest(3)
        assert m.kind == "anchor" and m.delta is not None
        store.write_bytes(f"{step_dir(2)}/signature.json", b"{}")
        assert store.remove_uncommitted(older_than_s=0) == []
        assert sorted(e.key.rsplit("/", 1)[-1] for e in store.list(step_dir(3))) == sorted(
            ["manifest.json", m.object, m.delta.object])
        assert store.signature(2) == b"{}"
        reader = StreamReader(self.store(url))
        with reader.open(3, base=2) as obj:  # opened as its own delta from step 2
            assert obj.header.kind == "delta"
        assert states_equal(reader.state_dict(3), truth[3])

    def test_stale_latest_hint_is_corrected(self, url, small_state, gen):
        self.publish(url, small_state, gen, steps=3)
        store = self.store(url)
        store.write_bytes("latest.json", json.dumps({"step": 1}).encode())
        assert store.latest_step() == 2
        store.write_bytes("latest.json", b"not json")
        assert store.latest_step() == 2

    def test_damaged_objects_are_detected(self, url, small_state, gen):
        self.publish(url, small_state, gen, steps=3)
        store = self.store(url)
        m = store.manifest(1)
        rel = f"{step_dir(1)}/{m.object}"
        data = store.read_bytes(rel)
        store.write_bytes(rel, data[:-10])
        with pytest.raises(CorruptObjectError, match="step 1 .* bytes, manifest says"):
            StreamReader(self.store(url)).open(1)
        store.write_bytes(rel, data[:-10] + b"x" * 10)
        with pytest.raises(CorruptObjectError, match="differs from the manifest's"):
            StreamReader(self.store(url)).open(1)
        store.delete(rel)
        with pytest.raises(CorruptObjectError, match="missing"):
            StreamReader(self.store(url)).open(1)

    def test_manifest_round_trip(self, url):
        store = self.store(url)
        m = Manifest(step=7, base_step=None, kind="anchor", object="anchor.safetensors", object_bytes=300,
                     object_sha256="0" * 64, state_checksum="1" * 64, created_unix_s=1.0,
                     stats=ManifestStats(numel=10, changed=3, density=0.3))
        store.write_bytes(f"{step_dir(7)}/manifest.json", m.to_json().encode())
        assert store.manifest(7) == m and store.steps() == [7]


def _manifest(step: int, data: bytes, *, algorithm: digests.Algorithm = "blake3") -> Manifest:
    """A one-object manifest for ``data``: format version 3 (BLAKE3, section 1b) or 1 (SHA-256)."""
    d = digests.compute(data, algorithm)
    return Manifest(step=step, base_step=None, kind="anchor", object=f"anchor-{digests.hex_of(d)[:16]}.safetensors",
                    object_bytes=len(data),
                    **object_digest_fields(d, sha256_version=1), state_checksum="0" * 64, created_unix_s=1.0)


def every_shape(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A trainer's state with every shape a stream must carry: bf16 matrices, a float32 scalar, an empty tensor,
    integers (the contract's ``small_state``; the tests' conftest uses this one too)."""
    return {
        "embed.weight": torch.randn(300, 64, generator=gen).bfloat16(),
        "layer.0.weight": torch.randn(64, 64, generator=gen).bfloat16(),
        "layer.0.bias": torch.randn(64, generator=gen).bfloat16(),
        "norm.weight": torch.ones(64).bfloat16(),
        "scale": torch.tensor(0.5, dtype=torch.float32),
        "empty": torch.zeros(0, 4),
        "counts": torch.arange(10, dtype=torch.int64),
    }


def perturb(t: torch.Tensor, density: float, gen: torch.Generator, *, finite: bool = True) -> torch.Tensor:
    """A copy of ``t`` with about ``density`` of its elements given new random bits (a training step; the tests'
    conftest uses this one too).

    ``finite``: new bits that would make a floating element NaN or ±Inf are not written (the element keeps its old
    bits), nor those of an fp32 or fp64 element whose bf16 cast (master weights published as bf16) overflows: no
    healthy optimizer step writes them, and a publisher refuses such a step (``refuse_nonfinite``)."""
    out = t.clone()
    if out.numel() == 0:
        return out
    flat = out.reshape(-1).view(torch.uint8).view(-1, out.element_size())
    mask = torch.rand(flat.shape[0], generator=gen) < density
    flat[mask] = torch.randint(0, 256, (int(mask.sum()), out.element_size()), generator=gen, dtype=torch.uint8)
    if finite and out.is_floating_point():
        wide = out if out.element_size() > 1 else out.to(torch.bfloat16)  # no isfinite kernel for some 8-bit floats
        ok = torch.isfinite(wide)
        if out.element_size() > 2:
            ok &= torch.isfinite(out.to(torch.bfloat16))
        out = torch.where(ok, out, t)
    return out


def states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, shapes, dtypes and bits."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
        and np.array_equal(a[k].reshape(-1).view(torch.uint8).numpy(), b[k].reshape(-1).view(torch.uint8).numpy())
        for k in a)
