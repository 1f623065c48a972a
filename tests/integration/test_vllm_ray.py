"""vLLM engines hosted in Ray actors (``ray.remote(vllm.LLM)`` and an ``AsyncLLM`` actor, as verl, SkyRL, OpenRLHF and
NeMo-RL host them), driven
through vLLM's own ``RayVLLMWeightSyncClient``: by deltasync's trainer engine from vLLM's trainer registry (a trainer
written against vLLM's API, one string changed), then by a ``Follower``; a partial failure (an actor killed) says
which actor holds which step; every engine ends bit-equal to a fresh engine loaded from the replayed step.

A real local Ray cluster (``ray.init``, temp folder of its own), real vLLM CPU engines in the actors (in-process in
each actor), the real vLLM client and trainer factory. ``examples/ray_fleet.py`` runs the same fleet from a script
(outside CI's budget; this is its sibling)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, replay_to_folder
from deltasync.engine import tensor_checksum
from deltasync.errors import (
    ConfigError,
    EngineConfigError,
    EngineUnreachableError,
    HeldStepError,
    StepNotFoundError,
    to_text,
)
from deltasync.testing import save_model_dir, tiny_qwen3
from tests.integration.conftest import PROMPTS, engine, generate

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "DELTASYNC_CPU_LIVE_WEIGHTS": "1",
              "VLLM_LOGGING_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module, its temp folder removed afterwards (short: Ray's socket paths)."""
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a local test cluster: no token file left in ~/.ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=folder)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def rollout_actor(model_dir: str, **kwargs):  # noqa: ANN201 - an actor handle
    from vllm import LLM

    from rollout_loader.vllm import WORKER_EXTENSION

    options = dict(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0,
                   distributed_executor_backend="uni", worker_extension_cls=WORKER_EXTENSION,
                   weight_transfer_config={"backend": "deltasync"})
    return ray.remote(num_cpus=0)(LLM).options(runtime_env={"env_vars": ENGINE_ENV}).remote(**{**options, **kwargs})


def async_rollout_actor(model_dir: str):  # noqa: ANN201 - an actor handle
    """A Ray actor that is a ``vllm.AsyncLLM`` (how SkyRL-style frameworks host vLLM): its engine core in a process of
    its own; deltasync pauses its scheduler around each update. Defined here so Ray ships the class by value."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_loader.vllm import WORKER_EXTENSION

    class AsyncRollout(AsyncLLM):
        def __init__(self, **engine_args: object) -> None:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.executor import Executor

            config = AsyncEngineArgs(**engine_args).create_engine_config(UsageContext.ENGINE_CONTEXT)
            super().__init__(vllm_config=config, executor_class=Executor.get_class(config), log_stats=False)

    env = {k: v for k, v in ENGINE_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return ray.remote(num_cpus=0)(AsyncRollout).options(runtime_env={"env_vars": env}).remote(
        model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0,
        worker_extension_cls=WORKER_EXTENSION, weight_transfer_config={"backend": "deltasync"})


def bf16_sums(model: torch.nn.Module) -> dict[str, int]:
    return {n: tensor_checksum(t.detach().to(torch.bfloat16)) for n, t in model.state_dict().items()}


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad()


class Failing:
    """Stands beside the real engines: an actor whose weight-transfer calls fail as a vLLM engine's would."""

    def __init__(self, text: str) -> None:
        self.text = text

    def get_weight_version(self) -> str:
        return "3"

    def init_weight_transfer_engine(self, request: object) -> None:
        raise RuntimeError(self.text)


