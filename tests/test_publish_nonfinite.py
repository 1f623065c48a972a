"""Bad steps never reach the fleet (issue 33, deltasync/publish/finite.py): a step whose weights turned NaN or ±Inf is
refused with the tensors named, nothing of it reaches the store, and the stream goes on from the last good step.

The reference is independent of the publisher: the weights fed to it, cast to the publish dtype here, compared bit
for bit with what a ``StreamReader`` replays from a real local store.
"""

from __future__ import annotations

import pytest
import torch

from deltasync import DeltaPublisher, PublishOptions, StreamReader
from deltasync.errors import (
    ConfigError,
    DeltaSyncError,
    NonFiniteStepError,
    can_retry,
    error_record,
    from_record,
)
from deltasync.publish.finite import MAX_NAMED
from deltasync.store import Store
from tests.conftest import perturb, states_equal

BF16 = torch.bfloat16


def model_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """fp32 master weights, an attention mask holding -inf (legitimately non-finite), an integer buffer."""
    mask = torch.zeros(8, 8)
    mask[torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)] = float("-inf")
    return {
        "embed.weight": torch.randn(300, 64, generator=gen),
        "layer.0.weight": torch.randn(64, 64, generator=gen),
        "layer.0.bias": torch.randn(64, generator=gen),
        "norm.weight": torch.ones(64),
        "attn.mask": mask,
        "counts": torch.arange(10),
    }


def train(state: dict[str, torch.Tensor], gen: torch.Generator, density: float = 0.05) -> None:
    """An optimizer step: new finite values at about ``density`` of the weights (the mask and counts stay)."""
    for name in ("embed.weight", "layer.0.weight", "layer.0.bias", "norm.weight"):
        t = state[name]
        new = perturb(t, density, gen)
        state[name].copy_(torch.where(torch.isfinite(new), new, torch.randn(t.shape, generator=gen)))


def published(state: dict[str, torch.Tensor], dtype: torch.dtype = BF16) -> dict[str, torch.Tensor]:
    """What the stream must hold for ``state``: floating tensors cast to the publish dtype (the reference cast)."""
    return {n: v.to(dtype) if v.is_floating_point() else v.clone() for n, v in state.items()}


def stored_files(url: str, step: int) -> list[str]:
    return [e.key for e in Store(url).list(f"steps/{step:012d}")]


def assert_replays(url: str, truth: dict[int, dict[str, torch.Tensor]]) -> None:
    """Every committed step is exactly its reference, and nothing else is committed."""
    with StreamReader(url) as reader:
        assert reader.steps() == sorted(truth)
        for step, want in truth.items():
            assert states_equal(reader.state_dict(step), want), step


def test_a_step_turning_nan_or_inf_is_refused_naming_its_tensors_and_the_stream_goes_on(tmp_path, gen):
    url = str(tmp_path / "stream")
    state = model_state(gen)
    truth = {}
    with DeltaPublisher(url, state, dtype=BF16, anchor_every=10, on_backlog="block") as pub:
        pub.publish(0)
        truth[0] = published(state)
        train(state, gen)
        pub.publish(1)
        truth[1] = published(state)
        pub.flush()

        good = {n: t.clone() for n, t in state.items()}
        train(state, gen)
        state["layer.0.weight"][3, 4] = float("nan")
        state["norm.weight"][7] = float("-inf")
        state["attn.mask"][0, 0] = float("nan")  # held -inf already: its values are the model's own, not refused
        with pytest.raises(NonFiniteStepError) as caught:
            pub.publish(2)
        e = caught.value
        assert isinstance(e, DeltaSyncError) and isinstance(e, ValueError) and not can_retry(e)
        assert e.step == 2 and e.tensors == ("layer.0.weight", "norm.weight")  # the model's order
        assert e.context() == {"url": url, "step": 2, "tensor": "layer.0.weight"}
        assert "step 2" in str(e) and "'layer.0.weight', 'norm.weight'" in str(e) and "step 1" in str(e)
        assert "attn.mask" not in str(e)
        pub.flush()  # nothing of the refused step was queued, so nothing of it reaches the store
        assert stored_files(url, 2) == [] and Store(url).steps() == [0, 1]

        # the trainer rolls back (say, to its last good weights) and publishes the same step number again
        for n, t in good.items():
            state[n].copy_(t)
        train(state, gen)
        assert pub.publish(2)
        truth[2] = published(state)
        train(state, gen)
        pub.publish(3)
        truth[3] = published(state)
    with StreamReader(url) as reader:  # deltas from the last good step: no anchor was forced
        assert [(reader.manifest(s).kind, reader.manifest(s).base_step) for s in (2, 3)] == [("delta", 1),
                                                                                          ("delta", 2)]
    assert_replays(url, truth)


