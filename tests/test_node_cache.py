"""The host's shared download cache (deltasync/store/node_cache.py): each object fetched once per host, by real
processes at once; bounded in bytes; nothing found there is trusted; a bad configuration is refused.

The multi-reader S3 case (object GETs counted at a proxy in front of SeaweedFS) is in
tests/integration/test_follow_requests.py."""

from __future__ import annotations

import errno
import hashlib
import logging
import multiprocessing as mp
import os
import shutil
import threading
import uuid
from pathlib import Path

import fsspec
import pytest

from deltasync import NodeCache, StreamReader
from deltasync.errors import ConfigError, CorruptObjectError
from deltasync.store import step_dir
from deltasync.store.node_cache import node_cache_from_env
from tests import test_reader
from tests.conftest import states_equal

# the fixture: a stream on a remote store, 7 steps, anchors every 3 (bound here, so pytest finds it)
remote = test_reader.remote

CTX = mp.get_context("fork")  # the peers need no fresh interpreter: forked, they start at once (POSIX, as flock)


def _fetch_in_process(folder: str, digest: str, payload: bytes, dest: str, log: str, go) -> None:
    """One process of the host: wait for the others, then fetch the object (slowly), recording each download."""
    cache = NodeCache(folder, max_bytes=1 << 20)

    def download(path: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        import time

        time.sleep(0.3)  # long enough for every other process to arrive meanwhile
        path.write_bytes(payload)

    def check(path: Path) -> None:
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest.removeprefix("sha256:"):
            raise CorruptObjectError("bad bytes")

    go.wait(60)
    cache.fetch(digest, len(payload), Path(dest), download, check)


def test_processes_of_one_host_download_an_object_once(tmp_path):
    payload = os.urandom(100_000)
    digest = "sha256:" + hashlib.sha256(payload).hexdigest()
    log = tmp_path / "downloads.log"
    go = CTX.Event()
    procs = [CTX.Process(target=_fetch_in_process,
                         args=(str(tmp_path / "node"), digest, payload, str(tmp_path / f"dest{i}"), str(log), go))
             for i in range(4)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert len(log.read_text().split()) == 1  # one process downloaded; the three others found it
    for i in range(4):
        assert (tmp_path / f"dest{i}").read_bytes() == payload
    assert sorted(os.listdir(tmp_path / "node" / "tmp")) == []  # no half file left


def test_two_readers_share_downloads_and_end_exact(remote, tmp_path):
    url, truth = remote
    node = NodeCache(tmp_path / "node")
    with StreamReader(url, node_cache=node) as a, StreamReader(url, node_cache=node) as b:
        assert states_equal(a.state_dict(6), truth[6])
        first = node.downloads
        assert first == len(a.chain(6)) and node.hits == 0
        assert states_equal(b.state_dict(6), truth[6])
        assert node.downloads == first and node.hits == first  # the second reader downloaded nothing
    assert len(os.listdir(tmp_path / "node" / "objects")) == first  # kept for the host's next reader


def test_small_objects_read_into_memory_are_shared_too(remote, tmp_path, monkeypatch):
    monkeypatch.undo()  # default: small deltas are read into memory, not through a file
    url, truth = remote
    node = NodeCache(tmp_path / "node")
    for _ in range(2):
        with StreamReader(url, node_cache=node) as reader:
            assert states_equal(reader.state_dict(5), truth[5])
    assert node.hits == node.downloads == len(StreamReader(url).chain(5))


def test_a_damaged_cached_object_is_dropped_and_downloaded_again(remote, tmp_path):
    url, truth = remote
    node = NodeCache(tmp_path / "node")
    with StreamReader(url, node_cache=node) as reader:
        reader.state_dict(6)
    for path in (tmp_path / "node" / "objects").iterdir():  # flip a bit in every cached object
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    before = node.downloads
    with StreamReader(url, node_cache=node) as reader:
        assert states_equal(reader.state_dict(6), truth[6])
    assert node.downloads == 2 * before and node.hits == 0


def test_the_cache_stays_within_its_byte_bound(remote, tmp_path):
    url, truth = remote
    with StreamReader(url) as plain:
        sizes = [plain.manifest(s).object_bytes for s in range(7)]
    bound = max(sizes) + min(sizes)
    node = NodeCache(tmp_path / "node", max_bytes=bound)
    with StreamReader(url, node_cache=node) as reader:
        for s in range(7):
            assert states_equal(reader.state_dict(s), truth[s])
            assert node.size_bytes() <= bound


def test_a_digest_from_a_manifest_must_be_a_digest(tmp_path):
    node = NodeCache(tmp_path / "node")
    for bad in ("../../etc/passwd", "A" * 64, "a" * 63, "a" * 64 + "\n", "a" * 64, "sha256:" + "a" * 63,
                "blake3:" + "a" * 64 + "\n", "md5:" + "a" * 64, "blake3-" + "a" * 64):
        with pytest.raises(CorruptObjectError, match="expected a digest 'sha256:<64 hex>' or 'blake3:<64 hex>'"):
            node.read(bad, 1, lambda: b"x", lambda data: None)
    assert os.listdir(tmp_path / "node" / "objects") == []


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots"])
def test_a_bad_byte_bound_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv("DELTASYNC_NODE_CACHE", str(tmp_path / "node"))
    monkeypatch.setenv("DELTASYNC_NODE_CACHE_BYTES", value)
    with pytest.raises(ConfigError,
                       match=f"DELTASYNC_NODE_CACHE_BYTES: expected a positive number of bytes, got '{value}'"):
        node_cache_from_env()


def test_the_environment_names_the_cache_of_remote_stores_only(remote, tmp_path, monkeypatch):
    url, _ = remote
    monkeypatch.setenv("DELTASYNC_NODE_CACHE", str(tmp_path / "node"))
    monkeypatch.setenv("DELTASYNC_NODE_CACHE_BYTES", "1e9")
    with StreamReader(url) as reader:
        assert reader.store.node_cache is not None and reader.store.node_cache.max_bytes == 10**9
    with StreamReader(str(tmp_path / "local")) as reader:
        assert reader.store.node_cache is None  # a local store is read in place
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DELTASYNC_NODE_CACHE", str(blocker))
    with pytest.raises(ConfigError, match="cannot use .* as the node cache"):
        StreamReader(url)


def test_step_objects_are_keyed_by_content_not_name(remote, tmp_path):
    """Two streams holding the same bytes share them; the file name in the cache is the digest alone."""
    url, _ = remote
    node = NodeCache(tmp_path / "node")
    with StreamReader(url, node_cache=node) as reader:
        reader.state_dict(0)
        digest = NodeCache.file_name(reader.manifest(0).objects[0].digest)
    fs = fsspec.filesystem("memory")
    copy = f"memory://node-copy-{uuid.uuid4().hex}"
    fs.cp(url.removeprefix("memory://"), copy.removeprefix("memory://"), recursive=True)
    try:
        with StreamReader(copy, node_cache=node) as reader:
            reader.state_dict(0)
        assert os.listdir(tmp_path / "node" / "objects") == [digest] and node.hits == 1
        assert fs.exists(f"{copy.removeprefix('memory://')}/{step_dir(0)}")
    finally:
        fs.rm(copy.removeprefix("memory://"), recursive=True)


# --- issue 30 items 10-12: the cache folder is this user's, nothing is followed, nothing blocks, a broken cache
# costs the sharing only ---


def test_a_foreign_or_unsafe_cache_folder_is_refused(tmp_path):
    """A world-writable folder lets any user of the host plant links in it: refused, naming the fix."""
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        NodeCache(folder)
    folder.chmod(0o700)
    (folder / "objects").mkdir(mode=0o777)
    (folder / "objects").chmod(0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        NodeCache(folder)
    made = NodeCache(tmp_path / "new")  # made by the cache: this user's, 0700 whatever the umask
    for sub in ("", "objects", "locks", "tmp"):
        st = os.stat(made.folder / sub)
        assert st.st_uid == os.getuid() and st.st_mode & 0o077 == 0, sub


@pytest.mark.parametrize("into", ["memory", "file"])
def test_a_link_planted_in_the_cache_is_never_followed(tmp_path, remote, monkeypatch, into):
    """A symlink at the temporary path a read writes to (or at an object's path) makes no write land elsewhere and
    no read come from elsewhere, whether the object is read into memory or into a file."""
    if into == "memory":
        monkeypatch.undo()  # the fixture sends every object through a file; by default small deltas are read
    url, truth = remote
    node = NodeCache(tmp_path / "node")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    with StreamReader(url) as plain:
        m = plain.manifest(5)
    digest = NodeCache.file_name(m.objects[0].digest)
    os.symlink(victim, node.folder / "tmp" / f"{digest}.{os.getpid()}.part")
    with StreamReader(url, node_cache=node) as reader:
        assert states_equal(reader.state_dict(5), truth[5])
    assert victim.read_text() == "precious"
    assert not (node.folder / "objects" / digest).is_symlink()
    (node.folder / "objects" / digest).unlink()
    os.symlink(victim, node.folder / "objects" / digest)  # a link where the object belongs: not read through
    reads: list[str] = []
    real_open = open

    def watched(path, *args, **kwargs):  # noqa: ANN001
        reads.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watched)
    with StreamReader(url, node_cache=node) as reader:
        assert states_equal(reader.state_dict(5), truth[5])
    monkeypatch.undo()
    assert str(victim) not in reads and victim.read_text() == "precious"


@pytest.mark.parametrize("into", ["memory", "file"])
def test_a_special_file_in_the_cache_blocks_nothing(tmp_path, remote, monkeypatch, into):
    """A FIFO at an object's cache path is not opened for reading (that blocks, holding the stripe's lock):
    dropped, downloaded again."""
    if into == "memory":
        monkeypatch.undo()
    url, truth = remote
    node = NodeCache(tmp_path / "node")
    with StreamReader(url) as plain:
        digests = [NodeCache.file_name(plain.manifest(s).objects[0].digest) for s in plain.chain(5)]
    for d in digests:
        os.mkfifo(node.folder / "objects" / d)
    done = threading.Event()
    result: list[object] = []

    def read() -> None:
        try:
            with StreamReader(url, node_cache=node) as reader:
                result.append(states_equal(reader.state_dict(5), truth[5]))
        except BaseException as e:  # noqa: BLE001 - reported below
            result.append(e)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(60):  # a blocked open would hang for ever: unblock it, then fail
        for d in digests:
            try:
                fd = os.open(node.folder / "objects" / d, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            except OSError:
                pass
        done.wait(10)
        pytest.fail("a read blocked on a FIFO in the node cache")
    assert result == [True], result


@pytest.mark.parametrize("breakage", ["tmp removed", "objects removed", "locks removed", "disk full"])
def test_a_broken_or_full_cache_falls_back_to_the_store_and_says_so_once(tmp_path, remote, caplog, monkeypatch,
                                                                          breakage):
    url, truth = remote
    monkeypatch.undo()  # small deltas read into memory too: both ways through the cache
    node = NodeCache(tmp_path / "node")
    if breakage == "disk full":
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("deltasync.store.node_cache._write_new", full)  # deltas read into memory
        monkeypatch.setattr("deltasync.store.node_cache._link_or_copy", full)  # anchors downloaded to a file
    else:
        shutil.rmtree(node.folder / breakage.split()[0])
    with caplog.at_level(logging.WARNING, logger="deltasync.store.node_cache"):
        for _ in range(2):
            with StreamReader(url, node_cache=node) as reader:
                assert states_equal(reader.state_dict(5), truth[5])  # an anchor and two deltas
    said = [r for r in caplog.records if r.name == "deltasync.store.node_cache"]
    assert len(said) == 1 and "reading from the store" in said[0].getMessage(), [r.getMessage() for r in said]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to make another user's folder")
def test_another_users_folder_or_link_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to uid 4242"):
        NodeCache(folder)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, 4242, 4242)  # a link another user planted, pointing at a folder of ours
    with pytest.raises(ConfigError, match="a link another user made"):
        NodeCache(link)


def test_two_algorithms_never_share_a_cached_object(tmp_path):
    """A SHA-256 and a BLAKE3 digest with the same 64 hex digits (a bucket writer who names a BLAKE3 step's object
    by another object's SHA-256 hex, or the reverse) are two keys: neither read is served the other's bytes."""
    node = NodeCache(tmp_path / "node")
    same = "ab" * 32
    first = node.read(f"sha256:{same}", 5, lambda: b"first", lambda data: None)
    served: list[bytes] = []

    def check(data: bytes) -> None:
        served.append(data)
        if data != b"other":
            raise CorruptObjectError("not the BLAKE3 object")

    second = node.read(f"blake3:{same}", 5, lambda: b"other", check)
    assert (first, second) == (b"first", b"other") and served == [b"other"]  # never offered the SHA-256 one
    assert sorted(os.listdir(node.folder / "objects")) == [same, f"blake3-{same}"]
    assert NodeCache.file_name(f"sha256:{same}") == same  # caches written before BLAKE3 keep their entries
