"""The ``deltasync`` backend inside verl's own code, on CPU: registry, actor and rollout workers, manager.

What is verl's real code here: ``import verl``'s plugin loading (``verl.plugins`` entry points),
``CheckpointEngineRegistry``, ``ActorRolloutRefWorker.update_weights`` (the actor side: it asks the training
engine for its per-tensor generator and calls ``send_weights`` on every rank), ``CheckpointEngineWorker.update_weights``
(the rollout side: ``receive_weights`` handed to the server adapter), ``CheckpointEngineConfig``/``RolloutConfig``,
``RolloutReplica`` and ``CheckpointEngineManager``. The workers are made with ``__new__`` and given their
attributes, as verl's own CPU test does (``tests/checkpoint_engine/test_global_steps_on_cpu.py``): their
``__init__`` builds FSDP/vLLM. Stand-ins beside them: the training engine (yields a tiny model's full tensors, as
FSDP's ``get_per_tensor_param`` does once gathered), the server adapter (loads what it is given into a state dict,
as vLLM's ``load_weights`` would) and, for the manager's failure report only, fake vLLM servers.
``tests/integration/test_verl_vllm.py`` runs the same paths into a real vLLM server that verl launches.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("ray")

from omegaconf import OmegaConf  # noqa: E402  (verl's dependency)
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl.workers.rollout.replica import RolloutMode, RolloutReplica  # noqa: E402

from deltasync import StreamReader  # noqa: E402
from deltasync.errors import (  # noqa: E402
    ConfigError,
    CorruptObjectError,
    EngineError,
    TensorMismatchError,
    can_retry,
    to_text,
)
from rollout_loader.integrations import verl as integration  # noqa: E402
from rollout_loader.vllm.settings import EngineSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync"


# --- stand-ins beside verl's real classes ---


class TrainingEngine:
    """verl's training engine as the actor worker sees it: ``get_per_tensor_param()`` -> (generator, peft config)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.yielded = 0

    def get_per_tensor_param(self):
        def gen():
            for name, tensor in self.model.state_dict().items():
                self.yielded += 1
                yield name, tensor.detach()
        return gen(), None


class LoadingAdapter:
    """verl's server adapter as ``CheckpointEngineWorker`` calls it; loads into a state dict like ``load_weights``."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.loaded: list[list[str]] = []
        self.global_steps: int | None = None

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        assert wire_format == "named_tensors"
        names = []
        async for name, tensor in weights:
            self.state[name] = tensor.clone()
            names.append(name)
        self.loaded.append(names)
        self.global_steps = global_steps


def actor_worker(model: torch.nn.Module, *, is_master: bool, **options) -> ActorRolloutRefWorker:
    """An actor worker as ``init_model`` leaves it, with verl's own registry making its checkpoint engine."""
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.config = OmegaConf.create({"rollout": {"checkpoint_engine": {"backend": "deltasync"}}})
    worker.actor = SimpleNamespace(engine=TrainingEngine(model))
    worker.checkpoint_engine = CheckpointEngineRegistry.new("deltasync", is_master=is_master, bucket_size=1 << 20,
                                                            **options)
    return worker


def rollout_worker(**options) -> CheckpointEngineWorker:
    worker = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
    worker.server_adapter = LoadingAdapter()
    worker.checkpoint_engine = CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, **options)
    return worker


async def sync(actors: list[ActorRolloutRefWorker], rollout: CheckpointEngineWorker | None, step: int | None) -> list:
    """One weight sync as verl's CheckpointEngineManager runs it: every actor rank and the rollout at once."""
    calls = [ActorRolloutRefWorker.update_weights(a, global_steps=step) for a in actors]
    if rollout is not None:
        calls.append(CheckpointEngineWorker.update_weights(rollout, global_steps=step))
    return await asyncio.gather(*calls)