class Scripted:
    """Stands beside the real engines: an actor with an ``LLM``'s weight-transfer surface whose first ``fail``
    updates fail as an engine's transient failure would (a damaged download); updating to the step it holds does
    nothing, as the deltasync engine does."""

    def __init__(self, fail: int) -> None:
        self.version, self.fail, self.updates = "2", fail, []

    def get_weight_version(self) -> str:
        return self.version

    def init_weight_transfer_engine(self, request: object) -> None: ...
    def start_weight_update(self) -> None: ...
    def finish_weight_update(self) -> None: ...
    def reset_prefix_cache(self) -> bool:
        return True

    def update_weights(self, request) -> None:  # noqa: ANN001
        from deltasync.errors import CorruptObjectError, to_text

        step = request.update_info["step"]
        if str(step) == self.version:
            return
        self.updates.append(step)
        if self.fail:
            self.fail -= 1
            raise RuntimeError(f"Worker failed with error '{to_text(CorruptObjectError('step 3: SHA-256 differs'))}'")

    def update_weight_version(self, version: str) -> None:
        self.version = version

    def seen(self) -> list[int]:
        return self.updates


class LLMLike(Scripted):
    """Stands beside the real engines: an actor with an ``LLM``'s surface (``generate``, ``collective_rpc``) as well."""

    def generate(self, prompts: object = None) -> list:
        return []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return []


class Wrapped(Scripted):
    """An actor of a framework that wraps a target itself (``held_step``, ``init``, ``update``, ``status``)."""

    def held_step(self) -> int:
        return 2

    def init(self, settings: object) -> None: ...
    def update(self, step: int) -> None: ...
    def status(self, checksums: bool = True) -> dict:
        return {}


def test_one_handle_is_a_ray_target_whatever_methods_its_actor_has(cluster):
    """A handle answers for every method of its actor's class (an ``LLM`` actor's has ``generate`` and
    ``collective_rpc``), yet each only as ``.remote()``: one handle is driven as Ray actors are, never called as
    an ``LLM`` or a client in this process (which raised TypeError on the first call)."""
    from rollout_loader.vllm import RayWeightTransfer, VllmTarget

    for cls in (LLMLike, Wrapped):
        actor = ray.remote(num_cpus=0)(cls).remote(0)
        client = VllmTarget(actor).client
        assert isinstance(client, RayWeightTransfer) and client.held_step() == 2
        client.update(3)
        assert client.held_step() == 3
        ray.kill(actor)


def test_a_partial_failure_names_who_holds_what_and_a_retry_converges(cluster):
    from deltasync.errors import CorruptObjectError
    from rollout_loader.vllm import RayWeightTransfer

    actors = [ray.remote(num_cpus=0)(Scripted).remote(fail) for fail in (0, 1)]
    client = RayWeightTransfer(actors)
    assert client.held_step() == 2
    with pytest.raises(CorruptObjectError) as e:  # the engine's class: retrying can help
        client.update(3)
    assert "failed on 1 of 2 actor(s)" in str(e.value) and "actor 0 holds step 3, actor 1 holds step 2 (failed)" \
        in str(e.value)
    assert client.held_step() is None  # they differ now: said, not guessed
    client.update(3)  # the retry: actor 0 holds step 3 already (nothing to do), actor 1 applies it
    assert client.held_step() == 3 and ray.get([a.seen.remote() for a in actors]) == [[3], [3, 3]]
    for a in actors:
        ray.kill(a)


def test_ray_errors_come_back_as_the_engine_raised_them(cluster):
    from rollout_loader.vllm import EngineSettings, RayWeightTransfer, VllmTarget

    settings = EngineSettings(url="s3://b/run")
    for text, error in [(f"Worker failed with error '{to_text(HeldStepError('step 3 differs'))}', please check",
                         HeldStepError),
                        ("Weight transfer not configured. Please set weight_transfer_config", EngineConfigError)]:
        actor = ray.remote(num_cpus=0)(Failing).remote(text)
        client = VllmTarget([actor]).client
        assert isinstance(client, RayWeightTransfer) and client.held_step() == 3
        with pytest.raises(error, match="Ray actor 0"):
            client.init(settings)
        ray.kill(actor)
    with pytest.raises(ConfigError, match="expected a vllm.LLM"):
        VllmTarget([object()])


