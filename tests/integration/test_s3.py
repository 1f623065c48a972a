"""Every store test against a real S3 server (SeaweedFS on loopback), and the faults users meet."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import CorruptObjectError, PublishError
from deltasync.store import Store, step_dir
from deltasync.testing.store_contract import StoreContract
from rollout_loader import Follower, PollPolicy, StateDictTarget
from tests.conftest import perturb, states_equal
from tests.integration.seaweedfs import private_s3_server, s3_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.s3


class TestS3Store(StoreContract):
    @pytest.fixture(autouse=True)
    def _server(self, s3_server):  # noqa: F811
        self.server = s3_server
        self.storage_options = s3_server.storage_options

    def make_url(self, tmp_path) -> str:
        return self.server.new_url()


def _state(step: int) -> dict[str, torch.Tensor]:
    """The trainer's state at ``step``, computable by any process (for kill tests)."""
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(200_000, generator=g).bfloat16(), "b": torch.randn(512, generator=g).bfloat16()}
    g.manual_seed(1000 + step)
    return {k: perturb(v, 0.02, g) for k, v in base.items()}


def test_corrupt_object_on_s3_is_detected_and_consumer_recovers(s3_server):  # noqa: F811
    url = s3_server.new_url()
    opts = s3_server.storage_options
    with DeltaPublisher(url, _state(0), anchor_every=3, on_backlog="block", storage_options=opts) as pub:
        for s in range(5):
            pub.source = _state(s)
            pub.publish(s)
    store = Store(url, storage_options=opts)
    m = store.manifest(1)
    store.write_bytes(f"{step_dir(1)}/{m.object}", b"x" * m.object_bytes)  # overwritten behind our back
    target = StateDictTarget()
    follower = Follower(url, target, storage_options=opts)
    follower.sync(0)
    with pytest.raises(CorruptObjectError, match="step 1 .*digest blake3:.* differs from the manifest"):
        follower.sync(2)
    assert target.step == 0 and states_equal(target.state_dict(), _state(0))
    assert follower.sync() == [3, 4]  # recovered from the next good anchor
    assert states_equal(target.state_dict(), _state(4))


def test_server_outage_mid_upload_then_restart(private_s3_server):  # noqa: F811
    """The S3 server stops while step 3 uploads and comes back: no partial step is ever visible, the
    consumer keeps serving its last good step, and the publisher's retries complete the upload."""
    server = private_s3_server
    restart = threading.Timer(2.0, server.start)
    try:
        url = server.new_url()
        opts = server.storage_options
        store = Store(url, storage_options=opts, retries=8, retry_base_s=0.5)
        outage = threading.Event()
        original = store.transport.put

        def put(key, data, **conditions):
            if key.startswith("steps/000000000003/") and key.endswith(".safetensors") and not outage.is_set():
                outage.set()
                server.stop(crash=True)  # the server dies during this upload
                restart.start()
            return original(key, data, **conditions)

        store.transport.put = put
        target = StateDictTarget()
        follower = Follower(url, target, policy=PollPolicy(fast_s=0.2), storage_options=opts)
        with DeltaPublisher(store, _state(0), on_backlog="block") as pub:
            for s in range(3):
                pub.source = _state(s)
                pub.publish(s)
            pub.flush()
            follower.sync()
            assert target.step == 2
            follower.start()
            pub.source = _state(3)
            pub.publish(3)
            seen_during_outage = []
            while pub._queue.unfinished_tasks:
                seen_during_outage.append(target.step)
                time.sleep(0.1)
            pub.flush()
        assert outage.is_set() and set(seen_during_outage) <= {2, 3}
        follower.wait_for(3, timeout_s=60)
        follower.close()
        with StreamReader(url, storage_options=opts) as reader:
            assert reader.steps() == [0, 1, 2, 3]
            for s in range(4):
                assert states_equal(reader.state_dict(s), _state(s))
        assert states_equal(target.state_dict(), _state(3))
    finally:
        restart.cancel()
        restart.join()


