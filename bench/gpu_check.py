"""Correctness of the CUDA paths, on a GPU machine (CI has none): run it wherever a GPU is lent.

A trainer whose fp32 weights live on the GPU publishes bf16 steps, its last-published copy on the device
(``snapshot_device="same"``) and in host memory (``"cpu"``); followers apply every step on the GPU and on
the host; each step's weights must be bit-equal to the trainer's own bf16 cast, and the replayed history
too. Prints one line per check and writes JSON; exits 1 on any mismatch. Timings are printed for
information only (speed is bench/gpu.sh's business).

    python bench/gpu_check.py --steps 6 --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltasync import DeltaPublisher, StreamReader
from deltasync.testing import tiny_qwen3  # noqa: E402
from rollout_loader import Follower, StateDictTarget  # noqa: E402


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bits differ (compared on the host)."""
    bad = [n for n in a if n not in b]
    for n, t in a.items():
        if n in b and not torch.equal(t.detach().cpu().view(torch.int16), b[n].detach().cpu().view(torch.int16)):
            bad.append(n)
    return bad


def run(snapshot_device: str, steps: int, root: Path, hidden: int, layers: int, device: str) -> dict:
    torch.manual_seed(0)
    model = tiny_qwen3(hidden_size=hidden, layers=layers).float().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    url = str(root / f"stream-{snapshot_device}")
    followers = {dev: Follower(url, StateDictTarget(device=dev, verify="full")) for dev in (device, "cpu")}
    result: dict = {"snapshot_device": snapshot_device, "steps": [], "ok": True}
    with DeltaPublisher(url, model, dtype=torch.bfloat16, snapshot_device=snapshot_device, anchor_every=4,
                        on_backlog="block") as pub:
        for step in range(steps):
            if step:
                tokens = torch.randint(0, model.config.vocab_size, (4, 65), device=device)
                model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            pub.publish(step)
            captured_s = time.perf_counter() - t0
            pub.flush()
            want = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
            row = {"step": step, "publish_returned_s": round(captured_s, 4)}
            for dev, f in followers.items():
                t1 = time.perf_counter()
                f.sync()
                row[f"apply_{dev}_s"] = round(time.perf_counter() - t1, 4)
                held = f.target.state_dict()
                assert all(t.device.type == dev for t in held.values()), f"{dev} follower holds tensors elsewhere"
                bad = _bits_equal(want, held)
                row[f"exact_{dev}"] = not bad
                result["ok"] &= not bad
                if bad:
                    row[f"differ_{dev}"] = bad[:5]
            m = pub.metrics[-1]
            row.update(kind=m.kind, density=round(m.density, 5))
            result["steps"].append(row)
            print(f"snapshot={snapshot_device} step {step}: {row}", flush=True)
        last = steps - 1
    with StreamReader(url) as reader:
        bad = _bits_equal(want, reader.state_dict(last))
    result["replay_exact"] = not bad
    result["ok"] &= not bad
    for f in followers.values():
        f.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--device", default="cuda", help="'cpu' only to try the script where no GPU is")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory(prefix="deltasync-gpu-check-") as tmp:
        for snapshot_device in ("same", "cpu"):
            report["runs"].append(run(snapshot_device, args.steps, Path(tmp), args.hidden_size, args.layers,
                                      args.device))
    report["ok"] = all(r["ok"] for r in report["runs"])
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['device']}: {'every step bit-exact on GPU and host followers' if report['ok'] else 'MISMATCH'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
