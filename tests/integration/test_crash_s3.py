"""The crash harness of tests/test_crash.py on a real S3 server (SeaweedFS on loopback).

The monitor lists the bucket with s3fs directly: an object's ETag and LastModified change whenever it is
rewritten, so a replaced manifest is seen from the listing alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.seaweedfs import s3_server  # noqa: F401 - fixture
from tests.test_crash import (
    KILLS,
    MANIFEST,
    SEED,
    CrashRun,
    assert_crash_run,
    check_stream,
    crash_publishers,
    crash_timeout_s,
    write_report,
)

pytestmark = pytest.mark.s3

S3_KILLS = KILLS or 12


class S3Manifests:
    """The manifests under an ``s3://`` stream, listed and read with s3fs (not deltasync)."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options)
        self.root = url.removeprefix("s3://").rstrip("/")

    def fingerprints(self) -> dict[int, Any]:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(f"{self.root}/steps", detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            folder, _, name = path.rstrip("/").rpartition("/")
            step = folder.rpartition("/")[2]
            if name == MANIFEST and len(step) == 12 and step.isdigit():
                out[int(step)] = (info.get("ETag"), info.get("size"), str(info.get("LastModified")))
        return out

    def read(self, step: int) -> bytes:
        return self.fs.cat_file(f"{self.root}/steps/{step:012d}/{MANIFEST}")


@pytest.mark.timeout(crash_timeout_s(S3_KILLS, 3.0))
def test_publisher_killed_at_random_moments_never_replaces_a_step_on_s3(s3_server, tmp_path):  # noqa: F811
    from deltasync import StreamReader

    url = s3_server.new_url()
    opts = s3_server.storage_options
    run = CrashRun(
        url=url,
        storage_options=opts,
        listing=S3Manifests(url, opts),
        workdir=tmp_path,
        reader=lambda: StreamReader(url, storage_options=opts, cache_dir=tmp_path / "cache"),
        max_delay_s=1.5,
        poll_s=0.05,
    )
    counts = crash_publishers(run, S3_KILLS, SEED)
    check_stream(run, counts)
    write_report(counts, "s3")
    assert_crash_run(counts, S3_KILLS)
