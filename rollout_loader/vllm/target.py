"""A vLLM engine as a ``Follower`` target: the follower says which step, the engine's deltasync
weight-transfer engine reads, verifies and applies it.

    llm = start_engine(model_dir)                  # or LLM(..., weight_transfer_config={"backend": "deltasync"})
    follower = Follower(url, VllmTarget(llm))      # or VllmTarget("http://host:8000") for a running server
    follower.sync()                                # between generate() calls: a safe point

The follower reads only manifests, to learn which steps exist and the chain to the newest; each step number
goes to the engine through vLLM's own weight-transfer API (:mod:`rollout_loader.vllm.client`), one step at a
time, so the engine's weight version always names a verified step. The engine fetches the step's objects
itself (no shared filesystem), checks them, writes the changed elements in place and compares checksums on
every rank, rolling back and raising on any mismatch (:mod:`rollout_loader.vllm.engine`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal, get_args

from deltasync import DeltaSyncError
from deltasync.engine import pem_texts
from deltasync.errors import ConfigError

from .client import WORKER_EXTENSION, WeightTransfer, weight_transfer, worker_module

log = logging.getLogger(__name__)

EngineVerify = Literal["incremental", "changed", "all"]
Mode = Literal["auto", "live", "reload"]


def _choice(name: str, value: Any, allowed: Any) -> None:
    options = get_args(allowed)
    if value not in options:
        raise ConfigError(f"VllmTarget: {name} must be one of {', '.join(map(repr, options))}, not {value!r}")


def _absolute(url: str) -> str:
    """A local stream path made absolute: the engine may run in another working directory (a server)."""
    return url if "://" in url else os.path.abspath(url)


class VllmTarget:
    """A vLLM engine (an ``LLM``, a server URL, or a weight-transfer client) kept at a step of a stream.

    Args:
        engine: a ``vllm.LLM`` made by :func:`start_engine` (or with ``weight_transfer_config={"backend":
            "deltasync"}``), the base URL of a server started with ``--weight-transfer-config '{"backend":
            "deltasync"}'`` and ``VLLM_SERVER_DEV_MODE=1``, or an :class:`HttpWeightTransfer`/
            :class:`LocalWeightTransfer`.
        step: the step the engine's weights are at if it was never updated (started from that step's
            replayed checkpoint); ignored when the engine's weight version names a step. Otherwise the
            first step applied is an anchor.
        verify: checksums after each delta: ``"incremental"`` (each changed tensor's from the patched
            elements, O(changed)), ``"changed"`` (recomputed for the changed tensors) or ``"all"``.
        mode: the engine's ("auto", "live", "reload"; see :func:`rollout_loader.vllm.plan.build_state`).
        notify: a mirror's event feed (``http://HOST:PORT/events``, ``deltasync mirror --events``) the
            engine's prefetchers listen to, so that every rank stages a step as soon as it is committed and
            polls the store only as a safety net (deltasync/notify.py).
        trusted_keys: public key files (``deltasync keygen``): the engine applies only steps one of them
            signed (sent to it as PEM text: a server elsewhere needs no file).

    Raises ``ConfigError`` for a bad argument; the follower's first contact raises ``EngineConfigError``
    (a flag missing), ``EngineUnreachableError``. ``pauses_s`` records how long each update held generation.

    Example::

        with Follower(url, VllmTarget(start_engine(model_dir, in_process=True))) as follower:
            follower.wait_for(step=10)
    """

    reads_store = True  # the Follower sends step numbers, not objects

    def __init__(self, engine: Any, *, step: int | None = None, verify: EngineVerify = "incremental",
                 mode: Mode = "auto",
                 notify: str | None = None, trusted_keys: Any = None) -> None:
        _choice("mode", mode, Mode)
        _choice("verify", verify, EngineVerify)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"VllmTarget: step must be a step number or None, not {step!r}")
        self.client: WeightTransfer = weight_transfer(engine)
        self.verify = verify
        self.mode = mode
        self.notify = notify
        self._declared = step
        self._step: int | None = None
        # sent as PEM text: the engine (maybe a server elsewhere) checks every step's signature itself
        self.trusted_keys = None if trusted_keys is None else pem_texts(trusted_keys)

    @property
    def step(self) -> int | None:
        """The verified step the engine holds, as far as this target knows (after :meth:`connect`)."""
        return self._step

    @property
    def weight_version(self) -> str | None:
        """The engine's weight version as this target set it (each update finishes with ``str(step)``)."""
        return None if self._step is None else str(self._step)

    @property
    def pauses_s(self) -> list[float]:
        return self.client.pauses_s

    def connect(self, url: str, storage_options: dict[str, Any] | None = None) -> int | None:
        """Ask the engine which step it holds and point its deltasync engine at the stream (again: a no-op
        that keeps its step); returns that step. Changes no weights."""
        held = self.client.held_step()
        step = held if held is not None else self._declared
        url = _absolute(url)
        try:
            self.client.init(url, storage_options=storage_options, verify=self.verify, mode=self.mode, step=step,
                             notify=self.notify, trusted_keys=self.trusted_keys)
        except DeltaSyncError as e:
            # the engine proves a step before it holds it. The step its weight version names may be another
            # stream's (the server followed one before): then its weights are unknown here, and the first
            # update writes an anchor. A step the user declared that does not prove is their mistake: raised.
            if held is None or "HeldStepError" not in f"{type(e).__name__}: {e}":
                raise
            log.warning("the engine's weight version names step %d, which is not this stream's: starting from an "
                        "anchor (%s)", held, e)
            step = None
            self.client.init(url, storage_options=storage_options, verify=self.verify, mode=self.mode, step=None,
                             notify=self.notify, trusted_keys=self.trusted_keys)
        self._step = step
        log.info("vLLM engine holds step %s", self._step)
        return self._step

    def advance(self, step: int) -> None:
        """Bring the engine to ``step`` (a delta based on the step held, or an anchor), verified on every rank;
        on a failure the engine keeps its step and the error is raised."""
        self.client.update(step)
        self._step = step

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        """The engine's own account (held step, how steps arrived, pauses, every tensor's checksum); needs the
        status extension (:func:`start_engine` installs it; a server: ``--worker-extension-cls``)."""
        return self.client.status(checksums=checksums)


def start_engine(model_dir: str, *, live_cpu_weights: bool = True, in_process: bool = False, **llm_kwargs: Any) -> Any:
    """A ``vllm.LLM`` ready to follow a stream: the deltasync weight-transfer engine configured
    (``llm.init_weight_transfer_engine`` etc., or a :class:`VllmTarget`), the read-only status extension
    installed (:func:`~rollout_loader.vllm.worker.transfer_status`), and on CPU (with ``live_cpu_weights``)
    linear weights kept live so that updates are in-place writes, as on GPU.

    ``in_process`` runs the engine in this process (starts in seconds; one engine per process at a time).
    Other keyword arguments go to ``vllm.LLM``. Raises ``MissingDependencyError`` (naming the extra) where
    vLLM is not installed.

    Example: ``llm = start_engine("path/to/checkpoint", in_process=True, dtype="bfloat16")``
    """
    worker_module()  # vLLM is installed, or MissingDependencyError names the extra
    if live_cpu_weights:
        from .live_cpu import enable_live_cpu_weights

        enable_live_cpu_weights()
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    from .plugin import register

    register()  # this process too: an in-process engine creates it here
    llm_kwargs.setdefault("weight_transfer_config", {"backend": "deltasync"})
    from vllm import LLM

    return LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
