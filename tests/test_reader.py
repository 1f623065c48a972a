import gc
import threading
import uuid
from dataclasses import replace
from pathlib import Path

import fsspec
import pytest

import deltasync.follow.reader
from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import (
    CorruptObjectError,
    FormatError,
    StepNotFoundError,
    WaitTimeoutError,
)
from deltasync.store import Store, step_dir
from rollout_loader import Follower, StateDictTarget
from tests.conftest import states_equal
from tests.test_publisher import train


@pytest.fixture
def stream(tmp_path, small_state, gen):
    truth = {}
    with DeltaPublisher(str(tmp_path), small_state, anchor_every=4, on_backlog="block") as pub:
        for s in range(10):
            truth[s] = train(small_state, gen)
            pub.publish(s)
    return str(tmp_path), truth


def test_chain_starts_at_nearest_anchor(stream):
    url, _ = stream
    r = StreamReader(url)
    assert r.chain(6) == [4, 5, 6]
    assert r.chain(6, start=5) == [6]
    assert r.chain(8) == [8]


def test_catch_up_from_an_older_replica(stream):
    """The cheaper way in bytes: the deltas from the step held (crossing the anchor at 8 by its own delta), or
    the anchor at 8 and what follows it; both end at the same weights."""
    url, truth = stream
    r = StreamReader(url)
    m = {s: r.manifest(s) for s in r.steps()}
    by_deltas = sum(m[s].delta.object_bytes if m[s].kind == "anchor" else m[s].object_bytes for s in range(2, 10))
    from_anchor = m[8].object_bytes + m[9].object_bytes
    rep = r.replica(1)
    assert r.catch_up(rep) == (list(range(2, 10)) if by_deltas <= from_anchor else [8, 9])
    assert states_equal(rep.state_dict(), truth[9])
    rep = r.replica(1)
    assert r.chain(9, start=1, max_walk=3) == [8, 9]  # no path within reach: from the anchor
    assert r.catch_up(rep, 3) == [2, 3]
    rep = r.replica(5)
    assert r.catch_up(rep, 7) == [6, 7]
    assert states_equal(rep.state_dict(), truth[7])


def test_wait_for_times_out_with_the_latest_step(stream):
    url, _ = stream
    with pytest.raises(WaitTimeoutError, match="step 99 not committed within 0.1s \\(latest: 9\\)"):
        StreamReader(url).wait_for(99, timeout_s=0.1)


def test_wait_for_returns_when_the_step_lands(tmp_path, small_state, gen):
    pub = DeltaPublisher(str(tmp_path), small_state)
    threading.Timer(0.2, lambda: pub.publish(0)).start()
    assert StreamReader(str(tmp_path)).wait_for(0, timeout_s=10) == 0
    pub.close()


def test_broken_chain_names_the_missing_step(stream):
    url, _ = stream
    r = StreamReader(url)
    r.store.delete(f"{step_dir(5)}/manifest.json")
    with pytest.raises(StepNotFoundError, match="chain to step 7 is broken at step 5.*nearest committed: 4, 6"):
        r.state_dict(7)
    with pytest.raises(StepNotFoundError, match="step 42 is not committed"):
        r.state_dict(42)


# --- downloads stay bounded and leave nothing behind (issue 8, "Long runs must not fill the disk") ---


@pytest.fixture
def remote(small_state, gen, monkeypatch):
    """A stream on a remote store (fsspec memory): its objects are downloaded into a cache to be read (deltas
    too: here no object is small enough to be fetched into memory; ``test_small_deltas_open_from_memory``)."""
    monkeypatch.setattr(deltasync.follow.reader, "MEMORY_OBJECT_BYTES", 0)
    url = f"memory://reader-{uuid.uuid4().hex}"
    truth = {}
    with DeltaPublisher(url, small_state, anchor_every=3, on_backlog="block") as pub:
        for s in range(7):
            truth[s] = train(small_state, gen)
            pub.publish(s)
    yield url, truth
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_small_deltas_open_from_memory(remote, monkeypatch):
    """By default a remote delta is fetched into memory, checked (size, digest) and opened from there: no
    cache file; anchors still go through the cache file. Damage is refused as before."""
    monkeypatch.undo()
    url, truth = remote
    with StreamReader(url) as reader:
        with reader.open(4) as delta, reader.open(3) as anchor:
            assert delta.path is None and anchor.path is not None
            assert cached(reader.store) == [3]
            assert {p.name for p in delta.patches()} == {n for n, t in delta.header.tensors.items() if t.changed}
        assert states_equal(reader.state_dict(5), truth[5])
        assert cached(reader.store) == []
        fs, m = fsspec.filesystem("memory"), reader.manifest(5)
        obj = f"{url.removeprefix('memory://')}/{step_dir(5)}/{m.object}"
        data = bytearray(fs.cat_file(obj))
        data[-1] ^= 1
        fs.pipe_file(obj, bytes(data))
        with pytest.raises(CorruptObjectError, match="digest blake3:.* differs from the manifest's blake3:"):
            reader.open(5)
        fs.pipe_file(obj, bytes(data) + b"x")
        with pytest.raises(CorruptObjectError, match=f"{m.object_bytes + 1}\\+ bytes, manifest says {m.object_bytes}"):
            reader.open(5)
        fs.rm(obj)
        with pytest.raises(CorruptObjectError, match="missing, though the step is committed"):
            reader.open(5)
        fs.rm(f"{url.removeprefix('memory://')}/{step_dir(5)}", recursive=True)
        with pytest.raises(StepNotFoundError, match="step 5 was collected"):
            reader.open(5)  # the manifest was read before: the step went while it was being read


