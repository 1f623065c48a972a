"""What every benchmark shares: the machine's name, the model arguments, and where results go."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def parser(doc: str, *, steps: int) -> argparse.ArgumentParser:
    """The model and stream arguments every benchmark takes (a >= 100M-parameter model by default)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return ap


def write_results(args: argparse.Namespace, name: str, payload: dict[str, Any]) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"machine": machine(), "args": vars(args), **payload}, indent=1))
    print(f"wrote {path}")
    return path
