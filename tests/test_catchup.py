"""Catch-up deltas (docs/FORMAT.md section 5g): written from the store, chosen by the reader when they cost fewer
bytes, refused (and the steps' own objects taken) when unsigned, mis-signed or damaged, kept and collected by gc,
never half visible. The reference for every result is the weights the trainer fed at that step (already in the
published dtype), never deltasync's own reading of them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import deltasync.follow.reader
import deltasync.history.catchup as catchup_mod
from deltasync import DeltaPublisher, StreamReader, collect_garbage, verify
from deltasync.errors import ConfigError
from deltasync.follow.consumers import write_heartbeat
from deltasync.format.patch import Patch
from deltasync.history import CatchupOptions, CatchupWriter, write_catchups
from deltasync.history.catchup import merge_patches
from deltasync.signing import SIGNATURE, keygen
from deltasync.store import MANIFEST, Store, catchup_dir
from deltasync.trust import TrustedKeys
from rollout_loader import Follower, StateDictTarget
from tests.conftest import states_equal
from tests.test_publisher import train

STREAM = "run-catchup"
STEPS = 40


def _state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Weights whose anchor is large beside a step's delta, as a model's is (so that ways of deltas win)."""
    return {"w": torch.randn(256, 256, generator=gen).bfloat16(), "b": torch.randn(256, generator=gen).bfloat16(),
            "scale": torch.tensor(0.5)}


def _publish(url, gen, truth, *, steps=STEPS, anchor_every=16, **kw):
    state = _state(gen)
    with DeltaPublisher(url, state, anchor_every=anchor_every, on_backlog="block", **kw) as pub:
        for s in range(steps):
            truth[s] = train(state, gen, density=0.004)
            pub.publish(s)
    return state


@pytest.fixture
def stream(tmp_path, gen):
    """40 steps, anchors at 0, 16, 32 (each carrying its own delta): ways from a held step cross them."""
    truth: dict[int, dict[str, torch.Tensor]] = {}
    url = str(tmp_path / "stream")
    _publish(url, gen, truth)
    return url, truth


def _plain(url: str, step: int, start: int, trust=None) -> list[int]:
    """The way without catch-ups (what a reader that ignores them reads)."""
    return StreamReader(url, trusted_keys=trust).chain(step, start=start, catchup=False)


def _way_bytes(reader: StreamReader, chain: list[int], start: int) -> int:
    """What opening ``chain`` from ``start`` reads, by the manifests (catch-ups by their own)."""
    total, held = 0, start
    for s in chain:
        m = reader.manifest(s)
        if m.base_step == held:
            total += m.object_bytes
        elif m.delta is not None and m.delta.base_step == held:
            total += m.delta.object_bytes
        elif m.kind == "anchor" and held != s:
            try:
                total += reader.catchup(s, held).object_bytes
            except Exception:  # noqa: BLE001 - no catch-up: the anchor whole
                total += m.object_bytes
        else:
            total += reader.catchup(s, held).object_bytes
        held = s
    return total


def test_merge_patches_is_the_patches_applied_in_turn():
    """Against numpy: apply each patch in turn to random bits; the merged patch, applied once, gives the same bits,
    and lists exactly the elements that differ (those that came back are dropped)."""
    rng = np.random.default_rng(3)
    numel = 5000
    for dense_at in (None, 4):
        bits = rng.integers(0, 2**16, numel, dtype=np.uint16)
        want = bits.copy()
        patches = []
        for k in range(5):
            pos = np.unique(rng.integers(0, 600 if k % 2 else numel, 300)).astype(np.int64)  # overlapping
            xor = rng.integers(1, 2**16, pos.size, dtype=np.uint16)
            if k == 3:  # undo part of the patch before: those elements come back
                pos, xor = patches[2].positions[:50].copy(), patches[2].xor[:50].copy()
            if k == dense_at:
                full = np.zeros(numel, np.uint16)
                full[pos] = xor
                patches.append(Patch(name="t", dtype="BF16", shape=(numel,), positions=None, xor=full, checksum=0))
                want ^= full
            else:
                patches.append(Patch(name="t", dtype="BF16", shape=(numel,), positions=pos, xor=xor, checksum=0))
                want[pos] ^= xor
        merged = merge_patches(patches, checksum=7)
        got = bits.copy()
        assert merged.positions is not None
        got[merged.positions] ^= merged.xor
        assert np.array_equal(got, want)
        assert np.array_equal(merged.positions, np.flatnonzero(bits != want))
        assert merged.checksum == 7 and merged.xor.dtype == np.uint16


