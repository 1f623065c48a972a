"""A vLLM engine as a follower target: deltas written in place, checksums proven after every step.

    llm = LLM(model_dir, worker_extension_cls=WORKER_EXTENSION, ...)
    loader = Follower(url, VllmTarget(llm))
    loader.sync()                      # between generate() calls: a safe point

Each step: the follower has already fetched and verified the object; the target asks every rank to apply
it (all ranks or none), drops the prefix cache, then compares the engine's checksums with the trainer's.
On a mismatch it rolls back to the exact previous weights and raises; the engine never serves under a
step number that is not true.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from deltasync.checksum import format_checksum, parse_checksum
from deltasync.errors import BaseStepMismatchError, ChecksumMismatchError
from deltasync.format import StepObject

from .worker import apply_patch, engine_checksums, rpc

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_loader.worker.DeltaWorkerExtension"
Verify = Literal["changed", "all"]


class VllmTarget:
    """An offline ``vllm.LLM`` (started with ``worker_extension_cls=WORKER_EXTENSION``) kept at a step.

    ``step``: the step the engine already holds, if known (e.g. it was started from that step's replayed
    checkpoint); otherwise the first step applied is an anchor. ``mode`` is the worker's ("auto", "live",
    "reload"). ``verify="changed"`` checksums the tensors a delta changed; ``"all"`` every tensor.
    ``pauses_s`` records how long each update held the engine (no generation runs meanwhile).
    """

    def __init__(self, llm: Any, *, step: int | None = None, mode: str = "auto", verify: Verify = "changed") -> None:
        self.llm = llm
        self.mode = mode
        self.verify = verify
        self._step = step
        self.pauses_s: list[float] = []
        self._ready = False
        if step is not None:
            self._init()

    @property
    def step(self) -> int | None:
        return self._step

    def _init(self) -> None:
        rpc(self.llm, "deltasync_init", None, self.mode)  # routes from the engine's own checkpoint
        self._ready = True

    def apply(self, obj: StepObject) -> None:
        h = obj.header
        t0 = time.perf_counter()
        if h.kind == "anchor":
            self._step = None  # until verified, the engine holds no step we can name
            rpc(self.llm, "deltasync_load", obj.path, self.mode)
            self.llm.reset_prefix_cache()
            self._ready = True
            names = list(h.tensors)
        else:
            if h.base_step != self._step:
                raise BaseStepMismatchError(
                    f"{obj.where}: delta to step {h.step} is based on step {h.base_step}, the engine holds step {self._step}"
                )
            if not self._ready:
                self._init()
            apply_patch(self.llm, obj.path)  # all ranks or none; resets the prefix cache
            names = list(h.tensors) if self.verify == "all" else [n for n, t in h.tensors.items() if t.changed]
        sums = engine_checksums(self.llm, names) if names else {}
        bad = [n for n in names if sums[n] != parse_checksum(h.tensors[n].checksum)]
        if bad:
            if h.kind == "delta":
                rpc(self.llm, "deltasync_rollback")
                self.llm.reset_prefix_cache()
            n = bad[0]
            raise ChecksumMismatchError(
                f"{obj.where}: the engine's weights do not match the trainer's after step {h.step} "
                f"({len(bad)} tensor(s), first {n!r}: expected {h.tensors[n].checksum}, engine has "
                f"{format_checksum(sums[n])}); "
                + ("rolled back to step {}".format(self._step) if h.kind == "delta" else "the engine holds no verified step")
            )
        self._step = h.step
        self.pauses_s.append(time.perf_counter() - t0)
        log.info("engine at step %d (%.1f ms)", h.step, self.pauses_s[-1] * 1e3)


def start_engine(model_dir: str, *, live_cpu_weights: bool = True, in_process: bool = False, **llm_kwargs: Any) -> Any:
    """A ``vllm.LLM`` ready to follow a stream: the worker extension installed, and on CPU (with
    ``live_cpu_weights``) linear weights kept live so that updates are in-place writes, as on GPU.

    ``in_process`` runs the engine in this process (starts in seconds; one engine per process at a time).
    """
    import os

    from .worker import enable_live_cpu_weights

    if live_cpu_weights:
        enable_live_cpu_weights()
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    from vllm import LLM

    return LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
