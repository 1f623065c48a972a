import logging
import random
import threading
import time

import pytest

from deltasync import DeltaPublisher
from deltasync.errors import CorruptObjectError, DeltaSyncError, TensorMismatchError, WaitTimeoutError
from deltasync.follow.watch import retry_delay_s
from deltasync.store import step_dir
from rollout_loader import Follower, PollPolicy, StateDictTarget
from rollout_loader.follower import FollowError
from tests.conftest import states_equal
from tests.test_publisher import train


def test_follows_a_live_stream(tmp_path, small_state, gen):
    target = StateDictTarget(verify="full")
    seen = []
    follower = Follower(str(tmp_path), target, on_step=seen.append).start()
    truth = {}
    with DeltaPublisher(str(tmp_path), small_state, anchor_every=5) as pub:
        for s in range(12):
            truth[s] = train(small_state, gen)
            pub.publish(s)
    assert follower.wait_for(11, timeout_s=30) == 11
    follower.stop()
    assert states_equal(target.state_dict(), truth[11])
    assert seen == sorted(seen) and seen[-1] == 11


def test_recovers_from_a_damaged_delta_at_the_next_anchor(tmp_path, small_state, gen):
    truth = {}
    with DeltaPublisher(str(tmp_path), small_state, anchor_every=4, on_backlog="block") as pub:
        for s in range(6):
            truth[s] = train(small_state, gen)
            pub.publish(s)
    store = pub.store
    m = store.manifest(2)
    store.write_bytes(f"{step_dir(2)}/{m.object}", b"\0" * m.object_bytes)  # garbage of the right size
    target = StateDictTarget()
    follower = Follower(str(tmp_path), target)
    follower.sync(1)
    assert target.step == 1
    with pytest.raises(CorruptObjectError, match="step 2 .*digest blake3:.* differs"):
        follower.sync(3)
    assert target.step == 1 and states_equal(target.state_dict(), truth[1])  # still consistent
    assert follower.sync() == [4, 5]  # from the anchor at 4
    assert states_equal(target.state_dict(), truth[5])


def test_wait_for_step_zero(tmp_path, small_state):
    target = StateDictTarget()
    with Follower(str(tmp_path), target) as follower:
        with DeltaPublisher(str(tmp_path), small_state) as pub:
            pub.publish(0)
        assert follower.wait_for(0, timeout_s=10) == 0


# --- a follower never dies from one failure (issue 8, defect 7) ---


def publish(url, state, gen, steps):
    truth = {}
    with DeltaPublisher(url, state, anchor_every=100, on_backlog="block") as pub:
        for s in range(steps):
            truth[s] = train(state, gen)
            pub.publish(s)
    return truth


class FlakyTarget(StateDictTarget):
    """A state-dict target whose ``apply`` raises ``fail(step)`` when that is not None."""

    def __init__(self, fail) -> None:
        super().__init__(verify="full")
        self.fail = fail

    def apply(self, obj) -> None:
        error = self.fail(obj.header.step)
        if error is not None:
            raise error
        super().apply(obj)


