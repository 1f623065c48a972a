import pytest
import torch

from deltasync.errors import BaseStepMismatchError, ChecksumMismatchError, FormatError, TensorMismatchError
from deltasync.format.objects import StepObject, blob_names
from deltasync.publish.steps import snapshot_headers, write_step
from deltasync.stages.apply import Replica
from deltasync.stages.diff import Snapshot
from tests.conftest import perturb, states_equal


def _chain(tmp_path, state, gen, steps=6):
    """Objects for steps 0 (anchor) .. steps-1, and the true state after each."""
    snap = Snapshot(state)
    path = tmp_path / "0.safetensors"
    write_step(path, kind="anchor", step=0, base_step=None, headers=snapshot_headers(snap), anchor_tensors=state)
    objs, truth = [path], [{k: v.clone() for k, v in state.items()}]
    cur = state
    for s in range(1, steps):
        cur = {k: perturb(v, 0.02 * s, gen) for k, v in cur.items()}
        changes = [c for c in snap.diff(cur) if c.changed]
        path = tmp_path / f"{s}.safetensors"
        write_step(path, kind="delta", step=s, base_step=s - 1, headers=snapshot_headers(snap), changes=changes)
        objs.append(path)
        truth.append({k: v.clone() for k, v in cur.items()})
    return objs, truth


@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_chain_reconstructs_bit_exactly(tmp_path, small_state, gen, verify):
    objs, truth = _chain(tmp_path, small_state, gen)
    rep = Replica.from_anchor(StepObject(objs[0], where="0"))
    assert states_equal(rep.state_dict(), truth[0])
    for s in range(1, len(objs)):
        rep.apply(StepObject(objs[s], where=str(s)), verify=verify)
        assert rep.step == s and states_equal(rep.state_dict(), truth[s])


def test_wrong_base_is_refused_and_state_untouched(tmp_path, small_state, gen):
    objs, truth = _chain(tmp_path, small_state, gen)
    rep = Replica.from_anchor(StepObject(objs[0], where="0"))
    with pytest.raises(BaseStepMismatchError, match="based on step 2, but the replica holds step 0"):
        rep.apply(StepObject(objs[3], where="3"))
    assert rep.step == 0 and states_equal(rep.state_dict(), truth[0])


def test_checksum_mismatch_rolls_back_exactly(tmp_path, small_state, gen):
    objs, truth = _chain(tmp_path, small_state, gen)
    rep = Replica.from_anchor(StepObject(objs[0], where="0"))
    # a replica whose weights silently drifted from step 0: the delta applies but cannot verify
    rep.tensors["layer.0.weight"].view(torch.int16)[0, 0] ^= 1
    drifted = {k: v.clone() for k, v in rep.state_dict().items()}
    rep.checksums["layer.0.weight"] = Replica.from_tensors(rep.tensors, step=0).checksums["layer.0.weight"]
    with pytest.raises(ChecksumMismatchError, match="layer.0.weight"):
        rep.apply(StepObject(objs[1], where="1"))
    assert rep.step == 0 and states_equal(rep.state_dict(), drifted)


def test_other_model_is_refused(tmp_path, small_state, gen):
    objs, _ = _chain(tmp_path, small_state, gen, steps=2)
    other = {k: v for k, v in small_state.items() if k != "scale"}
    other["extra"] = torch.zeros(3)
    rep = Replica.from_tensors(other, step=0)
    with pytest.raises(TensorMismatchError, match="unknown \\['scale'\\]"):
        rep.apply(StepObject(objs[1], where="1"))
    reshaped = dict(small_state, **{"layer.0.bias": torch.zeros(2, 32).bfloat16()})
    rep = Replica.from_tensors(reshaped, step=0)
    with pytest.raises(TensorMismatchError, match="layer.0.bias"):
        rep.apply(StepObject(objs[1], where="1"))


def test_corrupt_payload_changes_nothing(tmp_path, small_state, gen, monkeypatch):
    objs, truth = _chain(tmp_path, small_state, gen, steps=2)
    rep = Replica.from_anchor(StepObject(objs[0], where="0"))
    obj = StepObject(objs[1], where="1")
    # the last tensor's payload decodes badly: nothing may have been written to the earlier tensors
    names = [n for n, h in obj.header.tensors.items() if h.changed]
    real = obj.packed  # what the replica decodes (a patch scattered as its positions are decoded)

    def packed(name, **kw):
        if name == names[-1]:
            raise FormatError(f"1 tensor {name!r}: corrupt")
        return real(name, **kw)

    monkeypatch.setattr(obj, "packed", packed)
    with pytest.raises(FormatError):
        rep.apply(obj)
    assert rep.step == 0 and states_equal(rep.state_dict(), truth[0])


def test_a_damaged_blob_undoes_the_tensors_already_written(tmp_path, small_state, gen):
    """Tensors are decoded and written one by one on the pool: when the last one to decode (the smallest)
    turns out damaged, the others have landed already, and must be XORed back to the exact previous bits."""
    import safetensors
    import safetensors.torch

    objs, truth = _chain(tmp_path, small_state, gen, steps=2)
    with safetensors.safe_open(str(objs[1]), framework="pt") as f:
        metadata, blobs = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    header = StepObject(objs[1], where="1").header
    changed = sorted((h.changed, n) for n, h in header.tensors.items() if h.changed)
    assert len(changed) >= 3
    smallest = changed[0][1]
    values = blob_names(smallest)[1]
    blobs[values] = blobs[values][:-1].clone()  # one byte short: a truncated zstd frame, or too few raw values
    safetensors.torch.save_file(blobs, str(objs[1]), metadata=metadata)
    rep = Replica.from_anchor(StepObject(objs[0], where="0"))
    before = dict(rep.checksums)
    with pytest.raises(FormatError, match=smallest):
        rep.apply(StepObject(objs[1], where="1"))
    assert rep.step == 0 and rep.checksums == before and states_equal(rep.state_dict(), truth[0])