def test_engines_in_ray_actors_follow_through_vllms_ray_client(cluster, tmp_path):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget
    from rollout_loader.vllm.trainer import DeltasyncTrainerInitInfo

    model = tiny_qwen3(hidden_size=128, layers=2, seed=0).float()
    model_dir = str(save_model_dir(model, tmp_path / "model"))
    url = str(tmp_path / "stream")
    actors = [rollout_actor(model_dir), async_rollout_actor(model_dir)]  # an LLM and an AsyncLLM
    client = RayVLLMWeightSyncClient(actors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # a trainer written against vLLM's trainer API: deltasync by its init info (registered when it is imported)
    info = DeltasyncTrainerInitInfo(url=url, rank=0, publish={"dtype": "bfloat16", "files": model_dir},
                                    engine={"verify": "all"})
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    try:
        assert trainer.send_weights() == 0  # the weights the engines started from: an anchor, held by both
        for seed in (1, 2):
            train(model, opt, seed)
            assert trainer.send_weights() == seed  # published, committed, applied and verified in both actors
        assert ray.get([a.get_weight_version.remote() for a in actors]) == ["2", "2"]
        with pytest.raises(ConfigError, match="needs the round's weights when it was made without a source"):
            WeightTransferTrainerFactory.trainer_init(
                DeltasyncTrainerInitInfo(url=str(tmp_path / "other"), rank=1), client=client).send_weights()
    finally:
        trainer.shutdown()
    with pytest.raises(ConfigError, match=r"DeltasyncTrainerInitInfo.publish: unknown publish option\(s\) \['dtyp'\]"):
        DeltasyncTrainerInitInfo(url=url, rank=0, publish={"dtyp": "bfloat16"})

    # the same actors followed by a Follower: the next step only (each actor's version names step 2)
    target = VllmTarget(client, verify="all")
    follower = Follower(url, target)
    with DeltaPublisher(url, model, dtype=torch.bfloat16, on_backlog="block") as pub:
        train(model, opt, 3)
        pub.publish(3)
    try:
        assert follower.sync() == [3]
        assert target.client._pauses == [False, True]  # the AsyncLLM's scheduler was paused around the update
        assert ray.get(actors[1].is_paused.remote()) is False  # and resumed
        status = target.status()  # every engine's tensors checksummed again from its own bits
        assert [r["checksums"] == bf16_sums(model) for r in status["replicas"]] == [True, True]
        assert [r["held_step"] for r in status["replicas"]] == [3, 3]
        tokens = [list(o.outputs[0].token_ids) for o in ray.get(actors[0].generate.remote(PROMPTS, _greedy(),
                                                                                           use_tqdm=False))]

        # an actor lost mid-run: the other applies the step; the error says who holds what; the follower keeps step 3
        ray.kill(actors[1])
        with DeltaPublisher(url, model, dtype=torch.bfloat16, on_backlog="block") as pub:
            train(model, opt, 4)
            pub.publish(4)
        with pytest.raises(EngineUnreachableError) as e:
            follower.sync()
        assert "actor 0 holds step 4, actor 1 holds an unknown step (failed)" in str(e.value)
        assert target.step == 3
        with pytest.raises(StepNotFoundError):  # a step never committed: refused by the live actor, which keeps 4
            target.client.update(99)
    finally:
        follower.close()
    assert ray.get(actors[0].get_weight_version.remote()) == "4"
    live = [list(o.outputs[0].token_ids) for o in ray.get(actors[0].generate.remote(PROMPTS, _greedy(),
                                                                                     use_tqdm=False))]
    ray.kill(actors[0])

    # the reference: a fresh engine loaded from the replayed step 4
    replayed = replay_to_folder(url, 4, str(tmp_path / "step4"))
    with engine(Path(replayed.path), "bfloat16", live=True) as fresh:
        assert generate(fresh) == live
    assert tokens != live  # step 4 changed the output


def _greedy():  # noqa: ANN202
    from vllm import SamplingParams

    return SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True)
