"""Object digests (docs/FORMAT.md section 1b): the digest module against hashlib and blake3 called directly, a
stream begun by a SHA-256 writer and continued by a BLAKE3 one (replayed, followed, caught up, read through a
node cache), and manifests naming a digest a reader does not know. References are the weights the trainer fed
and the hash libraries themselves, never deltasync's own reading."""

from __future__ import annotations

import hashlib
import json
import re
import uuid

import blake3
import fsspec
import pytest
import torch

from deltasync import DeltaPublisher, NodeCache, StreamReader
from deltasync.errors import ConfigError, CorruptObjectError, FormatError
from deltasync.format import digest as digests
from deltasync.history import CatchupOptions, CatchupWriter, write_catchups
from deltasync.store import Manifest, Store, step_dir
from rollout_loader import Follower, StateDictTarget
from tests.conftest import states_equal
from tests.test_publisher import train


def test_the_module_is_hashlib_and_blake3(tmp_path):
    data = bytes(range(256)) * 5000
    assert digests.compute(data, "sha256") == "sha256:" + hashlib.sha256(data).hexdigest()
    assert digests.compute(data, "blake3") == "blake3:" + blake3.blake3(data).hexdigest()
    path = tmp_path / "f"
    path.write_bytes(data)
    for algorithm in digests.ALGORITHMS:
        assert digests.of_file(path, algorithm) == digests.compute(data, algorithm)
        reference = {"sha256": hashlib.sha256(data).hexdigest(), "blake3": blake3.blake3(data).hexdigest()}
        for parallel in (True, False):  # the inbox hashes its pieces single-threaded: the same digest
            h = digests.hasher(algorithm, parallel=parallel)
            for at in range(0, len(data), 77_777):  # pieces hash to the whole
                h.update(memoryview(data)[at:at + 77_777])
            assert h.hexdigest() == reference[algorithm]
    same = "ab" * 32
    assert not digests.matches(f"sha256:{same}", f"blake3:{same}")
    for bad in (same, f"md5:{same}", f"blake3:{same[:-1]}", f"blake3:{same}\n", None):
        with pytest.raises(FormatError, match="expected a digest"):
            digests.split(bad)  # type: ignore[arg-type]


def test_the_writers_algorithm_comes_from_the_environment(monkeypatch):
    assert digests.write_algorithm() == "blake3"
    monkeypatch.setenv("DELTASYNC_DIGEST", "sha256")
    assert digests.write_algorithm() == "sha256"
    for bad in ("md5", "", "SHA256", " sha256", "blаke3"):  # no fallback, no folding: the name as documented
        monkeypatch.setenv("DELTASYNC_DIGEST", bad)
        with pytest.raises(ConfigError, match=f"environment variable DELTASYNC_DIGEST: expected one of sha256, blake3 "
                                              rf"\(or unset: blake3\), got {re.escape(repr(bad))}") as e:
            digests.write_algorithm()
        assert not e.value.retryable and e.value.found == bad


def test_a_bad_digest_setting_fails_before_a_writer_writes_anything(tmp_path, gen, monkeypatch):
    """``DELTASYNC_DIGEST=md5`` is the trainer's setting, not a store's fault: refused when the publisher (or the
    catch-up writer) is made, as a ConfigError nobody retries, before anything reaches the store; not a retryable
    PublishError from the background thread after the first steps were captured."""
    url = str(tmp_path / "stream")
    state = _state(gen)
    with DeltaPublisher(url, state, on_backlog="block") as pub:  # a stream for the catch-up writer
        for s in range(3):
            train(state, gen, density=0.01)
            pub.publish(s)
    monkeypatch.setenv("DELTASYNC_DIGEST", "md5")
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError, match="DELTASYNC_DIGEST: expected one of sha256, blake3 .* got 'md5'") as e:
        DeltaPublisher(str(fresh), state, on_backlog="block")
    assert not e.value.retryable
    assert not fresh.exists() or not any(fresh.iterdir())  # not even stream.json
    with pytest.raises(ConfigError, match="DELTASYNC_DIGEST: expected one of sha256, blake3 .* got 'md5'"):
        CatchupWriter(url, options=CatchupOptions(distances=(2,), consumers=False))
    assert Store(url).catchup_entries() == []


def _state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(128, 64, generator=gen).bfloat16(), "b": torch.randn(64, generator=gen).bfloat16()}


@pytest.fixture
def mixed(tmp_path, gen, monkeypatch):
    """Steps 0-5 by a writer of SHA-256 (format versions 1), 6-13 by this version's (3) continuing the stream."""
    url = str(tmp_path / "stream")
    state = _state(gen)
    truth: dict[int, dict[str, torch.Tensor]] = {}
    monkeypatch.setenv("DELTASYNC_DIGEST", "sha256")
    with DeltaPublisher(url, state, anchor_every=4, on_backlog="block") as pub:
        for s in range(6):
            truth[s] = train(state, gen, density=0.01)
            pub.publish(s)
    monkeypatch.delenv("DELTASYNC_DIGEST")
    with DeltaPublisher(url, state, anchor_every=4, on_backlog="block") as pub:
        for s in range(6, 14):
            truth[s] = train(state, gen, density=0.01)
            pub.publish(s)
    return url, truth


def _versions(url: str) -> list[tuple[int, str | None]]:
    out = []
    for s in Store(url).steps():
        doc = json.loads(Store(url).read_bytes(f"{step_dir(s)}/manifest.json"))
        out.append((doc["format_version"], doc.get("digest")))
    return out


