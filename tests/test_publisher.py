import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import PublishError, StepOrderError, StoreError, WriterConflictError
from deltasync.store import Store
from tests.conftest import perturb, states_equal


def train(state, gen, density=0.03):
    for v in state.values():
        v.copy_(perturb(v, density, gen))
    return {k: v.clone() for k, v in state.items()}


def test_long_chain_with_anchors_replays_every_step(tmp_path, small_state, gen):
    truth = {}
    with DeltaPublisher(str(tmp_path), small_state, anchor_every=7, on_backlog="block") as pub:
        for s in range(0, 60, 2):  # step numbers need not be consecutive
            truth[s] = train(small_state, gen)
            assert pub.publish(s)
    reader = StreamReader(str(tmp_path))
    assert reader.steps() == sorted(truth)
    assert [m.kind for m in pub.metrics].count("anchor") == 5
    for s, want in truth.items():
        assert states_equal(reader.state_dict(s), want), s
    assert len(reader.chain(58)) <= 7


def test_module_source_with_tied_weights(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with DeltaPublisher(str(tmp_path), model, dtype=torch.bfloat16) as pub:
        for s in range(3):
            model(torch.arange(10)).sum().backward()
            opt.step()
            pub.publish(s)
    reader = StreamReader(str(tmp_path))
    with reader.open(2) as obj:
        assert obj.header.aliases == {"1.weight": "0.weight"}
    sd = reader.state_dict(2)
    assert sd["1.weight"] is sd["0.weight"]
    assert torch.equal(sd["0.weight"], model[0].weight.detach().bfloat16())


class SlowStore(Store):
    def __init__(self, *a, delay_s=0.05, **kw):
        super().__init__(*a, **kw)
        self.delay_s = delay_s

    def commit(self, manifest, local_object, **kw):
        time.sleep(self.delay_s)
        super().commit(manifest, local_object, **kw)


def test_backlog_coalesces_steps_without_losing_changes(tmp_path, small_state, gen):
    truth = {}
    with DeltaPublisher(SlowStore(str(tmp_path)), small_state, max_pending=1, anchor_every=100) as pub:
        captured = []
        for s in range(20):
            truth[s] = train(small_state, gen)
            captured.append(pub.publish(s))
    assert not all(captured), "a slow store must make steps coalesce"
    reader = StreamReader(str(tmp_path))
    steps = reader.steps()
    assert steps[-1] == 19  # the trailing coalesced step is flushed on close
    coalesced = [c for s in steps for c in reader.manifest(s).stats.coalesced_steps]
    assert sorted(coalesced + steps) == list(range(20))
    for s in steps:
        assert states_equal(reader.state_dict(s), truth[s])


def test_step_numbers_must_increase(tmp_path, small_state, gen):
    with DeltaPublisher(str(tmp_path), small_state) as pub:
        pub.publish(5)
        with pytest.raises(StepOrderError, match="step 5 is not after the last published step 5"):
            pub.publish(5)


def test_restart_resumes_after_last_committed_step(tmp_path, small_state, gen):
    with DeltaPublisher(str(tmp_path), small_state, on_backlog="block") as pub:
        for s in range(3):
            train(small_state, gen)
            pub.publish(s)
    with DeltaPublisher(str(tmp_path), small_state) as pub:
        assert pub.last_committed_step == 2
        with pytest.raises(StepOrderError):
            pub.publish(2)
        want = train(small_state, gen)
        pub.publish(3)
    reader = StreamReader(str(tmp_path))
    assert reader.steps() == [0, 1, 2, 3] and reader.manifest(3).kind == "anchor"
    assert states_equal(reader.state_dict(3), want)


class FailingStore(Store):
    fail_steps: set = set()

    def commit(self, manifest, local_object, **kw):
        if manifest.step in self.fail_steps:
            raise StoreError(f"{self.url}: upload of step {manifest.step} failed (injected)")
        super().commit(manifest, local_object, **kw)


def test_failed_upload_is_reported_and_next_step_is_an_anchor(tmp_path, small_state, gen):
    store = FailingStore(str(tmp_path))
    store.fail_steps = {2}
    truth = {}
    pub = DeltaPublisher(store, small_state, on_backlog="block", anchor_every=100)
    for s in range(3):
        truth[s] = train(small_state, gen)
        pub.publish(s)
    pub._queue.join()
    with pytest.raises(PublishError, match="step 2 failed"):
        pub.publish(3)
    truth[3] = train(small_state, gen)
    pub.publish(3)
    truth[4] = train(small_state, gen)
    pub.publish(4)
    pub.close()
    reader = StreamReader(str(tmp_path))
    assert reader.steps() == [0, 1, 3, 4]
    assert reader.manifest(3).kind == "anchor"
    for s in reader.steps():
        assert states_equal(reader.state_dict(s), truth[s])


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from deltasync import DeltaPublisher
    from deltasync.store import Store

    class DyingStore(Store):
        def write_bytes(self, rel, data, **kw):
            if rel.endswith("{kill_step:012d}/manifest.json"):
                os._exit(9)  # killed after the object was written, before the commit
            super().write_bytes(rel, data, **kw)

    g = torch.Generator().manual_seed(0)
    state = {{"w": torch.randn(1000, generator=g).bfloat16()}}
    pub = DeltaPublisher(DyingStore(sys.argv[1]), state, on_backlog="block")
    for s in range(10):
        state["w"][s * 10] += 1
        pub.publish(s)
        pub.flush()
    """
)


@pytest.mark.parametrize("kill_step", [0, 3])
def test_writer_killed_before_commit_leaves_no_visible_step(tmp_path, kill_step):
    url = str(tmp_path / "s")
    tmp = tmp_path / "tmp"  # a killed writer cannot remove its spool: keep it inside the test's folder
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT.format(kill_step=kill_step), url], capture_output=True,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 9, proc.stderr.decode()
    store = Store(url)
    assert store.steps() == list(range(kill_step))
    assert kill_step in store.step_folders()  # the object is there, but not committed
    reader = StreamReader(url)
    if kill_step:
        assert reader.latest_step() == kill_step - 1
        reader.state_dict(kill_step - 1)
    state = {"w": torch.zeros(1000).bfloat16()}
    with pytest.raises(WriterConflictError, match="held by writer"):
        DeltaPublisher(url, state)  # the dead writer's lease has not expired
    with DeltaPublisher(url, state, take_over=True) as pub:  # a restarted writer resumes after the last commit
        # the dead writer's folder is young: it is left alone (a writer that just lost the stream may still be
        # finishing there), and it is invisible as a step
        assert kill_step in store.step_folders() and store.steps() == list(range(kill_step))
        pub.publish(kill_step)
    assert StreamReader(url).steps() == list(range(kill_step + 1))
    assert torch.equal(StreamReader(url).state_dict(kill_step)["w"], state["w"])


def test_publish_does_not_wait_for_uploads(tmp_path, small_state, gen):
    gate = threading.Event()

    class GatedStore(Store):
        def commit(self, manifest, local_object, **kw):
            gate.wait(10)
            super().commit(manifest, local_object, **kw)

    pub = DeltaPublisher(GatedStore(str(tmp_path)), small_state, max_pending=4)
    for s in range(3):
        train(small_state, gen)
        assert pub.publish(s)  # returns while the store is blocked
    assert StreamReader(str(tmp_path)).steps() == []
    gate.set()
    pub.close()
    assert StreamReader(str(tmp_path)).steps() == [0, 1, 2]


def test_one_writer_per_stream(tmp_path, small_state, gen):
    first = DeltaPublisher(str(tmp_path), small_state, writer_id="trainer-a", on_backlog="block")
    first.publish(0)
    first.flush()
    with pytest.raises(WriterConflictError, match="held by writer 'trainer-a'"):
        DeltaPublisher(str(tmp_path), small_state, writer_id="trainer-b")
    second = DeltaPublisher(str(tmp_path), small_state, writer_id="trainer-b", take_over=True)
    train(small_state, gen)
    first.publish(1)
    with pytest.raises(PublishError, match="lost the stream to 'trainer-b'"):
        first.flush()
    first.close()
    assert StreamReader(str(tmp_path)).steps() == [0]  # the old writer committed nothing more
    second.publish(1)
    second.close()
    assert StreamReader(str(tmp_path)).steps() == [0, 1]
    assert second.store.lease() is None  # released on close


def test_expired_lease_can_be_taken_without_asking(tmp_path, small_state):
    store = Store(str(tmp_path))
    store.acquire_lease("gone", ttl_s=-1)
    with DeltaPublisher(str(tmp_path), small_state) as pub:
        pub.publish(0)


def test_publishing_after_close_is_an_error_not_a_lost_step(tmp_path):
    from deltasync.errors import PublishError

    state = {"w": torch.randn(8, 8)}
    pub = DeltaPublisher(str(tmp_path / "s"), state)
    pub.publish(0)
    pub.close()
    with pytest.raises(PublishError, match="step 1: the publisher is closed"):
        pub.publish(1)


def test_only_the_committed_steps_own_weights_prove_it(tmp_path):
    """``differs_from`` is what lets a resumed trainer skip publishing a step the stream holds: every tensor the
    trainer has that is not bit for bit the step's must be named. A checksum adds up elements, so a reshaped tensor
    or one of another dtype with the same bits is still another tensor; a tied weight the step published once (an
    alias) must match in the trainer too, whether the trainer's copy is still tied or not."""
    torch.manual_seed(0)
    emb, w = torch.randn(16, 8), torch.randn(4, 2)
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, {"emb": emb, "lm": emb, "w": w}) as pub:  # lm tied to emb: an alias in the step
        pub.publish(0)
    with StreamReader(url) as reader, reader.open(0) as obj:
        assert dict(obj.header.aliases) == {"lm": "emb"}
    with DeltaPublisher(url, None) as resumed:
        assert resumed.differs_from(0, weights=[("emb", emb), ("lm", emb), ("w", w)]) == []
        assert resumed.differs_from(0, weights=[("emb", emb), ("lm", emb + 1), ("w", w)]) == ["lm"]
        assert resumed.differs_from(0, weights=[("emb", emb), ("lm", emb), ("w", w.reshape(2, 4))]) == ["w"]
        assert resumed.differs_from(0, weights=[("emb", emb), ("lm", emb), ("w", w.view(torch.int32))]) == ["w"]
        assert resumed.differs_from(0, weights=[("emb", emb), ("w", w)]) == ["lm"]
    for state, differ in (({"emb": emb, "lm": emb, "w": w}, []), ({"emb": emb, "lm": emb.clone(), "w": w}, []),
                          ({"emb": emb, "lm": emb * 2, "w": w}, ["lm"]), ({"emb": emb, "w": w}, ["lm"])):
        with DeltaPublisher(url, state) as resumed:  # the publisher's own source, tied or untied
            assert resumed.differs_from(0) == differ