def eventually(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_an_unexpected_error_is_recorded_with_its_step_and_retried(tmp_path, small_state, gen):
    truth = publish(str(tmp_path), small_state, gen, steps=3)
    broken = threading.Event()
    broken.set()
    target = FlakyTarget(lambda s: RuntimeError(f"engine hiccup at {s}") if broken.is_set() and s == 1 else None)
    with Follower(str(tmp_path), target, policy=PollPolicy(fast_s=0.01, retry_max_s=0.05)) as follower:
        eventually(lambda: follower.last_error is not None)
        assert isinstance(follower.last_error, RuntimeError) and follower.last_error_step == 1
        eventually(lambda: follower.failures >= 3)  # retried, the thread is alive
        assert follower.running and target.step == 0
        broken.clear()
        assert follower.wait_for(2, timeout_s=10) == 2
        assert follower.last_error is None and follower.last_error_step is None
    assert states_equal(target.state_dict(), truth[2])


def test_wait_for_gives_up_at_its_deadline_with_the_last_error(tmp_path, small_state, gen):
    publish(str(tmp_path), small_state, gen, steps=1)
    target = FlakyTarget(lambda s: ValueError("the engine refused the weights"))
    with Follower(str(tmp_path), target, policy=PollPolicy(fast_s=0.01, retry_max_s=0.05)) as follower:
        with pytest.raises(WaitTimeoutError, match="step 0 not live .*the engine refused the weights") as e:
            follower.wait_for(0, timeout_s=0.5)
        assert isinstance(e.value.__cause__, ValueError) and follower.running
    # the same without a thread: wait_for retries in the caller's thread until its deadline
    follower = Follower(str(tmp_path), target, policy=PollPolicy(fast_s=0.01, retry_max_s=0.05))
    with pytest.raises(WaitTimeoutError, match="the engine refused the weights") as e:
        follower.wait_for(0, timeout_s=0.5)
    assert isinstance(e.value.__cause__, ValueError) and follower.failures >= 2
    follower.close()


def test_a_wait_that_times_out_says_where_the_follower_thread_is_stuck(tmp_path, small_state, gen):
    publish(str(tmp_path), small_state, gen, steps=1)
    release = threading.Event()

    def stuck_in_the_engine(step):
        release.wait(30)  # an engine that never returns from an update

    with Follower(str(tmp_path), FlakyTarget(stuck_in_the_engine), policy=PollPolicy(fast_s=0.01)) as follower:
        try:
            with pytest.raises(WaitTimeoutError, match=r"not live within 0.3s; the follower thread is in .*"
                                                       r"test_follower.py:\d+ stuck_in_the_engine < .*apply"):
                follower.wait_for(0, timeout_s=0.3)
        finally:
            release.set()


def test_a_model_that_changed_shape_stops_the_follower(tmp_path, small_state, gen):
    url = str(tmp_path)
    publish(url, small_state, gen, steps=2)
    target = StateDictTarget()
    follower = Follower(url, target, policy=PollPolicy(fast_s=0.01)).start()
    assert follower.wait_for(1, timeout_s=10) == 1
    reshaped = {n: t.reshape(-1, 1) if t.ndim == 1 and t.numel() > 1 else t for n, t in small_state.items()}
    with DeltaPublisher(url, reshaped, take_over=True) as pub:  # same names, other shapes: a new model
        pub.publish(2)
    with pytest.raises(FollowError, match="step 2") as e:
        follower.wait_for(2, timeout_s=5)
    assert isinstance(e.value, DeltaSyncError) and isinstance(e.value.__cause__, TensorMismatchError)
    assert not follower.running and follower.last_error_step == 2 and target.step == 1
    with pytest.raises(TensorMismatchError):  # sync raises the error itself
        follower.sync()
    follower.close()


def test_sync_records_and_raises_the_error_itself(tmp_path, small_state, gen):
    publish(str(tmp_path), small_state, gen, steps=2)
    follower = Follower(str(tmp_path), FlakyTarget(lambda s: KeyError("no such layer") if s == 1 else None))
    with pytest.raises(KeyError, match="no such layer"):
        follower.sync()
    assert isinstance(follower.last_error, KeyError) and follower.last_error_step == 1 and follower.step == 0
    follower.close()


def test_each_distinct_error_is_logged_once(tmp_path, small_state, gen, caplog):
    publish(str(tmp_path), small_state, gen, steps=1)
    failures = []

    def fail(step):
        failures.append(step)
        if len(failures) <= 5:
            return OSError("connection reset")
        if len(failures) <= 10:
            return RuntimeError("CUDA error: out of memory")
        return None

    with caplog.at_level(logging.WARNING, logger="rollout_loader.follower"):
        with Follower(str(tmp_path), FlakyTarget(fail), policy=PollPolicy(fast_s=0.001, retry_max_s=0.002)) as follower:
            assert follower.wait_for(0, timeout_s=10) == 0
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failures) == 11
    assert len(messages) == 2, messages
    assert "connection reset" in messages[0] and "CUDA error" in messages[1]


