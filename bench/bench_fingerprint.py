"""Runtime fingerprint benchmark: its cost as a share of the update pause, per model family (issue 33).

    .venv/bin/python bench/bench_fingerprint.py [--families llama,qwen3_moe] [--steps 4] [--stock]

For each family (tests/integration/families.py: a 2-layer checkpoint of the family's real structure) plus, with
``--hidden``/``--layers``, a dense Qwen3 of that size, a stream is published (steps changing ~2% of every tensor,
an anchor every 3) and a real vLLM CPU engine (in-process, live CPU linear weights unless ``--stock``) follows it
with ``fingerprint="pause"``: every update ends with the runtime fingerprint computed inside the pause, timed on
its own (``pause_parts["fingerprint"]``). Reported per family, medians over steps: the pause without the
fingerprint (the baseline, same run, same steps), the fingerprint's seconds, and their ratio; the engine's
default (``fingerprint="after"``) computes the same pass on a thread after the pause, so the pause itself carries
none of it. Prints a table, writes JSON.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, parser, write_results


def _family(name: str, root: Path, args: Any) -> Path:
    if name == "qwen3_dense":
        from deltasync.testing import save_model_dir, tiny_qwen3
        from tests.integration.conftest import save_tokenizer

        out = save_model_dir(tiny_qwen3(hidden_size=args.hidden, layers=args.layers, vocab_size=args.vocab,
                                        tie=False).bfloat16(), root / name)
        save_tokenizer(out)
        return out
    from tests.integration.families import build_family

    return build_family(name, root / name)


def _run(name: str, root: Path, args: Any) -> dict[str, Any]:
    from rollout_loader.vllm import LocalWeightTransfer, start_engine
    from tests.integration.test_vllm_models import _close, _publish

    model_dir = _family(name, root, args)
    url = str(root / f"{name}-stream")
    steps = tuple(range(1, args.steps + 1))
    _publish(model_dir, url, steps=steps)
    llm = start_engine(str(model_dir), in_process=True, live_cpu_weights=not args.stock, dtype="bfloat16",
                       enforce_eager=True, max_model_len=512, seed=0)
    try:
        llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 0, "fingerprint": "pause"}})
        client = LocalWeightTransfer(llm)
        engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
        numel = sum(p.numel() for p in engine.model.parameters())
        for step in steps:
            client.update(step)
        parts = engine.pause_parts[-len(steps):]
        status = client.status(checksums=False)["fingerprint"]
    finally:
        _close(llm)
        del llm
        gc.collect()
    prints = [p["fingerprint"] for p in parts]
    without = [p["total"] - p["fingerprint"] for p in parts]
    return {"family": name, "params": numel, "steps": len(parts), "pause_without_s": float(np.median(without)),
            "fingerprint_s": float(np.median(prints)), "ratio": float(np.median([a / b for a, b in
                                                                                   zip(prints, without, strict=True)])),
            "opaque_modules": status["opaque"], "rows": parts}


def main() -> None:
    ap = parser(__doc__ or "", steps=4)
    ap.add_argument("--families", default="llama,qwen3_moe,qwen3_dense")
    ap.add_argument("--stock", action="store_true", help="vLLM's stock CPU kernels (linears repacked: re-loaded)")
    ap.set_defaults(hidden=512, layers=8, vocab=32000)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    root = Path(tempfile.mkdtemp(prefix="bench-fingerprint-"))
    try:
        results = [_run(name, root, args) for name in args.families.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Runtime fingerprint inside the pause, vLLM CPU engine ({'stock' if args.stock else 'live'} "
              f"kernels), medians over {args.steps} steps; {machine()}")
    for col in ("family", "params", "pause without (ms)", "fingerprint (ms)", "fingerprint / pause", "opaque"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r["family"], f"{r['params'] / 1e6:.1f}M", f"{r['pause_without_s'] * 1e3:.1f}",
                  f"{r['fingerprint_s'] * 1e3:.1f}", f"{r['ratio']:.0%}", str(r["opaque_modules"]))
    Console(width=130).print(t)
    write_results(args, "fingerprint-stock" if args.stock else "fingerprint", {"results": results})


if __name__ == "__main__":
    main()
