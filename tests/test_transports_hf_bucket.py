"""The HF bucket transport's calls. The bucket API has no emulator: a recording fake checks how it is called;
tests/integration/test_hf_bucket.py runs the full store contract on the real Hub when a token is set."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from deltasync.errors import StoreError  # noqa: E402
from deltasync.store import Store  # noqa: E402
from deltasync.transports import HfBucketTransport  # noqa: E402


class FakeBucketApi:
    """Records calls; keeps files in a dict like a bucket would."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.files: dict[str, bytes] = {}

    def batch_bucket_files(self, bucket_id, *, add=None, copy=None, delete=None, token=None):
        self.calls.append(("batch", bucket_id, [(type(src).__name__, dest) for src, dest in add or []]))
        for src, dest in add or []:
            self.files[dest] = src if isinstance(src, bytes) else Path(src).read_bytes()

    def get_bucket_paths_info(self, bucket_id, paths, *, token=None):
        from huggingface_hub import BucketFile

        self.calls.append(("info", bucket_id, list(paths)))
        return [BucketFile(type="file", path=p, size=len(self.files[p]), xetHash="0" * 64) for p in paths
                if p in self.files]

    def download_bucket_files(self, bucket_id, files, *, raise_on_missing_files=False, token=None):
        """As huggingface_hub's: a name is looked up (its own request), a ``BucketFile`` is downloaded as given."""
        from huggingface_hub.errors import EntryNotFoundError

        self.calls.append(("download", bucket_id, [r if isinstance(r, str) else ("listed", r.path) for r, _ in files],
                           raise_on_missing_files))
        for remote, local in files:
            remote = remote if isinstance(remote, str) else remote.path
            if remote not in self.files:
                if raise_on_missing_files:
                    raise EntryNotFoundError(f"1 file(s) not found in bucket '{bucket_id}': {remote}")
                continue
            Path(local).write_bytes(self.files[remote])


class NoCacheFs:
    def invalidate_cache(self, path=None):
        pass


@pytest.fixture
def bucket():
    t = HfBucketTransport(NoCacheFs(), "buckets/team/runs/run-7", {})
    t.api = FakeBucketApi()
    return t


def test_bucket_url_is_parsed():
    with pytest.raises(StoreError, match="hf://buckets/<namespace>/<name>"):
        HfBucketTransport(NoCacheFs(), "buckets/only-namespace", {})


def test_objects_upload_from_files_in_their_own_batch(bucket, tmp_path):
    obj = tmp_path / "delta.safetensors"
    obj.write_bytes(b"x" * 100)
    bucket.put("steps/000000000003/delta.safetensors", obj)
    bucket.put("steps/000000000003/manifest.json", b"{}")
    bucket.put("latest.json", memoryview(b"{}"))
    assert bucket.api.calls == [
        ("batch", "team/runs", [("str", "run-7/steps/000000000003/delta.safetensors")]),  # from a file, not bytes
        ("batch", "team/runs", [("bytes", "run-7/steps/000000000003/manifest.json")]),  # the commit, after
        ("batch", "team/runs", [("bytes", "run-7/latest.json")]),
    ]
    assert bucket.api.files["run-7/steps/000000000003/delta.safetensors"] == b"x" * 100


def test_a_bucket_root_has_no_prefix(tmp_path):
    t = HfBucketTransport(NoCacheFs(), "buckets/team/runs", {})
    t.api = FakeBucketApi()
    t.put("latest.json", b"{}")
    assert t.api.calls == [("batch", "team/runs", [("bytes", "latest.json")])]


def test_downloads_never_skip_a_missing_file(bucket, tmp_path):
    bucket.api.files["run-7/a"] = b"data"
    bucket.get_file("a", tmp_path / "a")
    assert (tmp_path / "a").read_bytes() == b"data"
    with pytest.raises(FileNotFoundError):
        bucket.get_file("missing", tmp_path / "m")
    assert all(call[3] is True for call in bucket.api.calls if call[0] == "download")
    with pytest.raises(ValueError, match="not a store key"):
        bucket.put("../other/x", tmp_path / "a")


