"""Backend-specific calls. The HF bucket API has no emulator: a recording fake checks how it is called;
tests/integration/test_hf_bucket.py runs the full store contract on the real Hub when a token is set."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltasync.errors import CorruptObjectError, StoreError
from deltasync.store import Manifest, Store, sha256_file
from deltasync.transports import FsspecTransport, HfBucketTransport, LocalTransport, transient_errors


class FakeBucketApi:
    """Records calls; keeps files in a dict like a bucket would."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.files: dict[str, bytes] = {}

    def batch_bucket_files(self, bucket_id, *, add=None, copy=None, delete=None, token=None):
        self.calls.append(("batch", bucket_id, [(type(src).__name__, dest) for src, dest in add or []]))
        for src, dest in add or []:
            self.files[dest] = src if isinstance(src, bytes) else Path(src).read_bytes()

    def download_bucket_files(self, bucket_id, files, *, raise_on_missing_files=False, token=None):
        from huggingface_hub.errors import EntryNotFoundError

        self.calls.append(("download", bucket_id, [r for r, _ in files], raise_on_missing_files))
        for remote, local in files:
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
    bucket.move_in(obj, "buckets/team/runs/run-7/steps/000000000003/delta.safetensors")
    bucket.put_bytes(b"{}", "buckets/team/runs/run-7/steps/000000000003/manifest.json")
    bucket.put_bytes(b"{}", "buckets/team/runs/run-7/latest.json")
    assert bucket.api.calls == [
        ("batch", "team/runs", [("str", "run-7/steps/000000000003/delta.safetensors")]),  # from a file, not bytes
        ("batch", "team/runs", [("bytes", "run-7/steps/000000000003/manifest.json")]),  # the commit, after
        ("batch", "team/runs", [("bytes", "run-7/latest.json")]),
    ]


def test_downloads_never_skip_a_missing_file(bucket, tmp_path):
    bucket.api.files["run-7/a"] = b"data"
    bucket.get_file("buckets/team/runs/run-7/a", tmp_path / "a")
    assert (tmp_path / "a").read_bytes() == b"data"
    with pytest.raises(FileNotFoundError):
        bucket.get_file("buckets/team/runs/run-7/missing", tmp_path / "m")
    assert all(call[3] is True for call in bucket.api.calls if call[0] == "download")
    with pytest.raises(StoreError, match="outside bucket"):
        bucket.move_in(tmp_path / "a", "buckets/other/bucket/x")


def test_a_missing_object_of_a_committed_step_is_corrupt_not_skipped(tmp_path):
    store = Store(f"memory://hf-like-{tmp_path.name}")
    obj = tmp_path / "o"
    obj.write_bytes(b"payload")
    m = Manifest(step=1, base_step=None, kind="anchor", object="anchor.safetensors", object_bytes=7,
                 object_sha256=sha256_file(obj), state_checksum="0" * 64, created_unix_s=0.0)
    store.write_bytes("steps/000000000001/manifest.json", m.to_json().encode())
    with pytest.raises(CorruptObjectError, match="missing, though the step is committed"):
        store.fetch_object(m)


def test_backends_are_chosen_by_protocol(tmp_path):
    assert isinstance(Store(str(tmp_path)).transport, LocalTransport)
    assert isinstance(Store("memory://x").transport, FsspecTransport)


def test_transient_errors_include_http_clients():
    names = {e.__name__ for e in transient_errors()}
    assert {"OSError", "ConnectionError", "HTTPClientError"} <= names


def test_hf_bucket_urls_get_the_bucket_transport():
    store = Store("hf://buckets/team/runs/run-7")
    assert isinstance(store.transport, HfBucketTransport) and store.transport.bucket_id == "team/runs"
