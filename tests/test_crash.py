"""The crash harness on a local folder: publishers SIGKILLed at random moments (see tests/crash.py)."""

import pytest

from tests.crash import (
    KILLS,
    SEED,
    CrashRun,
    LocalManifests,
    assert_crash_run,
    check_stream,
    crash_publishers,
    crash_timeout_s,
    write_report,
)

LOCAL_KILLS = KILLS or 16


@pytest.mark.timeout(crash_timeout_s(LOCAL_KILLS, 1.0))
def test_publisher_killed_at_random_moments_never_replaces_a_step(tmp_path):
    from deltasync import StreamReader

    url = tmp_path / "stream"
    run = CrashRun(
        url=str(url),
        storage_options={},
        listing=LocalManifests(url),
        workdir=tmp_path,
        reader=lambda: StreamReader(str(url)),
        max_delay_s=0.6,
        poll_s=0.01,
    )
    counts = crash_publishers(run, LOCAL_KILLS, SEED)
    check_stream(run, counts)
    write_report(counts, "local")
    assert_crash_run(counts, LOCAL_KILLS)