def test_the_first_step_refuses_nan_and_takes_inf_as_a_mask(tmp_path, gen):
    url = str(tmp_path / "stream")
    state = model_state(gen)
    state["embed.weight"][0, 0] = float("nan")
    state["layer.0.bias"][1] = float("inf")  # could be a mask: nothing to compare with at a first step
    with DeltaPublisher(url, state, dtype=BF16, on_backlog="block") as pub:
        with pytest.raises(NonFiniteStepError) as caught:
            pub.publish(0)
        assert caught.value.tensors == ("embed.weight",) and "first step" in str(caught.value)
        pub.flush()
        assert Store(url).step_folders() == []

        state["embed.weight"][0, 0] = 1.0
        pub.publish(0)  # the publisher's first step again: an anchor, +inf and all
        truth = {0: published(state)}
        state["layer.0.bias"][2] = float("-inf")  # held +inf at the step before: exempt
        pub.publish(1)
        truth[1] = published(state)
    assert_replays(url, truth)


def test_refuse_nonfinite_false_publishes_nan_steps_bit_exact(tmp_path, gen):
    url = str(tmp_path / "stream")
    state = model_state(gen)
    with DeltaPublisher(url, state, dtype=BF16, refuse_nonfinite=False, on_backlog="block") as pub:
        state["embed.weight"][0, 0] = float("nan")
        pub.publish(0)
        truth = {0: published(state)}
        state["layer.0.weight"][1, 2] = float("inf")
        pub.publish(1)
        truth[1] = published(state)
    assert_replays(url, truth)
    assert PublishOptions().refuse_nonfinite is True
    with pytest.raises(ConfigError, match="refuse_nonfinite"):
        PublishOptions(refuse_nonfinite="no")  # type: ignore[arg-type]


def test_the_published_bits_are_checked_a_cast_that_overflows_refuses(tmp_path, gen):
    """fp32 master weights published as fp16: a finite 1e6 becomes the Inf every engine would receive."""
    url = str(tmp_path / "stream")
    state = model_state(gen)
    with DeltaPublisher(url, state, dtype=torch.float16, on_backlog="block") as pub:
        pub.publish(0)
        state["layer.0.weight"][0, 0] = 1e6
        with pytest.raises(NonFiniteStepError) as caught:
            pub.publish(1)
        assert caught.value.tensors == ("layer.0.weight",)


def test_a_dense_change_and_many_tensors_are_named_bounded(tmp_path, gen):
    """Every element changed (the tensor is read whole) in more tensors than a message names."""
    url = str(tmp_path / "stream")
    state = {f"layer.{i}.weight": torch.randn(32, generator=gen) for i in range(MAX_NAMED + 3)}
    with DeltaPublisher(url, state, on_backlog="block") as pub:
        pub.publish(0)
        for t in state.values():
            t.copy_(torch.randn(32, generator=gen))
            t[-1] = float("nan")
        with pytest.raises(NonFiniteStepError) as caught:
            pub.publish(1)
        e = caught.value
        assert e.tensors == tuple(state)  # all of them
        assert f"'layer.{MAX_NAMED - 1}.weight'" in str(e) and f"'layer.{MAX_NAMED}.weight'" not in str(e)
        assert f"{MAX_NAMED + 3} tensor(s)" in str(e) and "and 3 more" in str(e)
        for t in state.values():
            t[-1] = 0.0
        pub.publish(1)
        want = published(state, torch.float32)
    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1] and states_equal(reader.state_dict(1), want)


def test_a_coalesced_step_is_checked_when_flush_captures_it(tmp_path, gen, monkeypatch):
    """The background path: a step coalesced while uploads lag is read at the next capture; a trailing one by
    ``flush``, which raises the refusal (once: ``close`` then closes)."""
    url = str(tmp_path / "stream")
    state = model_state(gen)
    pub = DeltaPublisher(url, state, dtype=BF16)
    try:
        pub.publish(0)
        pub.flush()
        truth = {0: published(state)}
        state["embed.weight"][5, 5] = float("nan")
        monkeypatch.setattr(pub._queue, "full", lambda: True)  # uploads lag: the step is coalesced, not read
        assert pub.publish(1) is False
        monkeypatch.undo()
        with pytest.raises(NonFiniteStepError) as caught:
            pub.flush()
        assert caught.value.step == 1 and caught.value.tensors == ("embed.weight",)
        pub.flush()  # not refused again
        assert Store(url).step_folders() == [0]
        state["embed.weight"][5, 5] = 2.0
        pub.publish(2)
        truth[2] = published(state)
    finally:
        pub.close()
    assert_replays(url, truth)