def test_a_bounded_download_reads_the_listed_size_first(bucket, tmp_path):
    """With ``max_bytes`` the file's listing (the lookup ``download_bucket_files`` makes itself for a name: no extra
    request) refuses a larger file before any byte moves; a file within the bound is downloaded as listed."""
    from deltasync.errors import CorruptObjectError

    bucket.api.files["run-7/steps/000000000001/delta.safetensors"] = b"d" * 5000
    with pytest.raises(CorruptObjectError, match="5000 bytes, more than the 100 expected") as e:
        bucket.get_file("steps/000000000001/delta.safetensors", tmp_path / "d", max_bytes=100)
    assert (e.value.key, e.value.expected, e.value.found) == ("steps/000000000001/delta.safetensors", 100, 5000)
    assert not (tmp_path / "d").exists()
    assert [c[0] for c in bucket.api.calls] == ["info"]
    bucket.api.calls.clear()
    bucket.get_file("steps/000000000001/delta.safetensors", tmp_path / "d", max_bytes=5000)
    assert (tmp_path / "d").read_bytes() == b"d" * 5000
    assert bucket.api.calls == [
        ("info", "team/runs", ["run-7/steps/000000000001/delta.safetensors"]),
        ("download", "team/runs", [("listed", "run-7/steps/000000000001/delta.safetensors")], True),
    ]
    with pytest.raises(FileNotFoundError):
        bucket.get_file("missing", tmp_path / "m", max_bytes=10)


def test_hf_bucket_urls_get_the_bucket_transport():
    store = Store("hf://buckets/team/runs/run-7")
    assert isinstance(store.transport, HfBucketTransport) and store.transport.bucket_id == "team/runs"
    assert not store.transport.capabilities.create_only and not store.transport.capabilities.compare_and_swap


class HubEvents(BaseHTTPRequestHandler):
    """The Hub's bucket event feed as huggingface_hub documents it (``GET /api/buckets/{id}/events``, server-sent
    events: ``ready``, ``changes``), for one bucket; and ``GET /api/buckets/{id}`` (``updatedAt``)."""

    protocol_version = "HTTP/1.1"
    changes: list[dict] = []
    paths: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        HubEvents.paths.append(self.path.split("?")[0])
        if self.path.split("?")[0] == "/api/buckets/ns/bkt":
            body = json.dumps({"updatedAt": "2026-11-26T00:00:00Z"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path.split("?")[0] != "/api/buckets/ns/bkt/events":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'event: ready\ndata: {"cursor": "c0"}\n\n')
        batch = {"cursor": "c1", "changes": HubEvents.changes}
        self.wfile.write(f"event: changes\ndata: {json.dumps(batch)}\n\n".encode())
        self.wfile.flush()
        time.sleep(2)


def test_a_buckets_event_feed_pushes_the_streams_new_manifests_only():
    """Only a manifest added or updated under this stream's steps/<12 digits>/ is a step; the feed is the Hub's own
    client (huggingface_hub's BucketFollower) against a loopback stand-in for the Hub's endpoint."""
    from deltasync.transports.hf_bucket import BucketEvents
    from tests.http_server import serving

    HubEvents.paths = []
    HubEvents.changes = [
        {"path": "run/steps/000000000003/manifest.json", "op": "add"},
        {"path": "run/steps/000000000007/delta.dsd", "op": "add"},  # an object: not a commit
        {"path": "other/steps/000000000009/manifest.json", "op": "add"},  # another stream of the bucket
        {"path": "run/steps/12/manifest.json", "op": "add"},  # not a step folder
        {"path": "run/steps/000000000005/manifest.json", "op": "delete"},  # gc
        {"path": "run/steps/000000000002/manifest.json\n", "op": "add"},  # names match whole
        {"path": "run/latest.json", "op": "update"},
    ]
    with serving(HubEvents) as endpoint:
        events = BucketEvents(endpoint, "ns/bkt", "run", token=False)
        try:
            got: list[int] = []
            events.subscribe(got.append)
            deadline = time.monotonic() + 30
            while got != [3] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert got == [3] and events.alive
        finally:
            events.close()
    assert "/api/buckets/ns/bkt/events" in HubEvents.paths