def cached(store) -> list[int]:
    """The steps whose objects are in the store's download cache (files are named after their step)."""
    return sorted(int(p.name[:12]) for p in store.cache_dir.iterdir() if not p.name.startswith("."))


def test_closing_a_reader_removes_its_download_cache(remote):
    url, truth = remote
    with StreamReader(url) as reader:
        assert states_equal(reader.state_dict(5), truth[5])
        cache = reader.store.cache_dir
        assert cache.is_dir() and cache.name.startswith("deltasync-cache-")
    assert not cache.exists()


def test_an_object_leaves_the_cache_when_its_last_reader_closes_it(remote):
    url, truth = remote
    with StreamReader(url) as reader:
        first = reader.open(4)
        assert cached(reader.store) == [4]
        with reader.open(4) as second:  # the same object twice: held until both are closed
            assert second.header.step == 4
        assert cached(reader.store) == [4]
        assert first.patches()  # still readable
        first.close()
        assert cached(reader.store) == []


def test_a_follower_keeps_only_the_object_it_is_applying(remote):
    url, truth = remote
    seen: list[list[int]] = []

    class Recording(StateDictTarget):
        def apply(self, obj):
            seen.append(cached(follower.reader.store))
            super().apply(obj)

    follower = Follower(url, Recording(), on_step=lambda s: seen.append(cached(follower.reader.store)))
    assert follower.sync(4) == [3, 4]
    # 6 is an anchor that carries its delta from 5: holding 4, the follower reads two small deltas, not the anchor
    assert follower.sync() == [5, 6]
    assert seen == [[3], [], [4], [], [5], [], [6], []]  # in the cache while applied, gone once it is live
    assert states_equal(follower.target.state_dict(), truth[6])
    cache = follower.reader.store.cache_dir
    follower.close()
    assert not cache.exists()


def test_the_byte_cap_bounds_objects_that_nobody_holds(remote):
    url, _ = remote
    with Store(url) as store:
        manifests = [store.manifest(s) for s in store.steps()]
        store.cache_max_bytes = max(m.object_bytes for m in manifests)
        held = StreamReader(store).open(0)  # held objects are never evicted
        for m in manifests[1:]:
            path = store.fetch_object(m)
            assert path.exists()  # the object just fetched is always there
            unheld = [p for p in store.cache_dir.iterdir() if not p.name.startswith("000000000000-")]
            assert sum(p.stat().st_size for p in unheld) <= max(store.cache_max_bytes, m.object_bytes)
        assert 0 in cached(store) and held.tensor("layer.0.weight").numel()
        held.close()
        assert 0 not in cached(store)


def test_a_reader_that_is_dropped_without_close_leaves_nothing(remote):
    url, truth = remote
    reader = StreamReader(url)
    obj = reader.open(6)
    cache = reader.store.cache_dir
    assert cached(reader.store) == [6]
    del obj  # dropped without close: the object is released
    assert cached(reader.store) == []
    del reader
    gc.collect()
    assert not cache.exists()


