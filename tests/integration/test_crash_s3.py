"""The crash harness of tests/test_crash.py and the races of tests/test_commit_races.py on a real S3 server
(SeaweedFS on loopback), where create-only commits and the lease rest on conditional writes.

The monitor lists the bucket with s3fs directly: an object's ETag and LastModified change whenever it is
rewritten, so a replaced manifest is seen from the listing alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.crash import (
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
from tests.integration.seaweedfs import s3_server  # noqa: F401 - fixture
from tests.test_commit_races import (  # noqa: F401 - the races, run here against the S3 backend below
    Backend,
    test_commit_by_a_writer_that_lost_the_lease_writes_no_manifest,
    test_commit_never_replaces_a_committed_object_of_the_same_name,
    test_commit_never_replaces_a_committed_step,
    test_lease_is_checked_right_before_the_manifest,
    test_restart_after_a_stale_hint_resumes_after_the_newest_manifest,
    test_writer_that_lost_its_lease_during_an_upload_cannot_replace_the_step,
)

pytestmark = pytest.mark.s3

S3_KILLS = KILLS or 12


@pytest.fixture
def backend(s3_server, tmp_path) -> Backend:  # noqa: F811
    """The races' stream on S3 (overrides tests/test_commit_races.py's local and memory ones)."""
    return Backend(s3_server.new_url(), tmp_path, s3_server.storage_options)


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
