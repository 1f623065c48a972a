"""Downloads of a step's objects: progress in bytes for large ones, and bounded by the manifest's size, whatever
the transport."""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import deltasync.follow.reader
from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import CorruptObjectError
from deltasync.history import CatchupOptions, write_catchups
from deltasync.store import MANIFEST, Store, catchup_dir, step_dir
from deltasync.store.node_cache import NodeCache
from deltasync.store.objects import PROGRESS_AFTER_BYTES
from deltasync.store.scratch import OWNER_LOCK
from deltasync.transports import register_transport, unregister_transport
from deltasync.transports.memory import MemoryTransport
from rollout_loader import Follower, StateDictTarget
from tests.conftest import perturb, states_equal
from tests.remote_cli import RemoteFolder, register, remote_url


def test_a_large_download_reports_its_bytes_and_a_small_one_nothing():
    url = f"memory://progress-{uuid.uuid4().hex}"  # a remote store (downloaded into the cache), in this process
    torch.manual_seed(0)
    big = {"w": torch.randn(PROGRESS_AFTER_BYTES // 2 + 1024).to(torch.bfloat16)}  # random bits: incompressible
    with DeltaPublisher(url, big, anchor_every=10) as pub:
        pub.publish(0)
        pub.flush()
        big["w"][:100] += 1  # a tiny delta at step 1
        pub.publish(1)
    calls: list[tuple[str, int, int]] = []
    with StreamReader(url) as reader:
        reader.store.download_progress = lambda what, done, total: calls.append((what, done, total))
        state = reader.state_dict(1)
        anchor_bytes = reader.store.manifest(0).objects[0].object_bytes
    assert torch.equal(state["w"].view(torch.int16), big["w"].view(torch.int16))
    assert anchor_bytes >= PROGRESS_AFTER_BYTES
    assert {c[0] for c in calls} == {"download step 0"}  # the delta is too small to report
    assert calls[0] == ("download step 0", 0, anchor_bytes)
    assert calls[-1] == ("download step 0", anchor_bytes, anchor_bytes)
    done = [c[1] for c in calls]
    assert done == sorted(done) and all(c[2] == anchor_bytes for c in calls)


def publish(url: str, steps: int = 5) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 0..steps-1 (anchors at 0 and 3) of a small bf16 state; the states fed, kept as the reference."""
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(40_000, generator=gen).bfloat16(), "b": torch.randn(64, generator=gen).bfloat16()}
    truth = {}
    with DeltaPublisher(url, state, anchor_every=3, on_backlog="block") as pub:
        for s in range(steps):
            for v in state.values():
                v.copy_(perturb(v, 0.05, gen))
            pub.publish(s)
            truth[s] = {k: v.clone() for k, v in state.items()}
    return truth


@pytest.fixture
def partial_sizes(monkeypatch):
    """The size of every partial download (``*.part``) as it is deleted: what a refused download had written."""
    sizes: list[int] = []
    unlink = Path.unlink

    def observed(self: Path, missing_ok: bool = False) -> None:
        if self.name.endswith(".part") and self.exists():
            sizes.append(self.stat().st_size)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", observed)
    return sizes


class UnsizedFolder(RemoteFolder):
    """A remote folder whose open files announce no size (as some fsspec backends' do): only the bytes read show
    that an object is larger than expected."""

    protocol = ("testunsized",)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" not in mode:
            return super()._open(path, mode, **kwargs)
        return open(self._strip_protocol(path), mode)  # noqa: SIM115 - fsspec's caller closes it


@pytest.mark.parametrize("scheme", ["memory", "memory+node-cache", "testremote", "testunsized"])
def test_an_object_swapped_for_a_huge_one_is_refused_within_its_size(scheme, tmp_path, monkeypatch, partial_sizes):
    """A bucket writer replaces step 1's object by one 4 MiB larger than its manifest says (docs/SECURITY.md): the
    follower's download stops at the manifest's size + 1 byte at most (memory:// and testremote:// announce the
    size: refused before a byte is written; testunsized:// announces none: exactly size + 1 bytes are read and
    written), refuses the step with a CorruptObjectError naming the stream, the step, the object and both sizes,
    leaves nothing in the cache (nor in the host's node cache), and the next good anchor (step 3) still applies,
    bit-exact against the states fed."""
    monkeypatch.setattr(deltasync.follow.reader, "MEMORY_OBJECT_BYTES", 0)  # every object through the download
    if scheme.startswith("memory"):
        url = f"memory://bounded-{uuid.uuid4().hex}"
    elif scheme == "testremote":
        register()
        url = remote_url(tmp_path / "stream")
    else:
        fsspec.register_implementation("testunsized", UnsizedFolder, clobber=True)
        url = f"testunsized://{tmp_path / 'stream'}"
    truth = publish(url)
    store = Store(url)
    m = store.manifest(1)
    size = m.objects[0].object_bytes
    store.write_bytes(f"{step_dir(1)}/{m.object}", os.urandom(size + (4 << 20)))
    cache = tmp_path / "cache"
    target = StateDictTarget()
    node = tmp_path / "node" if scheme == "memory+node-cache" else None  # the host's cache: downloads go through it
    with StreamReader(url, cache_dir=cache, node_cache=node) as reader:
        follower = Follower(reader, target)
        follower.sync(0)
        said = rf"step 1 object {m.object}: .* manifest says {size} \(more than it says: replaced; refused while"
        with pytest.raises(CorruptObjectError, match=said) as e:
            follower.sync(2)
        assert (e.value.url, e.value.step, e.value.key, e.value.expected) == (store.url, 1, m.object, size)
        if scheme == "testunsized":
            assert e.value.found == size + 1 and f": {size + 1}+ bytes" in str(e.value)
            assert partial_sizes == [size + 1]
        else:
            assert e.value.found == size + (4 << 20) and partial_sizes in ([], [0])
        assert [p.name for p in cache.iterdir() if p.name != OWNER_LOCK] == []
        assert node is None or NodeCache.file_name(m.objects[0].digest) not in {p.name for p in node.rglob("*")}
        assert target.step == 0 and states_equal(target.state_dict(), truth[0])
        assert follower.sync() == [3, 4]
        assert states_equal(target.state_dict(), truth[4])
        assert node is None or NodeCache.file_name(reader.manifest(3).objects[0].digest) in {p.name for p in
                                                                                              node.rglob("*")}


class OldSignature(MemoryTransport):
    """A transport written before downloads were bounded: ``get_file(key, local)``."""

    calls = 0

    def get_file(self, key: str, local: Path) -> None:  # type: ignore[override]
        OldSignature.calls += 1
        with open(local, "wb") as f:
            f.write(self.get(key))


def test_a_transport_without_max_bytes_is_still_read_and_warned_once(caplog):
    """A third party's ``get_file(key, local)`` keeps working: its downloads are not bounded (warned once per class),
    and the size check after them still refuses an oversized object."""
    name = f"bounded-old-{uuid.uuid4().hex}"
    truth = publish(f"memory://{name}", steps=2)
    register_transport("oldsig", lambda url, options: OldSignature(url.split("://", 1)[1]))
    try:
        with caplog.at_level(logging.WARNING, logger="deltasync.store.objects"):
            for _ in range(2):
                with StreamReader(f"oldsig://{name}") as reader:
                    reader.store.fetch_object(reader.manifest(0))
                    assert states_equal(reader.state_dict(1), truth[1])
            store = Store(f"oldsig://{name}")
            m = store.manifest(0)
            store.write_bytes(f"{step_dir(0)}/{m.object}", b"x" * (m.object_bytes + 100))
            with pytest.raises(CorruptObjectError, match=f"{m.object_bytes + 100} bytes, manifest says"):
                store.fetch_object(m)
            store.close()
    finally:
        unregister_transport("oldsig")
    assert OldSignature.calls >= 3
    warned = [r for r in caplog.records if "takes no max_bytes" in r.getMessage()]
    assert len(warned) == 1 and "OldSignature.get_file(key, local)" in warned[0].getMessage()


def test_a_catchup_object_named_as_its_steps_own_is_cached_apart(monkeypatch):
    """A catch-up to step B (folder catchup/<B>/<A>/, docs/FORMAT.md section 5g) whose object has the same file
    name as B's own: one reader holds both at once in one download cache, each file holding its own stored bytes,
    and both ways to B land on the state fed at B."""
    monkeypatch.setattr(deltasync.follow.reader, "MEMORY_OBJECT_BYTES", 0)  # deltas through the cache too
    url = f"memory://catchup-cache-{uuid.uuid4().hex}"
    truth = publish(url, steps=5)
    report = write_catchups(url, options=CatchupOptions(distances=(2,), consumers=False))
    base, step, _ = next(w for w in report.written if w[0] == 0)  # from 0 to 2: step 2's own object is a delta
    store = Store(url)
    own = store.manifest(step)
    folder = catchup_dir(step, base)
    doc = json.loads(store.read_bytes(f"{folder}/{MANIFEST}"))
    blob = store.read_bytes(f"{folder}/{doc['object']}")
    store.write_bytes(f"{folder}/{own.object}", blob)  # the catch-up's object renamed to B's own object's name
    store.delete(f"{folder}/{doc['object']}")
    doc["object"] = own.object
    store.write_bytes(f"{folder}/{MANIFEST}", json.dumps(doc).encode())
    store.close()
    fs = fsspec.filesystem("memory")
    stored = fs.cat(f"{url.removeprefix('memory://')}/{step_dir(step)}/{own.object}")
    assert stored != blob
    try:
        with StreamReader(url) as reader:
            assert reader.catchup(step, base).object == own.object
            mine, catchup = reader.open(step), reader.open(step, base=base)  # both held in the cache at once
            files = [p.read_bytes() for p in reader.store.cache_dir.iterdir() if not p.name.startswith(".")]
            assert sorted(files) == sorted([stored, blob])
            assert (mine.header.base_step, catchup.header.base_step) == (step - 1, base)
            mine.close()
            catchup.close()
            way = reader.replica(base)
            assert reader.catch_up(way, step) == [step]  # through the catch-up
            assert states_equal(way.state_dict(), truth[step])
            own_way = reader.replica(step - 1)
            assert reader.catch_up(own_way, step) == [step]  # through B's own object (no catch-up spans one step)
            assert states_equal(own_way.state_dict(), truth[step])
    finally:
        fs.rm(url.removeprefix("memory://"), recursive=True)