def test_a_stream_continued_by_a_new_writer_replays_follows_and_catches_up(mixed, tmp_path):
    url, truth = mixed
    assert _versions(url) == [(1, None)] * 6 + [(3, "blake3")] * 8
    with StreamReader(url) as reader:
        for s in range(14):  # every step, across the change of digest, from the newest anchor before it
            assert states_equal(reader.state_dict(s), truth[s]), s
        way = reader.chain(7, start=4)  # a way from a SHA-256 step into BLAKE3 steps
        assert way[-1] == 7 and reader.manifest(way[0]).format_version in (1, 3)
        rep = reader.replica(4)
        reader.catch_up(rep, 7)
        assert states_equal(rep.state_dict(), truth[7])
    follower = Follower(url, StateDictTarget())  # not started: this test drives it
    try:
        follower.sync(5)  # held at an old step (SHA-256), then on across the change of digest
        follower.sync(13)
        assert follower.step == 13 and states_equal(follower.target.state_dict(), truth[13])
    finally:
        follower.close()
    # catch-ups written with BLAKE3 (catch-up manifest version 2), from SHA-256 objects (0 -> 4) and BLAKE3 ones
    # (8 -> 12); the new writer's first step is an anchor without a delta, so nothing joins 4 and 8
    write_catchups(url, options=CatchupOptions(distances=(4,), consumers=False))
    assert {(e.base_step, e.step) for e in Store(url).catchup_entries()} == {(0, 4), (8, 12)}
    for base, step in ((0, 4), (8, 12)):
        m, _, _ = Store(url).catchup_record(step, base)
        assert (m.format_version, m.digest) == (2, "blake3")
        with StreamReader(url) as reader:
            rep = reader.replica(base)
            assert reader.catch_up(rep, step + 1)[0] == step  # through the catch-up
            assert states_equal(rep.state_dict(), truth[step + 1])


def test_a_node_cache_serves_both_versions(mixed, tmp_path):
    url, truth = mixed
    fs = fsspec.filesystem("memory")
    remote = f"memory://digest-{uuid.uuid4().hex}"
    fs.put(url, remote.removeprefix("memory://"), recursive=True)
    try:
        node = NodeCache(tmp_path / "node")
        for _ in range(2):
            with StreamReader(remote, node_cache=node) as reader:
                assert states_equal(reader.state_dict(13), truth[13])
                assert states_equal(reader.state_dict(5), truth[5])
        names = sorted((tmp_path / "node" / "objects").iterdir())
        assert any(p.name.startswith("blake3-") for p in names) and any(len(p.name) == 64 for p in names)
        assert node.hits >= node.downloads > 0
    finally:
        fs.rm(remote.removeprefix("memory://"), recursive=True)


def test_a_corrupt_byte_in_a_new_version_object_is_a_corrupt_object_error(mixed):
    url, _ = mixed
    store = Store(url)
    m = store.manifest(9)
    assert m.format_version == 3
    path = store.transport.local_path(f"{step_dir(9)}/{m.object}")
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError, match="step 9 .* digest blake3:.* differs from the manifest's blake3:") as e:
        StreamReader(url).open(9)
    assert e.value.found == "blake3:" + blake3.blake3(bytes(data)).hexdigest()
    # what and where as attributes too (errors.CONTEXT), for programs that do not parse messages
    assert (e.value.url, e.value.step, e.value.key, e.value.expected) == (url, 9, m.object, m.object_digest)
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data) + b"\0")  # one byte more: the size, before any hashing
    with pytest.raises(CorruptObjectError, match="step 9 .* bytes, manifest says") as e:
        StreamReader(url).open(9)
    assert (e.value.url, e.value.step, e.value.expected, e.value.found) == (url, 9, m.object_bytes, len(data) + 1)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda m: {**m, "digest": "sha3"},
     r"\$.digest: digest 'sha3' is not one this reader knows \(expected one of sha256, blake3\)"),
    (lambda m: {k: v for k, v in m.items() if k != "digest"},
     r"\$.digest: format version 3 names its digest, expected one of blake3, got none"),
    (lambda m: {**m, "digest": "sha256"}, r"\$.digest: format version 3 names 'sha256'"),
    (lambda m: {**m, "object_digest": "sha256:" + m["object_digest"][7:]},
     r"\$.object_digest: expected 'blake3:<64 hex>' \(the manifest's digest\), got 'sha256:"),
    (lambda m: {**m, "format_version": 1}, r"\$.digest: format version 1 digests with SHA-256 and names no digest"),
    (lambda m: {**{k: v for k, v in m.items() if k != "object_digest"}, "object_sha256": "0" * 64},
     r"\$.object_digest: format version 3 names each object's blake3 digest \(object_digest\), got object_sha256"),
])
def test_a_manifest_naming_a_digest_wrongly_is_refused_by_name(mixed, edit, match):
    """Each a FormatError naming the field, what was expected and what arrived; never read as another version."""
    url, _ = mixed
    store = Store(url)
    rel = f"{step_dir(9)}/manifest.json"
    store.write_bytes(rel, json.dumps(edit(json.loads(store.read_bytes(rel)))).encode())
    with pytest.raises(FormatError, match=match):
        Manifest.from_json(store.read_bytes(rel), where=rel)
    with pytest.raises(FormatError, match=match):
        StreamReader(url).manifest(9)
