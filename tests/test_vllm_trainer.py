"""deltasync's trainer engine in vLLM's trainer registry (rollout_loader/vllm/trainer.py), from vLLM's real
``WeightTransferTrainerFactory`` and ``WeightSource`` classes: what it publishes (read back by an independent path,
``StreamReader.state_dict``), what it sends the inference side through a client, and its configuration errors.

The client here records the four protocol calls (it stands beside the real engines: tests/integration/
test_vllm_ray.py and test_vllm_engine.py drive real vLLM engines through vLLM's Ray and HTTP clients)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deltasync import StreamReader
from deltasync.engine import tensor_checksum
from deltasync.errors import ConfigError

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: E402

from rollout_loader.vllm.trainer import DeltasyncTrainerInitInfo  # noqa: E402


class Recorder:
    """vLLM's four-method VLLMWeightSyncClient protocol, recording each call (an engine that holds what it is told)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


class Gathered(WeightSource):
    """A WeightSource whose tensors are made anew on every pass (as FSDP's full_tensor() does)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.passes = 0

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        for n, p in self.module.named_parameters():
            yield n, p.detach().clone()


def _bf16(module: torch.nn.Module) -> dict[str, int]:
    return {n: tensor_checksum(t.detach().to(torch.bfloat16)) for n, t in module.state_dict().items()}


def _stream(url: str, step: int) -> dict[str, int]:
    with StreamReader(url) as reader:
        return {n: tensor_checksum(t) for n, t in reader.state_dict(step).items()}


@pytest.mark.parametrize("how", ["module", "source", "weights"])
def test_each_round_is_published_and_sent_as_a_step(how, tmp_path):
    model, url, client = _model(), str(tmp_path / "stream"), Recorder()
    source = {"module": ModuleSource(model), "source": Gathered(model), "weights": None}[how]
    info = DeltasyncTrainerInitInfo(url=url, rank=0, publish={"dtype": "bfloat16", "anchor_every": 3},
                                    engine={"verify": "all"})
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    try:
        assert client.calls[0][0] == "init" and client.calls[0][1]["url"] == url
        assert client.calls[0][1]["verify"] == "all" and client.calls[0][1]["step"] is None
        for step in range(4):
            if step:
                with torch.no_grad():
                    model[0].weight[step] += 0.25
            pairs = model.named_parameters() if how == "weights" else None
            assert engine.send_weights(pairs) == step
            assert _stream(url, step) == _bf16(model)  # the trainer's bits, read back independently
        assert engine.send_weights(model.named_parameters() if how == "weights" else None, step=10) == 10
    finally:
        engine.shutdown()
    sent = [c for c in client.calls if c[0] != "init"]
    assert sent == [c for s in (0, 1, 2, 3, 10) for c in (("start", None), ("update", {"step": s}), ("finish", str(s)))]
    if how == "source":
        assert source.passes == 5  # one pass per round, each tensor diffed as it arrived
    with StreamReader(url) as reader:
        assert [reader.manifest(s).kind for s in (0, 1, 2, 3, 10)] == ["anchor", "delta", "delta", "anchor", "delta"]


def test_a_resumed_trainer_goes_on_after_the_newest_committed_step(tmp_path):
    model, url = _model(), str(tmp_path / "stream")
    for expected in ([0, 1], [2]):
        engine = WeightTransferTrainerFactory.trainer_init(DeltasyncTrainerInitInfo(url=url, rank=0),
                                                           client=Recorder(), source=ModuleSource(model))
        try:
            assert [engine.send_weights() for _ in expected] == expected
        finally:
            engine.shutdown()


@pytest.mark.parametrize("how", ["module", "weights"])
def test_a_resumed_trainer_at_a_committed_step_proves_it_and_publishes_nothing(how, tmp_path):
    """A trainer restarted from its checkpoint at step 1 syncs step 1 again: the stream holds it, so nothing is
    published once its weights are proved to be step 1's (the engines are still brought there); a checkpoint of
    another run at that step is refused, naming tensors; a step before the newest is refused."""
    model, url = _model(), str(tmp_path / "stream")

    def engine_for(m):
        source = ModuleSource(m) if how == "module" else None
        return WeightTransferTrainerFactory.trainer_init(DeltasyncTrainerInitInfo(url=url, rank=0), client=Recorder(),
                                                         source=source)

    def send(engine, m, step):
        return engine.send_weights(m.named_parameters() if how == "weights" else None, step=step)

    first = engine_for(model)
    try:
        send(first, model, 0)
        with torch.no_grad():
            model[0].bias += 1.0
        send(first, model, 1)
    finally:
        first.shutdown()
    resumed = engine_for(model)
    try:
        assert send(resumed, model, 1) == 1  # proved; nothing published
        assert resumed.target.client.client.calls[-3:] == [("start", None), ("update", {"step": 1}), ("finish", "1")]
        with pytest.raises(ConfigError, match="already holds step 1, after the trainer's step 0"):
            send(resumed, model, 0)
    finally:
        resumed.shutdown()
    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1]
    other = _model()
    with torch.no_grad():
        other[2].weight += 1.0
    stranger = engine_for(other)
    try:
        with pytest.raises(ConfigError, match=r"holds step 1, the trainer's step, but not its weights \(2 tensors "):
            send(stranger, other, 1)
    finally:
        stranger.shutdown()


def test_ranks_that_do_not_write_drain_their_source_and_touch_nothing(tmp_path):
    model, url, client = _model(), str(tmp_path / "stream"), Recorder()
    source = Gathered(model)
    engine = WeightTransferTrainerFactory.trainer_init(DeltasyncTrainerInitInfo(url=url, rank=1), client=client,
                                                       source=source)
    assert engine.send_weights() is None and engine.send_weights(step=4) == 4
    assert source.passes == 2 and client.calls == []  # iterated in step with rank 0's collectives, nothing sent
    assert not (tmp_path / "stream").exists()
    engine.shutdown()


@pytest.mark.parametrize(("fields", "needle"), [
    (dict(url=""), "DeltasyncTrainerInitInfo.url: expected the stream's URL"),
    (dict(url="x", rank=-1), "DeltasyncTrainerInitInfo.rank"),
    (dict(url="x", storage_options=[1]), "DeltasyncTrainerInitInfo.storage_options"),
    (dict(url="x", publish={"anchor_every": 0}), "publish option anchor_every must be a whole number"),
    (dict(url="x", publish={"dtype": "bfloat17"}), "publish option dtype must be a torch.dtype or its name"),
    (dict(url="x", publish={"colour": 1}), r"DeltasyncTrainerInitInfo.publish: unknown publish option\(s\)"),
    (dict(url="x", publish=3), "DeltasyncTrainerInitInfo.publish: expected PublishOptions or a mapping"),
    (dict(url="x", engine={"verify": "most"}), "deltasync engine setting verify"),
    (dict(url="x", engine={"uri": "y"}), r"unknown setting\(s\) \['uri'\]"),
])
def test_bad_configuration_names_the_setting(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        DeltasyncTrainerInitInfo(**{"rank": 0, **fields})


def test_bad_calls_are_refused_before_anything_is_published(tmp_path):
    model, url = _model(), str(tmp_path / "stream")
    engine = WeightTransferTrainerFactory.trainer_init(DeltasyncTrainerInitInfo(url=url, rank=0), client=Recorder(),
                                                       source=ModuleSource(model))
    try:
        with pytest.raises(ConfigError, match="none when it was made with one"):
            engine.send_weights(model.named_parameters())
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match="source must be a vLLM WeightSource"):
        WeightTransferTrainerFactory.trainer_init(DeltasyncTrainerInitInfo(url=url, rank=0), client=Recorder(),
                                                  source=model)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a vLLM VLLMWeightSyncClient or a weight-transfer client, got object"):
        WeightTransferTrainerFactory.trainer_init(DeltasyncTrainerInitInfo(url=url, rank=0), client=object(),
                                                  source=ModuleSource(model))  # type: ignore[arg-type]
    with StreamReader(url) as reader:
        assert reader.steps() == []
    other = tmp_path / "untouched"
    with pytest.raises(ConfigError):
        WeightTransferTrainerFactory.trainer_init(DeltasyncTrainerInitInfo(url=str(other), rank=0), client=object(),
                                                  source=ModuleSource(model))  # type: ignore[arg-type]
    assert not other.exists()  # refused before the publisher made anything
