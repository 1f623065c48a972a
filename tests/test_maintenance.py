import json

import pytest

from deltasync import StreamReader, collect_garbage, verify
from deltasync.engine import write_heartbeat
from deltasync.errors import ConfigError, FormatError, StepNotFoundError
from deltasync.follow.consumers import read_heartbeats, read_heartbeats_checked
from deltasync.format.documents import ConsumerPosition
from deltasync.history import plan_gc
from deltasync.store import Manifest, Store, step_dir
from rollout_loader import Follower, StateDictTarget
from tests.conftest import states_equal
from tests.damage import (
    damage_blob,
    object_path,
    rewrite_header,
    write_manifest,
    write_manifest_agreeing,
    wrong_checksum,
)


def test_a_sound_stream_verifies(qwen_stream):
    report = verify(qwen_stream.url)
    assert report.ok and report.verified == tuple(range(10)) and (report.first, report.last) == (0, 9)
    part = verify(qwen_stream.url, first=6, last=7)
    assert part.ok and part.verified == (6, 7)


def _missing_object(store):
    object_path(store, 6).unlink()


def _truncated_object(store):
    path = object_path(store, 6)
    path.write_bytes(path.read_bytes()[:-100])


def _garbage_object(store):
    path = object_path(store, 6)
    path.write_bytes(bytes(path.stat().st_size))


def _missing_manifest_mid_chain(store):
    store.delete(f"{step_dir(5)}/manifest.json")


def _manifest_disagrees_with_header(store):
    write_manifest(store, 6, state_checksum="0" * 64)


def _header_names_another_step(store):
    rewrite_header(store, 6, lambda h: h.update(step=9, base_step=5))


def _checksum_does_not_replay(store):
    rewrite_header(store, 6, wrong_checksum)


def _blob_does_not_decode(store):
    damage_blob(store, 6)


def _anchor_checksum_does_not_replay(store):
    rewrite_header(store, 4, wrong_checksum)


@pytest.mark.parametrize(
    "plant,step,kind,message,dependents",
    [
        (_missing_object, 6, "object",
         "step 6 object delta-[0-9a-f]{16}.safetensors: missing, though the step is committed", [7]),
        (_truncated_object, 6, "object", r"step 6 object delta-[0-9a-f]{16}.safetensors: \d+ bytes, manifest says \d+",
         [7]),
        (_garbage_object, 6, "object", "step 6 object delta-[0-9a-f]{16}.safetensors: digest blake3:", [7]),
        (_missing_manifest_mid_chain, 6, "chain",
         "step 6 is a delta on step 5, which is not committed \\(its folder holds objects but no manifest.json\\)",
         [7]),
        (_manifest_disagrees_with_header, 6, "header",
         "step 6: the object header's state checksum .* disagrees with its manifest", [7]),
        (_header_names_another_step, 6, "header",
         r"step 6: object header \(step 9, delta\) disagrees with its manifest", [7]),
        (_checksum_does_not_replay, 6, "checksum",
         "step 6: tensor .* does not match the trainer's checksum after step 6", [7]),
        (_blob_does_not_decode, 6, "object", "step 6 tensor '.*' values", [7]),
        (_anchor_checksum_does_not_replay, 4, "checksum",
         "step 4: tensor .* does not match the trainer's checksum after step 4", [5, 6, 7]),
    ],
)
def test_verify_finds_planted_damage(stream_copy, plant, step, kind, message, dependents):
    plant(Store(stream_copy))
    report = verify(stream_copy)
    assert not report.ok and len(report.problems) == 1
    first = report.problems[0]
    assert (first.step, first.kind) == (step, kind)
    assert __import__("re").search(message, first.message), first.message
    everything = verify(stream_copy, all_problems=True)
    assert [(p.step, p.kind) for p in everything.problems] == [(step, kind)] + [(s, "chain") for s in dependents]
    assert set(everything.verified) == set(range(10)) - {step, *dependents} - ({5}
                                                                               if plant is _missing_manifest_mid_chain
                                                                               else set())
    assert verify(stream_copy, first=8).ok  # the next anchor starts a sound chain


