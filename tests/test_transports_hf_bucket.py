"""The HF bucket transport's calls. The bucket API has no emulator: a recording fake checks how it is called;
tests/integration/test_hf_bucket.py runs the full store contract on the real Hub when a token is set."""

from __future__ import annotations

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


def test_hf_bucket_urls_get_the_bucket_transport():
    store = Store("hf://buckets/team/runs/run-7")
    assert isinstance(store.transport, HfBucketTransport) and store.transport.bucket_id == "team/runs"
    assert not store.transport.capabilities.create_only and not store.transport.capabilities.compare_and_swap
