import pytest

from deltasync.errors import CorruptObjectError

from deltasync import DeltaPublisher
from deltasync.store import step_dir
from rollout_loader import Follower, StateDictTarget
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
    with pytest.raises(CorruptObjectError, match="step 2 .*SHA-256"):
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
