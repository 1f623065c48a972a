"""Staging (decode and check before the pause) and writing a staged step (XOR, prove, or restore exactly).

Checksums are compared with the independent NumPy reference of docs/FORMAT.md section 4 in
tests/test_reference.py, never with deltasync's own checksum code.
"""

import numpy as np
import pytest
import torch

from deltasync.engine import StepObject
from deltasync.errors import BaseStepMismatchError, ChecksumMismatchError, FormatError, TensorMismatchError
from deltasync.stages.apply import apply_staged
from deltasync.stages.staging import StagedStep, TensorSpec, layout_of, stage
from tests.conftest import states_equal
from tests.test_apply import _chain
from tests.test_reference import bits_of, ref_checksum


def _copy(state):
    return {k: v.clone() for k, v in state.items()}


def _ref(state):
    return {k: ref_checksum(bits_of(v)) for k, v in state.items()}


def test_stage_decodes_everything_and_writes_nothing(tmp_path, small_state, gen):
    objs, truth = _chain(tmp_path, small_state, gen, steps=3)
    held = _copy(truth[1])
    with StepObject(objs[2], where="2") as obj:
        staged = stage(obj, layout_of(held), base_step=1)
        changed = {n for n, t in obj.header.tensors.items() if t.changed}
    assert isinstance(staged, StagedStep) and staged.step == 2 and staged.base_step == 1
    assert {p.name for p in staged.patches} == changed and changed
    assert staged.nbytes == sum(p.xor.nbytes + (0 if p.positions is None else p.positions.nbytes)
                                for p in staged.patches)
    assert states_equal(held, truth[1])  # staging wrote nothing, and the object is closed: the patches stay usable
    after = apply_staged(staged, held, checksums=_ref(truth[1]))
    assert states_equal(held, truth[2])
    assert after == {n: ref_checksum(bits_of(truth[2][n])) for n in changed}


@pytest.mark.parametrize("incremental", [True, False])
def test_apply_staged_restores_the_exact_bits_on_a_mismatch(tmp_path, small_state, gen, incremental):
    """A holder whose weights drifted: every tensor written before the mismatch is restored, bit for bit."""
    objs, truth = _chain(tmp_path, small_state, gen, steps=2)
    held = _copy(truth[0])
    with StepObject(objs[1], where="1") as obj:
        staged = stage(obj, layout_of(held), base_step=0)
    names = [p.name for p in staged.patches]
    assert len(names) > 1
    held[names[-1]].reshape(-1).view(torch.uint8)[0] ^= 1  # the last tensor written is the one that drifted
    drifted = _copy(held)
    with pytest.raises(ChecksumMismatchError, match=repr(names[-1])):
        apply_staged(staged, held, checksums=_ref(drifted) if incremental else None)
    assert states_equal(held, drifted)


def test_stage_refuses_before_anything_is_written(tmp_path, small_state, gen):
    objs, truth = _chain(tmp_path, small_state, gen, steps=3)
    layout = layout_of(truth[1])
    with StepObject(objs[2], where="2") as obj:
        with pytest.raises(BaseStepMismatchError, match="based on step 1, but the target holds step 0"):
            stage(obj, layout, base_step=0)
        other = dict(layout, **{"layer.0.bias": TensorSpec(dtype="F16", shape=(64,))})
        with pytest.raises(TensorMismatchError, match="'layer.0.bias' is BF16 \\[64\\] in the step, F16 \\[64\\]"):
            stage(obj, other, base_step=1)
        reshaped = dict(layout, **{"layer.0.bias": torch.zeros(2, 32).bfloat16()})
        with pytest.raises(TensorMismatchError, match="layer.0.bias"):
            stage(obj, reshaped, base_step=1)
        with pytest.raises(TensorMismatchError, match="missing \\['extra'\\]"):
            stage(obj, dict(layout, extra=torch.zeros(1)), base_step=1)
    with StepObject(objs[0], where="0") as anchor, pytest.raises(BaseStepMismatchError, match="anchor"):
        stage(anchor, layout, base_step=None)


def test_partial_layout_holds_every_changed_tensor(tmp_path, small_state, gen):
    """A holder of some tensors (a tensor-parallel rank, an engine ignoring some) stages the step if it holds
    every changed one; it is refused, naming them, when it does not."""
    objs, truth = _chain(tmp_path, small_state, gen, steps=2)
    with StepObject(objs[1], where="1") as obj:
        changed = sorted(n for n, t in obj.header.tensors.items() if t.changed)
        unchanged = sorted(set(obj.header.tensors) - set(changed))
        assert unchanged, "the fixture leaves some tensors unchanged"
        part = {n: truth[0][n] for n in changed}
        assert {p.name for p in stage(obj, layout_of(part), base_step=0, partial=True).patches} == set(changed)
        with pytest.raises(TensorMismatchError, match="unknown"):
            stage(obj, layout_of(part), base_step=0)
        with pytest.raises(TensorMismatchError, match=f"does not hold: \\[{changed[0]!r}"):
            stage(obj, layout_of({n: truth[0][n] for n in changed[1:]}), base_step=0, partial=True)


@pytest.mark.parametrize("density", [0.01, 0.9], ids=["sparse", "dense"])
def test_stage_refuses_a_patch_that_changes_nothing_it_lists(tmp_path, small_state, gen, density):
    """An object whose values for one tensor are all zero (its header still counting changed elements): a
    FormatError at staging, long before any write, in the sparse and in the dense form."""
    from dataclasses import replace

    from deltasync.publish.steps import snapshot_headers, write_step
    from deltasync.stages.diff import Snapshot
    from tests.conftest import perturb

    snap = Snapshot(small_state)
    changes = [c for c in snap.diff({k: perturb(v, density, gen) for k, v in small_state.items()}) if c.changed]
    bad = replace(changes[0], xor=np.zeros_like(changes[0].xor))
    path = tmp_path / "1.safetensors"
    write_step(path, kind="delta", step=1, base_step=0, headers=snapshot_headers(snap), changes=[bad, *changes[1:]])
    with StepObject(path, where="1") as obj, pytest.raises(FormatError,
                                                           match=f"{bad.name!r}: header says {bad.changed} changed"):
        stage(obj, layout_of(small_state), base_step=0)