def test_verify_from_a_step_replays_its_chain_from_below(stream_copy):
    rewrite_header(Store(stream_copy), 5, wrong_checksum)
    report = verify(stream_copy, first=6, last=6)
    assert [(p.step, p.kind) for p in report.problems] == [(5, "checksum")]
    assert verify(stream_copy, first=8, last=9).ok
    with pytest.raises(StepNotFoundError, match="no committed steps in 20..30"):
        verify(stream_copy, first=20, last=30)


def _manifests(kinds: str) -> list[Manifest]:
    """One manifest per letter: A anchor, D delta on the step before."""
    return [
        Manifest(step=s, base_step=None if k == "A" else s - 1, kind="anchor" if k == "A" else "delta", object="o",
                 object_bytes=100 if k == "A" else 10, object_sha256="", state_checksum="", created_unix_s=0.0)
        for s, k in enumerate(kinds)
    ]


def test_plan_keeps_the_last_steps_and_their_chains():
    plan = plan_gc(_manifests("ADDDADDDAD"), keep_last=3, now_unix_s=1000.0)
    assert sorted(plan.keep) == [4, 5, 6, 7, 8, 9]  # 7 needs 4, 5, 6
    assert plan.delete == (3, 2, 1, 0) and plan.freed_bytes == 130
    assert plan.keep[4] == "in the chain of step 7" and plan.keep[9] == "one of the last 3 steps"
    assert sorted(plan_gc(_manifests("ADDDADDDAD"), keep_last=2, now_unix_s=0).keep) == [8, 9]
    assert plan_gc(_manifests("ADDDADDDAD"), keep_last=100, now_unix_s=0).delete == ()


def test_plan_keeps_sparse_anchors_and_live_consumers():
    manifests = _manifests("ADDDADDDADDDAD")
    plan = plan_gc(manifests, keep_last=1, keep_anchor_every=8, now_unix_s=0)
    assert sorted(plan.keep) == [0, 8, 12, 13]
    consumers = [
        ConsumerPosition(consumer_id="live", step=6, updated_unix_s=990.0),
        ConsumerPosition(consumer_id="stale", step=1, updated_unix_s=100.0),
    ]
    plan = plan_gc(manifests, keep_last=1, consumers=consumers, now_unix_s=1000.0, consumer_max_age_s=60)
    assert sorted(plan.keep) == list(range(4, 14))  # step 6, its chain from 4, and everything it may replay
    assert plan.keep[6] == "consumer live holds step 6" and plan.keep[4] == "in the chain of step 6"
    assert [c.consumer_id for c in plan.live_consumers] == ["live"]
    assert [c.consumer_id for c in plan.stale_consumers] == ["stale"]
    assert plan_gc(manifests, keep_last=1, folders=[3, 20, 99], now_unix_s=0).leftovers == ()
    assert plan_gc(manifests[:10], keep_last=1, folders=[11, 10, 99], now_unix_s=0).leftovers == ()
    assert plan_gc(manifests[:3] + manifests[4:], keep_last=1, folders=[3], now_unix_s=0).leftovers == (3,)
    with pytest.raises(ConfigError, match="keep_last must be a whole number of steps, at least 1, got 0"):
        plan_gc(manifests, keep_last=0, now_unix_s=0)


