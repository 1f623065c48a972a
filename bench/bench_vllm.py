"""vLLM benchmark: how long generation is paused per step on the weight-transfer-engine path, and its parts.

    .venv/bin/python bench/bench_vllm.py [--steps 10] [--contend] [--hidden 768 --layers 12]

Trains a Qwen3-shaped model (>= 100M parameters, AdamW, lr 1e-6) and publishes every step as bf16 to a
local store. A real vLLM CPU engine (in-process, live weights) started with
``weight_transfer_config={"backend": "deltasync"}`` follows it through vLLM's own ``LLM`` methods, as an RL
loop does between two rollouts. Per step:

* the pause: from ``start_weight_update()`` to ``reset_prefix_cache()`` returning (start, ``update_weights``,
  ``finish_weight_update``, reset), with the engine's own parts (finding the step in the manifest, taking the
  staged step, the in-place write, the ranks' agreement, the checksum comparison; see ``PAUSE_PARTS``) and
  what vLLM itself spends around them;
* publish() returning -> the step staged in the engine (encoded, committed, announced on the publisher's
  event feed, then fetched, verified, decoded and sealed by the engine in the background; ``--poll``: found
  by the engine's polling instead);
* baseline, same run, same step: a full reload of the step's replayed checkpoint through vLLM's own
  ``reload_weights`` (plus the same prefix-cache reset); and two references: the floor of the pause (the bare
  XOR scatter of the same step's positions, numba's plain kernel, nothing checked or hashed) and one plain
  copy of the engine's weights.

Every step is verified by the engine (incremental checksums); at the end the engine's weights are checksummed
from scratch against the trainer's last step. Prints a table, writes JSON (``--contend``: a CPU-bound
competitor runs throughout, results named ``vllm-contended``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Training, machine, parser, write_results
from deltasync import DeltaPublisher, StreamReader, replay_to_folder
from deltasync.testing import save_model_dir
from rollout_loader.vllm import start_engine
from rollout_loader.vllm.worker import transfer_status

PROMPTS = ["def main():\n    ", "import os\nimport sys\n\nclass "]


def _engine(llm: Any) -> Any:
    """The in-process worker's deltasync weight-transfer engine (for its recorded pause parts)."""
    return llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]


def _wait_staged(engine: Any, step: int, *, sealed: bool, timeout_s: float = 300.0) -> float:
    """Wait until the engine's prefetcher holds ``step`` ready (sealed, unless ``sealed`` is False); returns
    when that happened."""
    deadline = time.perf_counter() + timeout_s
    while not (engine.is_staged(step) if sealed else _prepared(engine, step)):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"step {step} was not staged within {timeout_s} s")
        time.sleep(0.002)
    return time.perf_counter()


def _prepared(engine: Any, step: int) -> bool:
    """Fetched, verified, decoded and staged, not sealed (--unsealed)."""
    prefetcher = engine._prefetcher
    return prefetcher is not None and prefetcher.peek(step) is not None


def _update(llm: Any, step: int) -> dict[str, float]:
    """One weight update as an RL loop drives it; the wall time of each vLLM call."""
    t0 = time.perf_counter()
    llm.start_weight_update()
    t1 = time.perf_counter()
    llm.update_weights({"update_info": {"step": step}})
    t2 = time.perf_counter()
    llm.finish_weight_update(weight_version=str(step))
    t3 = time.perf_counter()
    llm.reset_prefix_cache()
    t4 = time.perf_counter()
    return {"start_s": t1 - t0, "update_s": t2 - t1, "finish_s": t3 - t2, "reset_s": t4 - t3, "paused_s": t4 - t0}


def _scatter_floor_s(engine: Any) -> float:
    """The pause's floor on this machine: the bare XOR scatter of the step just written (numba's plain kernel on
    the same positions of the same live weights, nothing checked or hashed), timed once, then undone by the same
    scatter again. Runs between updates (the offline engine generates nothing meanwhile)."""
    from deltasync.format import _kernels

    state = engine._state  # the benchmark's own view of the engine
    args = []
    for bits, s in state.undo:  # what the last write XORed in, and where
        width = f"u{bits.element_size()}"
        args.append((bits.numpy().view(width), s.idx.numpy(), s.x.numpy().view(width)))
    t0 = time.perf_counter()
    for u, idx, x in args:
        _kernels.xor_plain_at(u, idx, x)
    floor = time.perf_counter() - t0
    for u, idx, x in args:  # XOR undoes itself: the engine holds the step's bits again
        _kernels.xor_plain_at(u, idx, x)
    return floor