def test_a_replica_behind_takes_catchups_and_lands_bit_exact(stream):
    url, truth = stream
    report = write_catchups(url, options=CatchupOptions(distances=(4, 16), consumers=False))
    assert report.written and not report.skipped
    assert {(a, b) for a, b, _ in report.written} >= {(4, 8), (16, 32), (32, 36)}
    for held in (3, 10, 21, 33):
        r = StreamReader(url)
        plain = r.chain(STEPS - 1, start=held, catchup=False)
        way = r.chain(STEPS - 1, start=held)
        assert _way_bytes(r, way, held) <= _way_bytes(r, plain, held), held
        assert held == 33 or way != plain  # from 33 no catch-up starts on the way
        rep = r.replica(held)
        assert r.catch_up(rep, STEPS - 1) == way
        assert states_equal(rep.state_dict(), truth[STEPS - 1]), held
        assert rep.state_dict().keys() == truth[STEPS - 1].keys()


def test_a_follower_follows_through_catchups(stream, monkeypatch):
    """The real follower: it holds step 5, catch-ups appear, it syncs to the newest by them, bit-exact."""
    url, truth = stream
    monkeypatch.setattr(deltasync.follow.reader, "CATCHUP_LIST_S", 0.0)  # it listed (none) a moment ago
    f = Follower(url, StateDictTarget())  # not started: this test drives it
    try:
        f.sync(5)
        write_catchups(url, options=CatchupOptions(distances=(4, 16), consumers=False))
        way = f.reader.chain(STEPS - 1, start=5)
        assert way != f.reader.chain(STEPS - 1, start=5, catchup=False)
        assert f.sync(STEPS - 1) == way
        assert states_equal(f.target.state_dict(), truth[STEPS - 1])
    finally:
        f.close()


def test_consumer_catchups_follow_the_newest_step(tmp_path, gen):
    """A consumer whose heartbeat holds step 5 gets a catch-up to the newest step; once newer steps exist the
    next pass writes one to the new newest and deletes the one it supersedes (after its grace)."""
    url = str(tmp_path / "s")
    truth: dict[int, dict[str, torch.Tensor]] = {}
    state = _state(gen)
    store = Store(url)
    options = CatchupOptions(distances=(), min_lag=4, grace_s=0)
    with DeltaPublisher(url, state, anchor_every=100, on_backlog="block") as pub, \
            CatchupWriter(url, options=options) as w:
        for s in range(15):
            truth[s] = train(state, gen, density=0.004)
            pub.publish(s)
            if s == 11:
                pub.flush()
                write_heartbeat(store, "rollout-0", 5)
                assert [(a, b) for a, b, _ in w.run_once().written] == [(5, 11)]
        pub.flush()
        report = w.run_once()
    assert [(a, b) for a, b, _ in report.written] == [(5, 14)] and report.deleted == [(5, 11)]
    assert report.written[0][2] < sum(StreamReader(url).manifest(s).object_bytes for s in range(6, 15))
    assert [(e.base_step, e.step) for e in store.catchup_entries()] == [(5, 14)]
    r = StreamReader(url)
    assert r.chain(14, start=5) == [14]
    rep = r.replica(5)
    r.catch_up(rep, 14)
    assert states_equal(rep.state_dict(), truth[14])


def test_signed_catchups_are_used_and_bad_ones_refused(tmp_path, gen):
    """On a signed stream a follower with trusted keys takes catch-ups the writer signed; one with no signature,
    another key's, or a signature over other contents is refused, and the follower takes the steps' own objects,
    still bit-exact."""
    key, pub_key = keygen(tmp_path / "trainer.key")
    other, _ = keygen(tmp_path / "other.key")
    url = str(tmp_path / "s")
    truth: dict[int, dict[str, torch.Tensor]] = {}
    _publish(url, gen, truth, signing_key=key, stream_id=STREAM)
    trust = TrustedKeys.load([pub_key], stream_id=STREAM)
    plain = _plain(url, 33, 16, trust)
    assert plain == list(range(17, 34))
    options = CatchupOptions(distances=(16,), consumers=False)
    report = write_catchups(url, options=options, signing_key=key, stream_id=STREAM)
    assert (16, 32) in {(a, b) for a, b, _ in report.written}

    def follow(held: int) -> tuple[list[int], StreamReader]:
        r = StreamReader(url, trusted_keys=trust.fresh())
        rep = r.replica(held)
        chain = r.catch_up(rep, 33)
        assert states_equal(rep.state_dict(), truth[33])
        return chain, r

    chain, _ = follow(16)
    assert chain == [32, 33]  # 16 -> 32 by the signed catch-up
    store = Store(url)
    sig = f"{catchup_dir(32, 16)}/{SIGNATURE}"
    good = store.read_bytes(sig)
    write_catchups(url, options=options, signing_key=other, stream_id=STREAM)  # nothing new: all committed
    for bad in (None, "other key", "other contents"):
        if bad is None:
            store.delete(sig)
        elif bad == "other key":
            from deltasync.signing import SigningKey, StreamSigner
            m = store.catchup_record(32, 16)
            signer = StreamSigner(key=SigningKey(other), stream_id=STREAM)
            store.write_bytes(sig, signer.sign_catchup(m[0], m[2]))
        else:  # a signature of the trusted key, over the catch-up 0 -> 16, copied here
            store.write_bytes(sig, store.read_bytes(f"{catchup_dir(16, 0)}/{SIGNATURE}"))
        chain, r = follow(16)
        assert chain == plain, bad  # the steps' own deltas (the anchor at 32 by its own delta)
        assert (32, 16) in r.refused_catchups
    store.write_bytes(sig, good)
    assert follow(16)[0] == [32, 33]