def train(model: torch.nn.Module, seed: int) -> None:
    """One 'optimizer step': a few elements of a few tensors move by amounts bf16 sees."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % 3 == seed % 3:
                flat = p.view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 50)]
                flat[idx] += 0.25 * torch.randn(idx.numel(), generator=g)


def bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8),
                                                                                  b[k].view(-1).view(torch.uint8))
                                        for k in a)


@pytest.fixture
def model():
    from deltasync.testing import tiny_qwen3

    return tiny_qwen3(hidden_size=128, layers=2).float()


# --- registration through verl's own plugin loading ---


def _entry_point_folder(folder: Path) -> Path | None:
    """A folder declaring our ``verl.plugins`` entry point exactly as pyproject.toml does, for an environment whose
    installed deltasync predates it (an editable install made before the entry point was added); None when the
    installed metadata has it already."""
    from importlib.metadata import entry_points

    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["verl.plugins"]
    assert declared == {"deltasync": "rollout_loader.integrations.verl"}
    if any(ep.name == "deltasync" for ep in entry_points(group="verl.plugins")):
        return None
    info = folder / "deltasync_verl_entry-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deltasync-verl-entry\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    return folder


def test_verl_finds_the_deltasync_backend_through_its_plugin_entry_points(tmp_path):
    """A fresh process: ``import verl`` loads the entry point; nothing of ours is imported by hand."""
    folder = _entry_point_folder(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*([str(folder)] if folder else []), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    script = textwrap.dedent("""
        import sys
        import verl
        from verl.checkpoint_engine import CheckpointEngineRegistry
        cls = CheckpointEngineRegistry.get("deltasync")
        print(cls.__module__, cls.__name__)
    """)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["rollout_loader.integrations.verl.engine", "DeltasyncCheckpointEngine"]


def test_importing_rollout_loader_does_not_import_verl():
    r = subprocess.run([sys.executable, "-c", "import sys, rollout_loader, rollout_loader.integrations; "
                        "print(sorted(m for m in ('verl', 'ray') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# --- the registry path ---


def test_registry_path_yields_each_step_bit_equal_to_its_replay(model, tmp_path):
    """Three steps from two actor ranks (rank 1 drains) to a rollout worker: the adapter's weights equal the
    stream's replay of each step and the trainer's bf16 weights; after the first step only changed tensors move."""
    url = str(tmp_path / "stream")
    actors = [actor_worker(model, is_master=True, url=url), actor_worker(model, is_master=False, url=url)]
    rollout = rollout_worker(url=url)
    adapter = rollout.server_adapter
    held = None
    try:
        for step in range(3):
            if step:
                train(model, seed=step)
            results = asyncio.run(sync(actors, rollout, step))
            metrics, drained = results[0], results[1]
            assert drained == {}  # rank 1 publishes nothing, returns nothing
            assert metrics["checkpoint_engine/deltasync_step"] == step
            assert metrics["checkpoint_engine/deltasync_anchor"] == (1.0 if step == 0 else 0.0)
            assert metrics["checkpoint_engine/payload_mbytes"] > 0
            assert 0 < metrics["checkpoint_engine/changed_ratio"] <= 1
            assert all(a.actor.engine.yielded == (step + 1) * len(model.state_dict()) for a in actors)  # in step
            want = bf16(model)
            with StreamReader(url) as reader:
                replayed = reader.state_dict(step)
            assert bits_equal(replayed, want)
            assert bits_equal(adapter.state, replayed)
            assert adapter.global_steps == step
            changed = sorted(want) if held is None else sorted(
                n for n in want if not torch.equal(want[n].view(torch.int16), held[n].view(torch.int16)))
            assert sorted(adapter.loaded[-1]) == changed and (step == 0 or len(changed) < len(want))
            held = want

        # verl repeats a step (or passes none) only to wake replicas: nothing is published, nothing moves
        for again in (2, None):
            results = asyncio.run(sync(actors, rollout, again))
            assert results[0]["checkpoint_engine/deltasync_step"] == 2 and adapter.loaded[-1] == []
        with StreamReader(url) as reader:
            assert reader.steps() == [0, 1, 2]
    finally:
        for w in (*actors, rollout):
            w.checkpoint_engine.close()


def test_a_resumed_actor_goes_on_after_the_stream_and_refuses_to_contradict_it(model, tmp_path):
    url = str(tmp_path / "stream")
    first = actor_worker(model, is_master=True, url=url)
    asyncio.run(sync([first], None, 0))
    train(model, seed=1)
    asyncio.run(sync([first], None, 1))
    del first  # verl never closes an engine: dropping it closes its publisher, releasing the stream's lease
    gc.collect()

    resumed = actor_worker(model, is_master=True, url=url)  # a restarted trainer, at its checkpoint of step 1
    try:
        [metrics] = asyncio.run(sync([resumed], None, 1))  # the step the stream ends with: proved, not published
        assert metrics["checkpoint_engine/deltasync_step"] == 1
        with pytest.raises(ConfigError, match=rf"already holds step 1, after the trainer's step 0.*new URL.*"
                                              rf"{SETTINGS}.url"):
            asyncio.run(sync([resumed], None, 0))  # a checkpoint older than the stream's newest step
        train(model, seed=2)  # weights that are not step 1's, claimed as step 1
        with pytest.raises(ConfigError, match=r"holds step 1, the trainer's step, but not its weights"):
            asyncio.run(sync([resumed], None, 1))
        [metrics] = asyncio.run(sync([resumed], None, 2))
        assert metrics["checkpoint_engine/deltasync_step"] == 2
        assert resumed.actor.engine.yielded == 4 * len(model.state_dict())  # every pair read, refused or not
        with StreamReader(url) as reader:
            assert reader.steps() == [0, 1, 2] and bits_equal(reader.state_dict(2), bf16(model))
    finally:
        resumed.checkpoint_engine.close()


def test_a_rollout_that_did_not_take_a_step_whole_gets_every_tensor_next_time(model, tmp_path):
    url = str(tmp_path / "stream")
    actor = actor_worker(model, is_master=True, url=url)
    rollout = rollout_worker(url=url, timeout_s=30)
    try:
        asyncio.run(sync([actor], rollout, 0))
        train(model, seed=1)
        asyncio.run(sync([actor], None, 1))

        async def fail_midway():
            gen = rollout.checkpoint_engine.receive_weights(global_steps=1)
            await anext(gen)
            await gen.aclose()  # the adapter failed after one tensor

        asyncio.run(fail_midway())
        train(model, seed=2)
        asyncio.run(sync([actor], rollout, 2))
        assert sorted(rollout.server_adapter.loaded[-1]) == sorted(model.state_dict())
        assert bits_equal(rollout.server_adapter.state, bf16(model))
    finally:
        actor.checkpoint_engine.close()
        rollout.checkpoint_engine.close()


# --- configuration errors, each naming the setting ---


@pytest.mark.parametrize(("options", "named", "says"), [
    ({}, "url", "missing"),
    ({"uri": "s3://b/r"}, "uri", "not a deltasync option"),
    ({"url": ""}, "url", "non-empty"),
    ({"url": "x", "storage_options": "key=secret"}, "storage_options", "mapping"),
    ({"url": "x", "dtype": "int8"}, "dtype", "bfloat16"),
    ({"url": "x", "anchor_every": 0}, "anchor_every", ">= 1"),
    ({"url": "x", "verify": "everything"}, "verify", "incremental"),
    ({"url": "x", "trusted_keys": []}, "trusted_keys", "public keys"),
    ({"url": "x", "trusted_keys": ["/no/such/key.pub"], "stream_id": "run-7"}, "trusted_keys", ""),
    ({"url": "x", "stream_id": "../run"}, "stream_id", "a stream id"),
    ({"url": "x", "changed_only": "yes"}, "changed_only", "true or false"),
    ({"url": "x", "prefetch": 1}, "prefetch", "true or false"),
    ({"url": "x", "timeout_s": -1}, "timeout_s", "seconds"),
])
def test_a_bad_option_is_one_config_error_naming_the_setting(options, named, says):
    """As verl builds the engine (actor and rollout side alike), from a config as Hydra leaves it."""
    config = CheckpointEngineConfig(backend="deltasync", engine_kwargs={"deltasync": options})
    kwargs = OmegaConf.create({"engine_kwargs": config.engine_kwargs}).engine_kwargs.get("deltasync", {})
    for side in ({"is_master": True}, {}):
        with pytest.raises(ConfigError) as e:
            CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, **side, **kwargs)
        assert f"{SETTINGS}.{named}" in str(e.value) and says in str(e.value), str(e.value)
        assert "secret" not in str(e.value)


def test_options_from_an_omegaconf_node_are_accepted():
    node = OmegaConf.create({"url": "s3://bucket/run", "storage_options": {"anon": False}, "trusted_keys": None})
    s = integration.VerlSettings.parse(node)
    assert s.storage_options == {"anon": False} and type(s.storage_options) is dict


# --- the manager: configuration errors, and a failure report with stand-in servers ---


class _Replica(RolloutReplica):
    """verl's RolloutReplica with its servers given (launching real ones is tests/integration/test_verl_vllm.py)."""

    async def launch_servers(self):  # pragma: no cover - never launched here
        raise AssertionError


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeServer:
    """Stands in for verl's vLLMHttpServer actor handle (``.method.remote(...)`` awaitables); ``fail_step``: the
    engine refuses that step (and, like deltasync's engine, keeps the step it held), with plain words or, given
    ``error``, as vLLM relays the deltasync engine's error (its record leading its text)."""

    def __init__(self, fail_step: int | None = None, error: Exception | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_step = fail_step
        self.error = error
        self.held: int | None = None
        self.global_steps = None

        async def collective_rpc(method, timeout=None, args=(), kwargs=None):
            self.calls.append((method, kwargs))
            if method == "update_weights":
                step = kwargs["update_info"]["step"]
                if step == self.fail_step and self.error is not None:
                    raise RuntimeError(f"Call to collective_rpc method failed: Worker failed with error "
                                       f"'{to_text(self.error)}', please check the stack trace above")
                if step == self.fail_step:
                    raise RuntimeError(f"ChecksumMismatchError: step {step} does not match; rolled back to step "
                                       f"{self.held}")
                self.held = step

        async def record(*a, **kw):
            self.calls.append(("record", a, kw))
            return {"aborted_count": 0, "request_ids": []}

        async def set_global_steps(step):
            self.global_steps = step

        self.collective_rpc = _Remote(collective_rpc)
        self.set_global_steps = _Remote(set_global_steps)
        for name in ("abort_all_requests", "resume_generation", "clear_kv_cache", "resume_engine_generation",
                     "open_submission_gate"):
            setattr(self, name, _Remote(record))


def _rollout_config(**overrides) -> RolloutConfig:
    kw = dict(name="vllm", engine_kwargs={"vllm": {"weight_transfer_config": {"backend": "deltasync"}}})
    kw.update(overrides)
    return RolloutConfig(**kw)


def _replica(rank: int, server: FakeServer, **overrides) -> _Replica:
    replica = _Replica(replica_rank=rank, config=_rollout_config(tensor_model_parallel_size=1, **overrides),
                       model_config=None, gpus_per_node=1)
    replica.servers = [server]
    replica.rollout_mode = RolloutMode.STANDALONE
    return replica


class ActorGroup:
    """Stands in for verl's actor RayWorkerGroup: ``update_weights`` runs the real actor worker method on each rank
    (threads: verl's are processes) and returns awaitables, as the group returns object references."""

    def __init__(self, workers: list[ActorRolloutRefWorker]) -> None:
        self.workers = workers
        self.world_size = len(workers)

    def update_weights(self, global_steps=None, mode="auto"):
        async def all_ranks():
            return await asyncio.gather(*(ActorRolloutRefWorker.update_weights(w, global_steps=global_steps, mode=mode)
                                          for w in self.workers))
        with ThreadPoolExecutor(1) as pool:  # off the manager's own event loop, as Ray runs them elsewhere
            results = pool.submit(asyncio.run, all_ranks()).result()

        async def done(r):
            return r
        return [done(r) for r in results]


def _manager_config(url: str, backend: str = "deltasync", **options) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend=backend, engine_kwargs={"deltasync": {"url": url, **options}})