def test_gc_respects_a_following_consumer_and_dry_run(stream_copy, qwen_stream):
    follower = Follower(stream_copy, StateDictTarget(), consumer_id="rollout-0")
    follower.sync(2)
    store = Store(stream_copy)
    [position] = read_heartbeats(store)
    assert (position.consumer_id, position.step) == ("rollout-0", 2)
    plan = collect_garbage(stream_copy, keep_last=2, dry_run=True)
    assert sorted(plan.keep) == list(range(10)) and plan.delete == ()
    assert StreamReader(stream_copy).steps() == list(range(10))

    write_heartbeat(store, "rollout-0", 6)
    plan = collect_garbage(stream_copy, keep_last=2, dry_run=True)
    assert plan.delete == (3, 2, 1, 0) and StreamReader(stream_copy).steps() == list(range(10))  # dry run: nothing gone
    plan = collect_garbage(stream_copy, keep_last=2)
    assert plan.delete == (3, 2, 1, 0)
    assert StreamReader(stream_copy).steps() == list(range(4, 10)) and store.step_folders() == list(range(4, 10))
    assert verify(stream_copy).ok
    assert states_equal(StreamReader(stream_copy).state_dict(6), qwen_stream.truth[6])
    with pytest.raises(StepNotFoundError, match=r"step 2 is not committed \(nearest committed: 4; stream holds 4..9\)"):
        StreamReader(stream_copy).state_dict(2)

    plan = collect_garbage(stream_copy, keep_last=2, consumer_max_age_s=0.0)  # the consumer went quiet
    assert plan.delete == (7, 6, 5, 4) and [c.consumer_id for c in plan.stale_consumers] == ["rollout-0"]
    assert StreamReader(stream_copy).steps() == [8, 9]


def test_heartbeats(tmp_path, small_state):
    store = Store(str(tmp_path))
    assert read_heartbeats(store) == []
    write_heartbeat(store, "a", 3)
    write_heartbeat(store, "b.1", 5)
    beats = {c.consumer_id: c for c in read_heartbeats(store)}
    assert beats.keys() == {"a", "b.1"} and beats["b.1"].step == 5
    assert json.loads(store.read_bytes("consumers/a.json")).keys() == {
        "consumer_id", "step", "updated_unix_s", "newest_step", "weight_version", "errors",  # docs/FORMAT.md section 5
        "applied_unix_s", "pause_s", "config_key", "fingerprint", "fingerprint_step", "fingerprint_check",
        "last_error"}  # and the replica record of section 5f
    # an unreadable heartbeat costs that consumer only (issue 30 item 14): the others are read, it is reported
    store.write_bytes("consumers/broken.json", b"{")
    positions, bad = read_heartbeats_checked(store)
    assert {p.consumer_id for p in positions} == {"a", "b.1"}
    assert [b.file for b in bad] == ["consumers/broken.json"] and "not valid JSON" in bad[0].error
    store.write_bytes("consumers/broken.json",
                      json.dumps({"consumer_id": "other", "step": 1, "updated_unix_s": 1.0}).encode())
    _, bad = read_heartbeats_checked(store)
    assert "names consumer 'other'" in bad[0].error
    assert {c.consumer_id for c in read_heartbeats(store)} == {"a", "b.1"}
    with pytest.raises(ValueError, match="consumer id '../x'"):
        write_heartbeat(store, "../x", 1)
    with pytest.raises(ValueError):
        Follower(str(tmp_path), StateDictTarget(), consumer_id="a b")


def test_steps_before_a_bad_object_are_still_replayed(stream_copy):
    store = Store(stream_copy)
    rewrite_header(store, 5, wrong_checksum)
    object_path(store, 6).unlink()
    report = verify(stream_copy, all_problems=True)
    assert [(p.step, p.kind) for p in report.problems] == [(5, "checksum"), (6, "object"), (7, "chain")]
    assert report.verified == (0, 1, 2, 3, 4, 8, 9)


def test_verify_refuses_an_anchor_whose_layout_disagrees_with_its_header(stream_copy):
    """verify passed such an anchor, which every reader refuses: both now run the same checks."""
    import safetensors
    import safetensors.torch

    store = Store(stream_copy)
    path = object_path(store, 4)
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = next(n for n, t in tensors.items() if t.ndim == 2)
    tensors[name] = tensors[name].reshape(-1)  # same bytes, another shape than the header says
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    data = path.read_bytes()
    write_manifest_agreeing(store, 4, data)
    report = verify(stream_copy, all_problems=True)
    assert (4, "header") in [(p.step, p.kind) for p in report.problems]
    assert f"tensor {name!r} is stored as" in next(p.message for p in report.problems if p.step == 4)
    with pytest.raises(FormatError, match="is stored as"):
        StreamReader(stream_copy).state_dict(5)
