import threading

import pytest

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import StepNotFoundError, WaitTimeoutError
from deltasync.store import step_dir
from tests.conftest import states_equal
from tests.test_publisher import train


@pytest.fixture
def stream(tmp_path, small_state, gen):
    truth = {}
    with DeltaPublisher(str(tmp_path), small_state, anchor_every=4, on_backlog="block") as pub:
        for s in range(10):
            truth[s] = train(small_state, gen)
            pub.publish(s)
    return str(tmp_path), truth


def test_chain_starts_at_nearest_anchor(stream):
    url, _ = stream
    r = StreamReader(url)
    assert r.chain(6) == [4, 5, 6]
    assert r.chain(6, start=5) == [6]
    assert r.chain(8) == [8]


def test_catch_up_from_an_older_replica(stream):
    url, truth = stream
    r = StreamReader(url)
    rep = r.replica(1)
    assert r.catch_up(rep) == [8, 9]  # shorter from the anchor at 8
    assert states_equal(rep.state_dict(), truth[9])
    rep = r.replica(5)
    assert r.catch_up(rep, 7) == [6, 7]
    assert states_equal(rep.state_dict(), truth[7])


def test_wait_for_times_out_with_the_latest_step(stream):
    url, _ = stream
    with pytest.raises(WaitTimeoutError, match="step 99 not committed within 0.1s \\(latest: 9\\)"):
        StreamReader(url).wait_for(99, timeout_s=0.1)


def test_wait_for_returns_when_the_step_lands(tmp_path, small_state, gen):
    pub = DeltaPublisher(str(tmp_path), small_state)
    threading.Timer(0.2, lambda: pub.publish(0)).start()
    assert StreamReader(str(tmp_path)).wait_for(0, timeout_s=10) == 0
    pub.close()


def test_broken_chain_names_the_missing_step(stream):
    url, _ = stream
    r = StreamReader(url)
    r.store.delete(f"{step_dir(5)}/manifest.json")
    with pytest.raises(StepNotFoundError, match="chain to step 7 is broken at step 5.*nearest committed: 4, 6"):
        r.state_dict(7)
    with pytest.raises(StepNotFoundError, match="step 42 is not committed"):
        r.state_dict(42)