@pytest.mark.parametrize(("config", "replica", "named"), [
    (dict(backend="naive"), {}, "actor_rollout_ref.rollout.checkpoint_engine.backend"),
    ({}, dict(name="sglang"), "actor_rollout_ref.rollout.name"),
    ({}, dict(engine_kwargs={"vllm": {}}), "actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config"),
    ({}, dict(engine_kwargs={"vllm": {"weight_transfer_config": {"backend": "nccl"}}}),
     "actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config"),
    ({}, dict(data_parallel_size=2), "actor_rollout_ref.rollout.data_parallel_size"),
    (dict(anchor_every="often"), {}, f"{SETTINGS}.anchor_every"),
])
def test_the_manager_refuses_a_bad_configuration_naming_the_setting(tmp_path, config, replica, named):
    with pytest.raises(ConfigError) as e:
        integration.DeltasyncCheckpointManager(_manager_config(str(tmp_path), **config), ActorGroup([]),
                                               [_replica(0, FakeServer(), **replica)])
    assert named in str(e.value), str(e.value)


def test_the_manager_says_which_replica_holds_which_step_and_a_retry_converges(model, tmp_path):
    url = str(tmp_path / "stream")
    actors = ActorGroup([actor_worker(model, is_master=True, url=url), actor_worker(model, is_master=False, url=url)])
    servers = [FakeServer(), FakeServer(fail_step=0)]
    manager = integration.DeltasyncCheckpointManager(_manager_config(url), actors,
                                                     [_replica(i, s) for i, s in enumerate(servers)])
    try:
        with pytest.raises(EngineError, match=r"step 0: 1 of 2 .*replica 0 holds step 0, replica 1 holds step "
                                              r"unknown.*replica 1: .*ChecksumMismatchError"):
            manager.update_weights(0)
        servers[1].fail_step = None
        metrics = manager.update_weights(0)  # again: the stream has step 0, nothing is published twice
        assert metrics["checkpoint_engine/deltasync_step"] == 0 and [s.held for s in servers] == [0, 0]
        train(model, seed=1)
        metrics = manager.update_weights(1)
        assert metrics["checkpoint_engine/deltasync_step"] == 1 and metrics["checkpoint_engine/deltasync_anchor"] == 0
        assert 0 < metrics["checkpoint_engine/changed_ratio"] < 1 and metrics["checkpoint_engine/payload_mbytes"] > 0
        assert [s.held for s in servers] == [1, 1] and [s.global_steps for s in servers] == [1, 1]
        for s in servers:
            methods = [c[0] for c in s.calls if c[0] != "record"]
            assert methods.count("init_weight_transfer_engine") == 1  # once per replica, with the stream
            init = next(c[1] for c in s.calls if c[0] == "init_weight_transfer_engine")
            assert init == {"init_info": EngineSettings(url=url).init_info()}
            assert methods[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]
        assert manager.describe() == "replica 0 holds step 1, replica 1 holds step 1"
    finally:
        for w in actors.workers:
            w.checkpoint_engine.close()