def test_outage_longer_than_retries_is_a_clear_error(private_s3_server):  # noqa: F811
    server = private_s3_server
    url = server.new_url()
    store = Store(url, storage_options=server.storage_options, retries=1, retry_base_s=0.05)
    pub = DeltaPublisher(store, _state(0), on_backlog="block")
    pub.publish(0)
    pub.flush()
    server.stop(crash=True)
    pub.source = _state(1)
    pub.publish(1)
    with pytest.raises(PublishError, match="failed after 2 attempts"):
        pub.flush()
    server.start()
    store.retries, store.retry_base_s = 6, 0.5  # a restarted server needs a moment before it serves
    pub.source = _state(2)
    pub.publish(2)  # the next step is an anchor: the stream stays replayable
    pub.close()
    reader = StreamReader(url, storage_options=server.storage_options)
    assert reader.steps() == [0, 2] and reader.manifest(2).kind == "anchor"
    assert states_equal(reader.state_dict(2), _state(2))


CONSUMER = textwrap.dedent(
    """
    import sys, json
    from rollout_loader import Follower, PollPolicy, StateDictTarget
    url, opts, cache = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    from deltasync import StreamReader
    f = Follower(StreamReader(url, storage_options=opts, cache_dir=cache), StateDictTarget())
    print("start", flush=True)
    while True:
        f.sync()
    """
)


def test_consumer_killed_mid_fetch_restarts_and_converges(s3_server, tmp_path):  # noqa: F811
    import json

    url = s3_server.new_url()
    opts = s3_server.storage_options
    big = {"w": torch.randn(4_000_000).bfloat16()}
    with DeltaPublisher(url, big, anchor_every=100, storage_options=opts) as pub:
        for s in range(4):
            big["w"].copy_(perturb(big["w"], 0.05, torch.Generator().manual_seed(s)))
            pub.publish(s)
    want = {k: v.clone() for k, v in big.items()}
    cache = tmp_path / "cache"
    cache.mkdir()
    for delay in (0.3, 0.8, 1.5):
        proc = subprocess.Popen([sys.executable, "-c", CONSUMER, url, json.dumps(opts), str(cache)],
                                stdout=subprocess.PIPE)
        proc.stdout.readline()
        time.sleep(delay)
        proc.kill()
        proc.wait()
    # a download cut short leaves at most a part file or a wrong file in the cache: never used
    (cache / f"{3:012d}-delta.safetensors").write_bytes(b"partial")
    target = StateDictTarget(verify="full")
    Follower(StreamReader(url, storage_options=opts, cache_dir=cache), target).sync()
    assert target.step == 3 and states_equal(target.state_dict(), want)


def test_mirror_from_s3_to_a_folder_and_back_to_s3(s3_server, tmp_path):  # noqa: F811
    """A mirror across backends: S3 -> a local folder (objects downloaded, checked, committed there) -> another
    S3 prefix (streamed from the folder's own files, which stay in place); every copy replays bit-exactly."""
    from deltasync import verify
    from deltasync.history.mirror import mirror

    opts = s3_server.storage_options
    src, local, again = s3_server.new_url(), str(tmp_path / "copy"), s3_server.new_url()
    with DeltaPublisher(src, _state(0), anchor_every=3, on_backlog="block", storage_options=opts) as pub:
        for s in range(5):
            pub.source = _state(s)
            pub.publish(s)
    assert mirror(src, local, src_options=opts).copied == (0, 1, 2, 3, 4)
    assert mirror(local, again, dst_options=opts).copied == (0, 1, 2, 3, 4)
    assert Store(local).manifest(3).delta is not None  # the anchor's own delta came along
    for url, o in ((local, None), (again, opts)):
        assert verify(url, storage_options=o).ok
        assert states_equal(StreamReader(url, storage_options=o).state_dict(4), _state(4))
    assert verify(local).ok  # the folder's objects were not moved away by the second mirror