def test_store_close_after_an_interrupted_download(remote, monkeypatch):
    url, _ = remote
    store = Store(url)
    real = store.transport.get_file
    folders = []

    def interrupted(path, local):
        real(path, local)
        folders.append(Path(local).parent)
        raise KeyboardInterrupt  # Ctrl-C after the bytes landed, before the object was renamed into place

    monkeypatch.setattr(store.transport, "get_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with store:
            store.fetch_object(store.manifest(0))
    assert folders and not folders[0].exists()


def test_a_given_cache_folder_is_kept_but_emptied(remote, tmp_path):
    url, truth = remote
    folder = tmp_path / "cache"
    with StreamReader(url, cache_dir=folder) as reader:
        assert states_equal(reader.state_dict(2), truth[2])
        reader.store.fetch_object(reader.manifest(1))
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_an_object_name_cannot_leave_the_cache(remote):
    url, _ = remote
    with Store(url) as store:
        m = store.manifest(1)
        for name in ("a/../../../escaped.safetensors", "..", "/abs.safetensors"):
            with pytest.raises(FormatError, match="not a plain file name"):
                store.fetch_object(replace(m, object=name))
        assert cached(store) == [] and not (store.cache_dir.parent / "escaped.safetensors").exists()


def test_a_caught_up_follower_never_downloads_an_anchor(tmp_path):
    """An anchor carries its delta from the step published before it (docs/FORMAT.md section 5): a follower
    holding that step fetches only that delta; a joiner fetches the anchor; both end exact; verify checks
    the delta's bits, and ``anchor_deltas=False`` writes none."""
    import torch

    from deltasync import verify
    from deltasync.store import Store, step_dir
    from rollout_loader import Follower, StateDictTarget

    url = str(tmp_path / "s")
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(20_000, generator=g).bfloat16()]
    for _ in range(5):
        w = states[-1].clone()
        w[torch.randint(0, w.numel(), (200,), generator=g)] += 1.0
        states.append(w)
    follower = Follower(url, StateDictTarget())
    got: list[str] = []
    transport = follower.reader.store.transport
    local_path = transport.local_path

    def seen(key, **kw):  # every object the follower reads (a local store reads in place)
        got.append(key.rsplit("/", 1)[-1])
        return local_path(key)

    transport.local_path = seen  # type: ignore[method-assign]
    with DeltaPublisher(url, {"w": states[0].clone()}, anchor_every=3, on_backlog="block") as pub:
        for s, w in enumerate(states):
            pub.source = {"w": w}
            pub.publish(s)
            pub.flush()
            follower.sync()
    m = Store(url).manifest(3)
    assert m.kind == "anchor" and m.delta is not None and m.delta.base_step == 2
    assert m.delta.object_bytes * 20 < m.object_bytes  # a few bytes instead of the dense anchor
    assert [n.split("-")[0] for n in got if n.endswith(".safetensors")] == ["anchor", "delta", "delta", "delta",
                                                                            "delta", "delta"]
    assert torch.equal(follower.target.state_dict()["w"].view(torch.int16), states[-1].view(torch.int16))
    follower.close()
    joiner = StateDictTarget()
    Follower(url, joiner).sync(4)  # holds nothing: from the anchor at 3
    assert torch.equal(joiner.state_dict()["w"].view(torch.int16), states[4].view(torch.int16))
    assert verify(url).ok

    # a forged delta (valid digest, other bits) is caught by verify's replay, not only by the digest
    forged_url = str(tmp_path / "forged")
    with DeltaPublisher(forged_url, {"w": states[0].clone()}, anchor_every=3, on_backlog="block") as pub:
        for s, w in enumerate([states[0], states[1], states[1], states[3]]):  # its step 2 differs from the other's
            pub.source = {"w": w}
            pub.publish(s)
    store = Store(forged_url)
    wrong = Store(url).manifest(3).delta  # the other stream's 2 -> 3: wrong bits from this stream's step 2
    m3 = store.manifest(3)
    (tmp_path / "forged" / step_dir(3) / m3.delta.object).unlink()
    import shutil
    shutil.copy(tmp_path / "s" / step_dir(3) / wrong.object, tmp_path / "forged" / step_dir(3) / wrong.object)
    from dataclasses import replace
    store.write_bytes(f"{step_dir(3)}/manifest.json", replace(m3, delta=wrong).to_json().encode())
    report = verify(forged_url, all_problems=True)
    assert [(p.step, p.kind) for p in report.problems] == [(3, "checksum")]

    plain = str(tmp_path / "plain")
    with DeltaPublisher(plain, {"w": states[0].clone()}, anchor_every=3, anchor_deltas=False,
                        on_backlog="block") as pub:
        for s, w in enumerate(states):
            pub.source = {"w": w}
            pub.publish(s)
    assert Store(plain).manifest(3).delta is None


def test_the_manifest_cache_is_bounded_in_bytes(tmp_path, small_state, gen, monkeypatch):
    """(issue 19, item 6) A count did not bound memory (a sharded step's manifest is megabytes): bytes do."""
    url = str(tmp_path / "s")
    with DeltaPublisher(url, small_state, anchor_every=5, on_backlog="block") as pub:
        for s in range(40):
            train(small_state, gen)
            pub.publish(s)
    with StreamReader(url) as reader:
        one = deltasync.follow.reader._manifest_cost(reader.store.manifest(3))
        monkeypatch.setattr(deltasync.follow.reader, "MANIFEST_CACHE_BYTES", 10 * one)
        for s in range(40):
            assert reader.manifest(s).step == s
            assert reader._manifest_bytes <= 10 * one
        assert 5 <= len(reader._manifests) <= 12 and max(reader._manifests) == 39  # the most recent are kept
        assert reader.manifest(39) is reader.manifest(39)  # a hit costs no read


def test_an_object_source_that_holds_the_wrong_size_is_not_believed(tmp_path, small_state, gen):
    """A third party's object source (``StreamReader(objects=...)``) that holds bytes of another size than the
    manifest's is not believed: the reader reads the step from the store and releases what the source held."""
    from deltasync import DeltaPublisher, StreamReader
    from tests.conftest import states_equal

    url = str(tmp_path / "s")
    with DeltaPublisher(url, small_state, on_backlog="block") as pub:
        pub.publish(0)
    released = []

    class Lying:
        def held(self, step, *, name, nbytes, digest):
            class Held:
                def view(self):
                    return memoryview(b"\0" * (nbytes + 7))

                def check(self):
                    pass

                def release(self):
                    released.append(step)
            return Held()

    with StreamReader(url, objects=Lying()) as reader:
        got = reader.state_dict(0)
    assert states_equal(got, {n: t.clone() for n, t in small_state.items()}) and released == [0]