@pytest.mark.parametrize("poll_s,max_s", [(0.05, 30.0), (0.001, 0.004), (1.0, 1.0)])
def test_retry_delays_grow_exponentially_with_jitter_up_to_the_cap(poll_s, max_s):
    rng = random.Random(0)
    for failures in range(1, 40):
        ceiling = min(max_s, poll_s * 2.0 ** (failures - 1))  # the reference: doubling from poll_s, capped
        delays = [retry_delay_s(failures, poll_s=poll_s, max_s=max_s, rng=rng) for _ in range(50)]
        assert all(max(poll_s, ceiling / 2) <= d <= ceiling for d in delays), (failures, min(delays), max(delays))
        if ceiling / 2 > poll_s:
            assert len(set(delays)) > 1  # jittered: followers of one stream do not retry in lockstep


def test_a_wrong_url_is_reported_not_waited_on_silently(tmp_path, small_state):
    """Today a Follower on a wrong URL or prefix waited forever without a word."""
    from deltasync.errors import StreamNotFoundError, WaitTimeoutError

    (tmp_path / "runs" / "run-7").mkdir(parents=True)
    # the prefix is one level short
    follower = Follower(str(tmp_path / "runs"), StateDictTarget(), policy=PollPolicy(fast_s=0.01))
    with pytest.raises(StreamNotFoundError, match="no deltasync stream at .*it holds run-7"):
        follower.sync()
    with follower:
        with pytest.raises(WaitTimeoutError, match="StreamNotFoundError: no deltasync stream") as e:
            follower.wait_for(0, timeout_s=0.5)
        assert isinstance(e.value.__cause__, StreamNotFoundError) and follower.running  # the publisher may start later
    # a stream with no steps yet is not an error: the follower just waits for its first step
    with DeltaPublisher(str(tmp_path / "runs" / "run-7"), small_state):
        pass
    assert Follower(str(tmp_path / "runs" / "run-7"), StateDictTarget()).sync() == []


def test_errors_retrying_cannot_fix_stop_the_follower():
    from deltasync.errors import (
        ConfigError,
        CorruptObjectError,
        EngineConfigError,
        EngineError,
        HeldStepError,
        MissingDependencyError,
        StoreAuthError,
        StoreConfigError,
        StoreError,
        TensorMismatchError,
        can_retry,
    )
    from rollout_loader.routing import RoutingError

    for cls in (TensorMismatchError, StoreAuthError, StoreConfigError, EngineConfigError, ConfigError,
                MissingDependencyError, HeldStepError, RoutingError):
        assert not can_retry(cls("x")), cls
    for cls in (StoreError, CorruptObjectError, EngineError):
        assert can_retry(cls("x")), cls
    assert can_retry(RuntimeError("a bug in on_step"))


def test_a_replica_record_that_does_not_fit_costs_the_record_not_the_heartbeat(tmp_path, caplog):
    """A target's record (an engine's own account, across a process boundary) that the heartbeat refuses (a
    fingerprint that is no SHA-256) must not cost the consumer its heartbeat: without one it looks stopped, and
    garbage collection no longer keeps what it holds. The heartbeat is written without the record, and the reason
    logged."""
    import torch

    from deltasync.follow.consumers import ReplicaRecord, read_heartbeats

    class Reporting(StateDictTarget):
        def record(self) -> ReplicaRecord:
            return ReplicaRecord(pause_s=0.5, fingerprint="not a digest\n", config_key="0123456789abcdef")

    url = str(tmp_path / "s")
    with DeltaPublisher(url, {"w": torch.zeros(8)}) as pub:
        pub.publish(0)
    with caplog.at_level(logging.WARNING, logger="rollout_loader.follower"), \
            Follower(url, Reporting(), consumer_id="c0") as follower:
        follower.sync()
    [beat] = read_heartbeats(follower.reader.store)
    assert (beat.consumer_id, beat.step, beat.fingerprint, beat.pause_s) == ("c0", 0, None, None)
    assert any("record" in r.getMessage() and "fingerprint" in r.getMessage() for r in caplog.records), caplog.text