def _plain_copy_s(llm: Any) -> float:
    """One plain copy of the engine's weights (copy_ into preallocated tensors), as bench_codec measures it."""

    def copy(worker: Any) -> float:
        params = [p.data for p in worker.model_runner.get_model().parameters()]
        dst = [torch.empty_like(p) for p in params]
        t0 = time.perf_counter()
        for d, p in zip(dst, params, strict=True):
            d.copy_(p)
        return time.perf_counter() - t0

    return llm.collective_rpc(copy)[0]


def _full_reload(llm: Any, folder: Path) -> float:
    """vLLM's own reload of a checkpoint folder's safetensors into the live model, then the prefix-cache reset."""
    from vllm.model_executor.model_loader.weight_utils import (
        safetensors_weights_iterator,
    )

    files = [str(f) for f in sorted(folder.glob("*.safetensors"))]
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": safetensors_weights_iterator(files, True),
                                                 "is_checkpoint_format": True})
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def _generate(llm: Any) -> None:
    from vllm import SamplingParams

    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)


def main() -> None:
    ap = parser(__doc__, steps=10)
    ap.add_argument("--poll", action="store_true",
                    help="the engine finds each step by polling the store (default: the publisher's event feed, "
                         "events=HOST:PORT, pushes each commit to it)")
    ap.add_argument("--unsealed", action="store_true",
                    help="the engine does not seal staged steps: the write hashes inside the pause (the path before "
                         "sealing, for the before/after table; results named vllm-unsealed)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-vllm-"))
    atexit.register(shutil.rmtree, work, True)  # removed at exit, on success, error or Ctrl-C
    train = Training(args)
    model = train.model
    numel = sum(p.numel() for p in model.parameters())
    print(f"model: {numel / 1e6:.1f}M parameters; machine: {machine()}; contended: {args.contend}")
    model_dir = save_model_dir(model, work / "step0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    llm = start_engine(model_dir, in_process=True, dtype="bfloat16", enforce_eager=True,
                       max_model_len=256)
    url = str(work / "stream")
    rows = []
    with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=1000,
                        events=None if args.poll else "127.0.0.1:0") as pub:
        pub.publish(0)
        pub.flush()
        t_init = time.perf_counter()
        info = {"url": url, "step": 0, "verify": "incremental"}
        if pub.events_url is not None:  # the publisher's event feed: the engine hears each commit at once
            info["notify"] = pub.events_url
        llm.init_weight_transfer_engine({"init_info": info})
        # routes, kernels warmed, the checksums incremental verification starts from
        init_s = time.perf_counter() - t_init
        engine = _engine(llm)
        if args.unsealed:
            from rollout_loader.vllm.prefetch import Prefetcher

            Prefetcher._seal_next = lambda self, step, held: None  # type: ignore[method-assign]
        for step in range(1, args.steps + 1):
            train.step()
            pub.publish(step)
            t_pub = time.perf_counter()
            staged_after = _wait_staged(engine, step, sealed=not args.unsealed) - t_pub
            _generate(llm)  # a rollout before the update: the prefix cache holds something to drop
            times = _update(llm, step)
            if engine.held_step != step:
                raise RuntimeError(f"the engine holds step {engine.held_step} after an update to step {step}")
            parts = engine.pause_parts[-1]
            floor_s = _scatter_floor_s(engine)
            copy_s = _plain_copy_s(llm)
            m = pub.metrics[-1] if pub.metrics and pub.metrics[-1].step == step else None
            # baseline, same run, same step: the replayed checkpoint of this step, reloaded in full by vLLM
            folder = work / f"replayed-{step}"
            replay_to_folder(url, step, folder)
            full_s = _full_reload(llm, folder)
            shutil.rmtree(folder)
            inside = parts["total"]
            rows.append({
                "step": step,
                "density": m.density if m else None,
                "object_bytes": m.object_bytes if m else None,
                "staged_after_publish_s": staged_after,
                # the publisher's background parts of that interval (the rest: the engine hears, fetches,
                # verifies, decodes, routes and seals)
                "publish_encode_s": m.encode_s if m else None,
                "publish_commit_s": m.write_s + m.upload_s if m else None,
                **{f"prefetch_{k}_s": v for k, v in engine._prefetcher.timings.get(step, {}).items()},
                **times,
                **{f"engine_{k}_s": v for k, v in parts.items()},
                "vllm_overhead_s": times["paused_s"] - inside - times["reset_s"],
                "full_reload_s": full_s,
                "scatter_floor_s": floor_s,
                "plain_copy_s": copy_s,
            })
            r = rows[-1]
            print(f"step {step:3d}: density {r['density']:.2%}  paused {r['paused_s'] * 1e3:6.1f} ms "
                  f"(write {parts['write'] * 1e3:.1f}, compare {parts['compare'] * 1e3:.2f}, staging "
                  f"{parts['staging'] * 1e3:.2f}, resolve {parts['resolve'] * 1e3:.1f}, reset "
                  f"{r['reset_s'] * 1e3:.1f}, "
                  f"vLLM {r['vllm_overhead_s'] * 1e3:.1f})  staged +{staged_after * 1e3:.0f} ms  "
                  f"full reload {full_s * 1e3:.0f} ms ({r['paused_s'] / full_s:.1%})  scatter floor "
                  f"{floor_s * 1e3:.1f} ms  "
                  f"plain copy {copy_s * 1e3:.0f} ms", flush=True)
        last = step
    # the engine's weights, every tensor checksummed again from the bits it holds, against the trainer's
    # checksums of the last step: neither the updates nor the reloads left a stale or wrong bit
    with StreamReader(url) as reader, reader.open(last) as obj:
        want = {n: int(t.checksum, 16) for n, t in obj.header.tensors.items()}
    got = transfer_status(llm)["checksums"]
    if got != want:
        bad = sorted(n for n in want if got.get(n) != want[n])
        raise RuntimeError(f"the engine's weights differ from the trainer's step {last}: {bad[:5]}")
    print(f"engine weights at step {last}: every checksum matches the trainer's")
    _report(args, numel, init_s, rows)