def test_an_unsigned_writer_on_a_signed_stream_is_refused(tmp_path, gen):
    key, pub_key = keygen(tmp_path / "trainer.key")
    url = str(tmp_path / "s")
    truth: dict[int, dict[str, torch.Tensor]] = {}
    _publish(url, gen, truth, signing_key=key, stream_id=STREAM)
    write_catchups(url, options=CatchupOptions(distances=(16,), consumers=False))  # no key: unsigned
    assert Store(url).catchup_entries()
    r = StreamReader(url, trusted_keys=TrustedKeys.load([pub_key], stream_id=STREAM))
    assert r.chain(33, start=16) == _plain(url, 33, 16)
    assert r.refused_catchups
    assert StreamReader(url).chain(33, start=16) == [32, 33]  # a reader without keys takes it


def test_a_damaged_catchup_is_refused_and_the_way_planned_again(stream):
    url, truth = stream
    write_catchups(url, options=CatchupOptions(distances=(16,), consumers=False))
    store = Store(url)
    m, _, _ = store.catchup_record(32, 16)
    path = store.transport.local_path(f"{catchup_dir(32, 16)}/{m.object}")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    r = StreamReader(url)
    rep = r.replica(16)
    assert r.catch_up(rep, 33) == _plain(url, 33, 16)
    assert states_equal(rep.state_dict(), truth[33])
    assert "differs from the manifest's blake3:" in r.refused_catchups[(32, 16)]
    problems = verify(url, all_problems=True).problems
    assert [(p.step, p.kind) for p in problems] == [(32, "catchup")]


def test_a_catchup_that_lies_is_caught_by_the_checksums(stream):
    """A catch-up whose manifest and object agree (an unsigned stream: anyone who can write the bucket) but whose
    patches are wrong: applying it fails step 32's checksums, and verify names it."""
    url, _ = stream
    write_catchups(url, options=CatchupOptions(distances=(16,), consumers=False))
    store = Store(url)
    good, _, _ = store.catchup_record(32, 16)
    with CatchupWriter(url, options=CatchupOptions(distances=(), consumers=False)) as w:  # 20 -> 32 under 16's name
        chain = w.reader.chain(32, start=20, anchors=False)
        objects = []
        held = 20
        for s in chain:
            objects.append(w.reader.open(s, base=held))
            held = s
        data, _, _ = w._merged(16, 32, objects)
        for o in objects:
            o.close()
    store.delete_catchup(32, 16)
    import dataclasses

    import blake3
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    assert good.format_version == 2 and good.digest == "blake3"  # a catch-up manifest that names its digest
    lie = dataclasses.replace(good, object=f"catchup-{digest[7:23]}.safetensors", object_bytes=data.nbytes,
                              object_digest=digest)
    store.commit_catchup(lie, data)
    problems = verify(url, all_problems=True).problems
    assert [(p.step, p.kind) for p in problems] == [(32, "catchup")]
    assert "ChecksumMismatchError" in problems[0].message


def test_gc_keeps_catchups_between_kept_steps_and_deletes_the_others(stream):
    url, truth = stream
    write_catchups(url, options=CatchupOptions(distances=(4, 16), consumers=False))
    before = {(e.base_step, e.step) for e in Store(url).catchup_entries()}
    plan = collect_garbage(url, keep_last=10)  # keeps 30..39 and their chain: the anchor at 16 and 17..29
    kept = set(plan.keep)
    assert set(plan.catchups) == {(a, b) for a, b in before if a not in kept or b not in kept}
    after = {(e.base_step, e.step) for e in Store(url).catchup_entries()}
    assert after == {(a, b) for a, b in before if a in kept and b in kept} and after
    r = StreamReader(url)
    rep = r.replica(20)
    r.catch_up(rep, STEPS - 1)
    assert states_equal(rep.state_dict(), truth[STEPS - 1])
    assert verify(url).ok