def test_a_stream_step_is_refused_after_its_end_with_every_tensor_named_and_read_to_its_end(tmp_path, gen):
    url = str(tmp_path / "stream")
    state = model_state(gen)
    truth = {}
    read = []

    def pairs():
        for n, t in state.items():
            read.append(n)
            yield n, t.clone()  # a materialised copy, released by the publisher before the next one

    with DeltaPublisher(url, None, dtype=BF16, on_backlog="block") as pub:
        bad = {n: t.clone() for n, t in state.items()}
        bad["embed.weight"][1, 1] = float("nan")
        with pytest.raises(NonFiniteStepError) as caught:  # a first step of a stream
            pub.publish(0, weights=iter(bad.items()))
        assert caught.value.tensors == ("embed.weight",)
        pub.publish(0, weights=pairs())
        truth[0] = published(state)
        train(state, gen)
        good = {n: t.clone() for n, t in state.items()}
        state["embed.weight"][2, 2] = float("inf")
        state["layer.0.bias"][0] = float("nan")
        read.clear()
        with pytest.raises(NonFiniteStepError) as caught:
            pub.publish(1, weights=pairs())
        assert caught.value.tensors == ("embed.weight", "layer.0.bias")
        assert read == list(state)  # read to its end (FSDP ranks wait in each tensor's collective)
        pub.flush()
        assert Store(url).steps() == [0] and stored_files(url, 1) == []
        for n, t in good.items():
            state[n].copy_(t)
        pub.publish(1, weights=pairs())
        truth[1] = published(state)
        train(state, gen)
        pub.publish(2, weights=pairs())
        truth[2] = published(state)
    with StreamReader(url) as reader:
        assert [reader.manifest(s).base_step for s in (1, 2)] == [0, 1]
    assert_replays(url, truth)


def test_the_refusal_crosses_a_process_boundary_as_itself():
    e = NonFiniteStepError("s3://b/run: step 7: refused: ...", url="s3://b/run", step=7, tensors=["w", "v"])
    assert e.context() == {"url": "s3://b/run", "step": 7, "tensor": "w"} and e.tensors == ("w", "v")
    back = from_record(error_record(e))
    assert type(back) is NonFiniteStepError and not can_retry(back)
    assert back.context() == e.context() and str(back) == str(e)
    import pickle

    again = pickle.loads(pickle.dumps(e))
    assert (again.step, again.tensors, str(again)) == (7, ("w", "v"), str(e))


def test_trainer_sync_surfaces_the_refusal_and_sends_the_step_again_after(tmp_path, gen):
    """The seam verl's checkpoint engine, TRL's weight transfer and vLLM's trainer engine publish through."""
    from rollout_loader.vllm.trainer_sync import TrainerSync

    url = str(tmp_path / "stream")
    state = model_state(gen)
    sync = TrainerSync(url, options=PublishOptions(dtype=BF16))
    try:
        assert sync.send(state.items()) == 0
        truth = {0: published(state)}
        bad = {n: t.clone() for n, t in state.items()}
        bad["norm.weight"][0] = float("nan")
        with pytest.raises(NonFiniteStepError, match="norm.weight"):
            sync.send(bad.items())
        assert sync.steps == [0]
        train(state, gen)
        assert sync.send(state.items()) == 1  # the refused step's number, now with good weights
        truth[1] = published(state)
    finally:
        sync.close()
    assert_replays(url, truth)


def test_the_transformers_callback_stops_training_with_the_refusal(tmp_path, gen):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from types import SimpleNamespace

    from transformers import TrainingArguments

    from deltasync.integrations.transformers import DeltaSyncCallback

    url = str(tmp_path / "stream")
    model = torch.nn.Linear(8, 4)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
    callback = DeltaSyncCallback(url, on_backlog="block")
    callback.on_train_begin(args, state, None, model=model)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    state.global_step = 1
    with pytest.raises(NonFiniteStepError, match="weight"):
        callback.on_step_end(args, state, None)
    assert callback.publisher is None  # closed: the stream's lease released
    assert Store(url).steps() == [0]