def test_writes_whose_reply_was_lost_are_not_conflicts(s3_server):  # noqa: F811
    """(issue 19, item 13) A proxy forwards the first write of the lease, of every manifest and of the hint, then
    answers 503 as if the reply were lost: the store retries, finds its own bytes there (412 on the create-only
    write), and counts the write done. The publisher finishes every step; a follower ends bit-exact."""
    from tests.integration.counting_proxy import counting_proxy

    url, opts = s3_server.new_url(), s3_server.storage_options
    seen: set[str] = set()

    def lose(req) -> bool:
        if req.method != "PUT" or not req.path.endswith(("writer.json", "manifest.json", "latest.json")):
            return False
        first = req.path not in seen
        seen.add(req.path)
        return first

    with counting_proxy(opts["client_kwargs"]["endpoint_url"]) as proxy:
        proxy.lose = lose
        via = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy.url}}
        with DeltaPublisher(url, _state(0), anchor_every=3, on_backlog="block", storage_options=via) as pub:
            for s in range(5):
                pub.source = _state(s)
                pub.publish(s)
    lost = {r.path.rsplit("/", 2)[-2:][-1] if "steps" not in r.path else "manifest" for r in proxy.lost}
    assert {"writer.json", "manifest", "latest.json"} <= lost, proxy.lost
    assert sum(r.path.endswith("manifest.json") for r in proxy.lost) == 5  # every commit's reply was lost once
    target = StateDictTarget()
    follower = Follower(url, target, storage_options=opts)
    assert follower.sync() == [3, 4]
    assert states_equal(target.state_dict(), _state(4))
    follower.close()
    assert StreamReader(url, storage_options=opts).steps() == [0, 1, 2, 3, 4]


def test_an_object_swapped_for_a_huge_one_is_refused_from_its_content_length(s3_server, tmp_path,  # noqa: F811
                                                                            monkeypatch):
    """docs/SECURITY.md's bucket writer replaces step 1's object by one 8 MiB larger than its manifest says: the
    follower's one GET is refused from the response's Content-Length before a byte of its body is written (no
    partial file at all), and not retried; the CorruptObjectError names the stream, the step, the object and both
    sizes; nothing is left in the cache, and the next good anchor (step 3) applies bit-exactly. Twelve refusals in a
    row (more than the client's pool of ten connections) leave downloads working: each refused response is closed."""
    import os
    from pathlib import Path

    import deltasync.follow.reader
    from deltasync.store.scratch import OWNER_LOCK
    from tests.integration.counting_proxy import counting_proxy

    monkeypatch.setattr(deltasync.follow.reader, "MEMORY_OBJECT_BYTES", 0)  # every object through the download
    written: list[int] = []  # what each partial download held when it was deleted
    unlink = Path.unlink

    def observed(self: Path, missing_ok: bool = False) -> None:
        if self.name.endswith(".part") and self.exists():
            written.append(self.stat().st_size)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", observed)
    url, opts = s3_server.new_url(), s3_server.storage_options
    with DeltaPublisher(url, _state(0), anchor_every=3, on_backlog="block", storage_options=opts) as pub:
        for s in range(5):
            pub.source = _state(s)
            pub.publish(s)
    store = Store(url, storage_options=opts)
    m = store.manifest(1)
    size = m.objects[0].object_bytes
    store.write_bytes(f"{step_dir(1)}/{m.object}", os.urandom(size + (8 << 20)))
    cache = tmp_path / "cache"
    target = StateDictTarget()
    with counting_proxy(opts["client_kwargs"]["endpoint_url"]) as proxy:
        through = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy.url}}
        with StreamReader(url, storage_options=through, cache_dir=cache) as reader:
            follower = Follower(reader, target)
            follower.sync(0)
            proxy.take()
            with pytest.raises(CorruptObjectError, match=rf"step 1 object {m.object}: {size + (8 << 20)} bytes, "
                                                         rf"manifest says {size} \(more than it says") as e:
                follower.sync(2)
            assert (e.value.url, e.value.step, e.value.key, e.value.expected, e.value.found) == (
                reader.store.url, 1, m.object, size, size + (8 << 20))
            assert [r.method for r in proxy.take() if r.path.endswith(m.object)] == ["GET"]
            assert written == [] and [p.name for p in cache.iterdir() if p.name != OWNER_LOCK] == []
            for _ in range(12):
                with pytest.raises(CorruptObjectError, match="more than it says"):
                    reader.store.fetch_object(m)
            assert follower.sync() == [3, 4]
            assert states_equal(target.state_dict(), _state(4))
    assert written == []
