"""A poisoned start is healed, and a wrong claim is not believed (issue 33, item 3), with real vLLM CPU engines.

* **Random weights, no step.** For every family of the tested matrix (docs/MODELS.md) an engine starts from a
  checkpoint of random weights of the family's shapes, or with vLLM's ``load_format="dummy"`` (random weights vLLM
  draws; deltasync loads the checkpoint through vLLM at init, to learn which parameters vLLM transforms after
  loading), and is told nothing about its step: its first update writes the stream's anchor over every tensor (in
  place, or into the host copies of the modules vLLM transforms after loading, re-loaded through vLLM), then the
  deltas. Every parameter and
  buffer it holds (what vLLM derives after loading too: prepacked CPU experts, MLA's ``W_UK_T``/``W_UV``, FP8
  weights and scales, widened copies) and its greedy output equal a fresh engine's loaded from the replayed step.
* **A wrong claim.** An engine started from step 2's checkpoint that says it holds step 1 is refused
  (``HeldStepError``: its checkpoint-format weights are not step 1's). One whose checkpoint-format weights are the
  step it names but whose derived tensors are not what vLLM derives from them (a prepacked expert changed after
  loading, as a reload bug leaves it) is refused too: the claim is checked against the tensors vLLM derives, not
  only against the checkpoint-format host copies. The same engine, told nothing, is then healed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltasync import replay_to_folder
from deltasync.errors import HeldStepError
from tests.integration.conftest import load_state, save_like
from tests.integration.families import FAMILY_CASES, POISONED_IN_CI, STARTS, TIED, build_family
from tests.integration.fp8 import fp8_stand_in
from tests.integration.test_vllm_models import _follow_and_compare, _publish, cpu_env  # noqa: F401

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

# every family case of the matrix, from each kind of random start; CI runs POISONED_IN_CI (families.py), the
# others run outside it (./run.sh test -m outside_ci)
POISONED = [pytest.param(*case, marks=() if case in POISONED_IN_CI else pytest.mark.outside_ci)
            for case in (c + (start,) for c in FAMILY_CASES for start in STARTS)]
RANDOM_SEED = 7  # the poisoned start's weights


def _random_like(model_dir: Path, out: Path, *, tied: dict[str, str]) -> Path:
    """A checkpoint of ``model_dir``'s names, shapes and dtypes holding random weights, every tensor other than
    the step's (a tied pair stays equal, as the model holds one tensor)."""
    g = torch.Generator().manual_seed(RANDOM_SEED)
    state = {n: (torch.randn(t.shape, generator=g) * 0.1).to(t.dtype) for n, t in load_state(model_dir).items()}
    state.update({alias: state[target].clone() for alias, target in tied.items()})
    step0 = load_state(model_dir)
    assert all(not torch.equal(t, step0[n]) for n, t in state.items())  # every tensor starts wrong
    return save_like(model_dir, out, state)


@pytest.mark.parametrize(("family", "kernels", "served", "start"), POISONED)
def test_a_random_start_told_no_step_is_healed_by_the_anchor(family, kernels, served, start, tmp_path,
                                                             cpu_env) -> None:  # noqa: F811
    """The engine starts from random weights and names no step; after its first update (anchor 0, then delta 1) it
    holds exactly what a fresh engine loaded from step 1's replayed checkpoint holds, and generates the same tokens.
    ``start``: "random" loads a checkpoint of random weights; "dummy" is vLLM's ``load_format="dummy"`` (weights
    vLLM draws, its post-load processing run over them) on that checkpoint, which deltasync loads through vLLM at
    init before it learns which parameters vLLM transforms."""
    quantization = "fp8" if served == "fp8" else None
    if quantization:
        stand_in = fp8_stand_in()
        stand_in.__enter__()
    model_dir = build_family(family, tmp_path / family)
    url = str(tmp_path / "stream")
    _publish(model_dir, url, tied=TIED.get(family), steps=(1,))
    poisoned = _random_like(model_dir, tmp_path / "random", tied=TIED.get(family, {}))

    def check(engine) -> None:
        assert engine.held_step == 1 and engine.init_summary["tensors"]
        assert engine._checkpoint_loaded == (start == "dummy")

    try:
        _follow_and_compare(model_dir, url, kernels == "live", quantization, {}, {}, tmp_path, steps=(1,),
                            compared=(1,), start=poisoned, held=None, check=check,
                            load_format="dummy" if start == "dummy" else "auto")
    finally:
        if quantization:
            stand_in.__exit__(None, None, None)


def test_a_wrong_claim_is_refused_and_the_engine_told_nothing_is_healed(tmp_path, cpu_env) -> None:  # noqa: F811
    """Qwen3-MoE (its experts prepacked by vLLM's CPU kernel after loading: derived tensors) started from step 2's
    checkpoint. Says step 1: refused by checksum. Its prepacked expert changed by one bit, says step 2: refused,
    naming the expert (its host copies, read from step 2's checkpoint, match). Says nothing: follows to step 2 and
    equals a fresh engine of step 2."""
    model_dir = build_family("qwen3_moe", tmp_path / "m")
    url = str(tmp_path / "stream")
    _publish(model_dir, url, steps=(1, 2))
    replayed = replay_to_folder(url, 2, str(tmp_path / "start"))
    start = save_like(model_dir, tmp_path / "step2", load_state(Path(replayed.path)))
    seen: dict[str, str] = {}

    def claims(llm) -> None:
        with pytest.raises(HeldStepError, match=r"init_info says the engine holds step 1, but its weights are not "
                                                r"that step's") as raised:
            llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 1}})
        del raised  # its traceback holds the engine
        model = llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
        name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("experts.w13_weight"))
        with torch.no_grad():
            param.data.view(-1).view(torch.int16)[7] ^= 1  # what a reload that leaves a prepacked weight wrong does
        with pytest.raises(HeldStepError) as raised:
            llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 2}})
        seen["text"], seen["tensor"] = str(raised.value), raised.value.tensor
        del raised
        engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
        assert engine.held_step is None
        seen["name"] = name

    _follow_and_compare(model_dir, url, True, None, {}, {}, tmp_path, steps=(2,), compared=(2,), start=start,
                        held=None, before=claims)
    assert seen["tensor"] == seen["name"], seen
    assert "its checkpoint-format weights are that step's, but 1 tensor(s) vLLM derives from them after loading " \
           "were not what vLLM derives from them" in seen["text"]
    assert "the claim is not believed" in seen["text"]
