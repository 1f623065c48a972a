"""What every benchmark shares: the machine's name, the model arguments, and where results go."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import platform
import signal
import threading
from pathlib import Path
from typing import Any

import torch


def sigterm_unwinds() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind the benchmark as Ctrl-C does. Its default ends the process at
    once, running no ``finally`` block and no ``atexit`` handler: a benchmark's work folder, its store server and
    its child processes stayed behind. Done once at import, in the main thread of the main process only (a child
    keeps its own handling), and only where nothing chose a handler already."""
    if (threading.current_thread() is threading.main_thread() and multiprocessing.parent_process() is None
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, signal.default_int_handler)


sigterm_unwinds()


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


class _Parser(argparse.ArgumentParser):
    """Starts the CPU-bound competitor right after parsing when ``--contend`` is given (stopped at exit)."""

    def parse_args(self, *a: Any, **kw: Any) -> argparse.Namespace:  # type: ignore[override]
        args = super().parse_args(*a, **kw)
        if getattr(args, "contend", False):
            start_competitor()
        return args


def start_competitor() -> None:
    """One other CPU-bound process, as a trainer's data loader would be: it spins until this process exits.

    The figures of a ``--contend`` run say how a stage copes when one core is busy (kernels that split one
    small tensor across every core stall then)."""
    import atexit
    import subprocess
    import sys

    code = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    sum(i * i for i in range(100000))"
    proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())])
    atexit.register(lambda: (proc.kill(), proc.wait()))


def parser(doc: str, *, steps: int) -> argparse.ArgumentParser:
    """The model and stream arguments every benchmark takes (a >= 100M-parameter model by default)."""
    ap = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contend", action="store_true",
                    help="run a CPU-bound competitor process for the whole run (results are named ...-contended)")
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
    if getattr(args, "contend", False):
        name += "-contended"
    path = out / f"{name}-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"machine": machine(), "args": vars(args), **payload}, indent=1))
    print(f"wrote {path}")
    return path


class Training:
    """The run every benchmark measures: a Qwen3-shaped model of the arguments' size (fp32 master weights),
    AdamW at ``args.lr``, the Python standard library's source as token ids, one seeded generator."""

    def __init__(self, args: argparse.Namespace) -> None:
        from deltasync.testing import stdlib_corpus, tiny_qwen3

        self.model = tiny_qwen3(hidden_size=args.hidden, layers=args.layers, vocab_size=args.vocab).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.0)
        self.data = stdlib_corpus()
        self.gen = torch.Generator().manual_seed(0)

    def step(self, *, seq: int = 64, batch: int = 2) -> None:
        """One optimizer step on ``batch`` random windows of ``seq`` + 1 tokens."""
        starts = torch.randint(0, self.data.numel() - seq - 1, (batch,), generator=self.gen)
        windows = torch.stack([self.data[s : s + seq + 1] for s in starts])
        self.model(input_ids=windows[:, :-1], labels=windows[:, 1:]).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