def test_a_writer_killed_mid_catchup_leaves_nothing_visible(stream, monkeypatch):
    """Killed after the object landed, before the manifest: readers never see it, the next pass writes it again,
    and the leftover goes once old (gc or the writer)."""
    url, truth = stream
    store = Store(url)
    real = Store.write_bytes

    def die_at_the_manifest(self, rel, data, **kw):
        if rel.startswith("catchup/") and rel.endswith(MANIFEST):
            raise KeyboardInterrupt("killed")
        return real(self, rel, data, **kw)

    monkeypatch.setattr(Store, "write_bytes", die_at_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        write_catchups(url, options=CatchupOptions(distances=(16,), consumers=False))
    monkeypatch.setattr(Store, "write_bytes", real)
    [entry] = store.catchup_entries()
    assert not entry.committed and entry.object_bytes > 0
    r = StreamReader(url)
    assert r.chain(33, start=16) == _plain(url, 33, 16)
    monkeypatch.setattr(catchup_mod, "LEFTOVER_S", 0.0)
    with CatchupWriter(url, options=CatchupOptions(distances=(16,), consumers=False, grace_s=0)) as w:
        report = w.run_once()
    assert (16, 32) in {(a, b) for a, b, _ in report.written}
    assert all(e.committed for e in store.catchup_entries())
    assert StreamReader(url).chain(33, start=16) == [32, 33]


def test_options_and_documents_are_checked(stream):
    url, _ = stream
    for bad in ({"distances": (1,)}, {"distances": (True,)}, {"min_lag": 1}, {"horizon": 0}):
        with pytest.raises(ConfigError):
            CatchupOptions(**bad)  # type: ignore[arg-type]
    write_catchups(url, options=CatchupOptions(distances=(16,), consumers=False))
    store = Store(url)
    rel = f"{catchup_dir(32, 16)}/{MANIFEST}"
    doc = json.loads(store.read_bytes(rel))
    store.delete(rel)
    store.write_bytes(rel, json.dumps({**doc, "base_step": 17}).encode())  # names another pair than its folder
    r = StreamReader(url)
    assert r.chain(33, start=16) == _plain(url, 33, 16)
    assert "17" in r.refused_catchups[(32, 16)]
    store.delete(rel)
    store.write_bytes(rel, json.dumps({**doc, "state_checksum": "0" * 64}).encode())
    r = StreamReader(url)
    assert r.chain(33, start=16) == _plain(url, 33, 16)
    assert "state checksum" in r.refused_catchups[(32, 16)]


def test_the_command_writes_catchups_and_the_writer_keeps_up(stream, monkeypatch, capsys):
    """``deltasync catchup`` (the real entry point) writes what ``write_catchups`` would; ``follow`` runs passes."""
    from tests.test_cli_errors import run_main

    url, _ = stream
    code, out, err = run_main(monkeypatch, capsys, "catchup", url, "--distances", "16", "--no-consumers", "--json")
    assert code == 0, err
    assert sorted((a, b) for a, b, _ in json.loads(out)["written"]) == [(0, 16), (16, 32)]
    code, _, err = run_main(monkeypatch, capsys, "catchup", url, "--distances", "1")
    assert code != 0 and "distances" in err
    with CatchupWriter(url, options=CatchupOptions(distances=(4,), consumers=False)) as w:
        w.follow(poll_s=0.01, passes=1)
    assert {(e.base_step, e.step) for e in Store(url).catchup_entries()} >= {(0, 4), (32, 36), (16, 32)}


def test_a_reader_at_the_target_opens_nothing(tmp_path):
    """``chain(step, start=step)``: the step is held already (a framework that repeats a step only to wake its
    replicas must move nothing); past it, the way starts at an anchor."""
    import torch

    from deltasync import DeltaPublisher, StreamReader

    url = str(tmp_path / "s")
    state = {"w": torch.zeros(64)}
    with DeltaPublisher(url, state, anchor_every=100, on_backlog="block") as pub:
        for s in range(3):
            state["w"][s] += 1.0
            pub.publish(s)
    with StreamReader(url) as reader:
        assert reader.chain(2, start=2) == [] and reader.chain(1, start=2) == [0, 1] and reader.chain(2, start=1) == [2]