def _report(args: Any, numel: int, init_s: float, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    def med(k: str) -> float:
        return float(np.median([r[k] for r in rows]))

    paused, full = med("paused_s"), med("full_reload_s")
    first = rows[0]["paused_s"]
    t = Table(title=f"vLLM CPU engine, weight-transfer path: {numel / 1e6:.0f}M params, {len(rows)} steps, median "
              f"density {med('density'):.2%}{', one CPU-bound competitor' if args.contend else ''} (medians over "
              "steps)")
    for col in ("measure", "ms", "target"):
        t.add_column(col, justify="right")
    t.add_row("generation paused per step", f"{paused * 1e3:.1f}", "<= 10% of full reload")
    for label, key in (("  engine: find the step (manifest)", "engine_resolve_s"),
                       ("  engine: take the staged step", "engine_staging_s"),
                       ("  engine: in-place write", "engine_write_s"),
                       ("  engine: all-gather (ranks agree)", "engine_all_gather_s"),
                       ("  engine: checksum comparison", "engine_compare_s"),
                       ("  prefix-cache reset", "reset_s"),
                       ("  vLLM's own (RPCs, start/finish)", "vllm_overhead_s")):
        t.add_row(label, f"{med(key) * 1e3:.2f}", "")
    t.add_row("  floor: bare XOR scatter of the same step", f"{med('scatter_floor_s') * 1e3:.2f}", "")
    t.add_row("full reload through vLLM (same step)", f"{full * 1e3:.0f}", "")
    t.add_row("one plain copy of the weights", f"{med('plain_copy_s') * 1e3:.0f}", "")
    t.add_row("paused / full reload", f"{paused / full:.1%}", "<= 10%")
    t.add_row("floor / full reload", f"{med('scatter_floor_s') / full:.1%}", "")
    t.add_row("first pause / median pause", f"{first / paused:.2f}x", "<= 1.5x")
    t.add_row("publish() returned -> step staged", f"{med('staged_after_publish_s') * 1e3:.0f}", "<= 100 (local)")
    if all(r["publish_encode_s"] is not None for r in rows):
        engine_side = float(np.median([r["staged_after_publish_s"] - r["publish_encode_s"] - r["publish_commit_s"]
                                       for r in rows]))
        t.add_row("  publisher: encode", f"{med('publish_encode_s') * 1e3:.0f}", "")
        t.add_row("  publisher: write + commit", f"{med('publish_commit_s') * 1e3:.0f}", "")
        t.add_row(f"  engine: {'poll' if args.poll else 'hear'}, fetch, verify, decode, seal",
                  f"{engine_side * 1e3:.0f}", "")
    for part, label in (("find", "poll or pushed step, chain"),
                        ("prepare", "fetch, verify, decode, route (+ seal, one pass)"),
                        ("seal", "seal after the engine moved")):
        if all(f"prefetch_{part}_s" in r for r in rows):
            t.add_row(f"    engine: {label}", f"{med(f'prefetch_{part}_s') * 1e3:.0f}", "")
    t.add_row("engine init (routes, kernels, base checksums)", f"{init_s * 1e3:.0f}", "")
    Console(width=130).print(t)
    write_results(args, "vllm-unsealed" if args.unsealed else "vllm", {"numel": numel, "init_s": init_s, "rows": rows})


if __name__ == "__main__":
    main()