def test_the_managers_failure_is_the_class_the_engine_raised(model, tmp_path):
    """The engine's error crosses verl's server and Ray as its record: the manager raises that class (the first one
    retrying cannot help), so whoever drives verl gets the engine's answer to "retry?": a step that does not fit the
    model never will, a damaged download may."""
    url = str(tmp_path / "stream")
    actors = ActorGroup([actor_worker(model, is_master=True, url=url)])
    servers = [FakeServer(fail_step=0, error=CorruptObjectError("step 0: an object's SHA-256 differs")),
               FakeServer(fail_step=0, error=TensorMismatchError("step 0 does not fit the engine: 'w' is [4, 4]"))]
    manager = integration.DeltasyncCheckpointManager(_manager_config(url), actors,
                                                     [_replica(i, s) for i, s in enumerate(servers)])
    try:
        with pytest.raises(TensorMismatchError, match=r"step 0: 2 of 2 .*replica 1: TensorMismatchError: step 0 does "
                                                      r"not fit .*retrying cannot help") as e:
            manager.update_weights(0)
        assert not can_retry(e.value) and "deltasync-error" not in str(e.value)
        servers[1].fail_step = None
        with pytest.raises(CorruptObjectError, match=r"replica 0 holds step unknown, replica 1 holds step 0; replica "
                                                     r"0: CorruptObjectError: .*again retries") as e:
            manager.update_weights(0)
        assert can_retry(e.value)
    finally:
        for w in actors.workers:
            w.checkpoint_engine.close()
