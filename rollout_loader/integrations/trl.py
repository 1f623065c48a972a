"""TRL's ``AsyncGRPOTrainer`` keeping its vLLM server in sync through deltasync: ``DeltasyncWeightTransfer``.

TRL 1.16's experimental ``AsyncGRPOTrainer`` takes ``weight_transfer=``: any object with the five methods of
its ``WeightTransferProtocol``. This one publishes every weight sync as a step of a deltasync stream (the
run's history, and a store other inference fleets can follow) and makes the trainer's vLLM server apply that
step in place through deltasync's weight-transfer engine: the server reads the step from the store, checks
every changed tensor against the trainer's checksums, and rolls back on a mismatch. Two lines in the script::

    from rollout_loader.integrations.trl import DeltasyncWeightTransfer

    transfer = DeltasyncWeightTransfer("s3://bucket/run-7", server="http://vllm-host:8000", files=model_dir)
    trainer = AsyncGRPOTrainer(model=model_dir, args=AsyncGRPOConfig(vllm_server_base_url="http://vllm-host:8000"),
                               reward_funcs=..., train_dataset=..., weight_transfer=transfer)

and the server is started with deltasync's engine (on CPU also ``DELTASYNC_CPU_LIVE_WEIGHTS=1``)::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --weight-transfer-config '{"backend": "deltasync"}'

How TRL 1.16.0 calls it (``trl/experimental/async_grpo/async_grpo_trainer.py``), and what each call does here:

- On the main process only. The other ranks' trainers hold no weight transfer: they drain the same parameter
  iterator, because FSDP2's ``full_tensor()`` is a collective. So construction only checks arguments (the
  object is made on every rank and used on rank 0), and rank 0 publishes the full tensors it is handed.
- ``init_weight_transfer()``, once at train begin (``_TrainBeginCallback``): takes the stream's writer lease
  (a ``DeltaPublisher``) and points the server's deltasync engine at the stream.
- ``pause()``, a barrier, ``send_weights(iterator)``, a barrier, ``resume()``: the cold sync at train begin,
  then every ``weight_sync_steps`` optimizer steps (``_sync_weight_merged``). ``pause`` and ``resume`` do
  nothing: generation goes on while the step is diffed and uploaded, and the server is paused (``mode=keep``,
  as TRL's own client pauses) only around the in-place apply inside ``send_weights``, which also drops the
  prefix cache and resumes the server even when the apply fails (TRL calls ``resume`` only on success).
- ``send_weights`` publishes the iterator's tensors as one step, each diffed as it arrives and released before
  the next (no second copy of the model on rank 0), and always reads the iterator to its end (on FSDP2 every
  item is a collective the other ranks wait in); it waits until the step is committed, then brings the server
  to it (start, update, finish with weight version ``str(step)``, the version read back) through
  :class:`~rollout_loader.vllm.VllmTarget`.
- ``destroy()``, at train end: flushes and closes the publisher (the lease is released). A later ``train()``
  call reopens it at its first sync.

Step numbers: TRL passes none. By default the first sync of a new stream is step 0 (the cold sync: the
weights training starts from) and each sync after it the next step; a stream that already holds steps (a
resumed run) goes on after its newest. ``step_fn`` numbers them instead, e.g. by the trainer's optimizer step:
``step_fn=lambda: trainer.state.global_step`` (``trainer`` is looked up when the lambda is called, so it can be
written before the trainer exists). A resumed run whose checkpoint step the stream already holds then
publishes nothing at its cold sync: it proves that the trainer's weights are that step's, bit for bit (every
tensor's checksum against the step's header), and brings the server there.

Tested with trl==1.16.0 (the ``trl`` extra pins it); the API is experimental. Another TRL version is used only
if its ``WeightTransferProtocol`` has the same five methods (with a warning); otherwise construction raises
``MissingDependencyError``. Importing this module imports TRL; ``import rollout_loader`` does not.
"""

from __future__ import annotations

import inspect
import logging
import math
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from deltasync import DeltaPublisher, PublishOptions
from deltasync.engine import MAX_STEP, StoreLocation
from deltasync.errors import ConfigError, MissingDependencyError
from rollout_loader.vllm import VllmTarget
from rollout_loader.vllm.trainer_sync import TrainerSync, drain

log = logging.getLogger(__name__)

__all__ = ["TESTED_TRL", "DeltasyncWeightTransfer", "check_trl"]

TESTED_TRL = "1.16.0"
# TRL 1.16.0's WeightTransferProtocol: method -> its parameters after self
_PROTOCOL = {"init_weight_transfer": [], "pause": [], "send_weights": ["iterator"], "resume": [], "destroy": []}
_INSTALL = f"pip install 'deltasync[trl]' (trl=={TESTED_TRL})"
_WHO = "DeltasyncWeightTransfer"


def check_trl() -> str:
    """The installed TRL's version, if its ``AsyncGRPOTrainer`` calls a weight transfer as TRL 1.16.0 does.

    A version other than :data:`TESTED_TRL` whose ``WeightTransferProtocol`` has the same methods with the same
    parameters is used with a warning (the protocol is experimental and may change its meaning unseen).

    Raises:
        MissingDependencyError: TRL is not installed, has no ``AsyncGRPOTrainer`` weight-transfer protocol, or
            its protocol differs from 1.16.0's (names what differs and the pinned install).
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("trl")
    except PackageNotFoundError:
        raise MissingDependencyError(f"{_WHO} needs TRL, which is not installed: {_INSTALL}", name="trl") from None
    try:
        from trl.experimental.async_grpo.async_grpo_trainer import WeightTransferProtocol
    except ImportError as e:
        raise MissingDependencyError(
            f"{_WHO}: trl {installed} has no trl.experimental.async_grpo.async_grpo_trainer.WeightTransferProtocol "
            f"({e}); it is tested with trl=={TESTED_TRL}: {_INSTALL}", name="trl") from e
    found = _methods(WeightTransferProtocol)
    if found != _PROTOCOL:
        raise MissingDependencyError(
            f"{_WHO}: trl {installed}'s WeightTransferProtocol has methods {found}, not trl {TESTED_TRL}'s "
            f"{_PROTOCOL}: the trainer would call this backend in ways it was not written for; {_INSTALL}",
            name="trl")
    if installed != TESTED_TRL:
        log.warning("%s is tested with trl==%s; trl %s has the same WeightTransferProtocol methods, so it is used, "
                    "but the experimental API may call them differently", _WHO, TESTED_TRL, installed)
    return installed


def _methods(protocol: type) -> dict[str, list[str]]:
    """A protocol class's public methods and their parameter names after ``self``."""
    return {name: list(inspect.signature(fn).parameters)[1:] for name, fn in vars(protocol).items()
            if not name.startswith("_") and callable(fn)}


class DeltasyncWeightTransfer:
    """TRL ``AsyncGRPOTrainer``'s weight sync through a deltasync stream and the server's deltasync engine.

    Pass it as ``AsyncGRPOTrainer(..., weight_transfer=DeltasyncWeightTransfer(...))`` on every rank (TRL uses
    it on rank 0 only). The module docstring says how TRL calls each method.

    Args:
        url: the stream (a folder, ``s3://bucket/prefix``, ``hf://buckets/...``): the trainer writes it and the
            server reads it, so it must name the same store from both (a local path only where both share a
            filesystem).
        server: the vLLM server TRL generates with (``AsyncGRPOConfig.vllm_server_base_url``), started with
            ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "deltasync"}'``; or a
            :class:`~rollout_loader.vllm.VllmTarget` for other engine settings (``EngineSettings``: verify, mode,
            notify, rdma, or another URL the engine reads the same stream by, e.g. a mirror).
        storage_options: the store's options (credentials, endpoint), for the trainer and sent to the server.
        step_fn: returns the step number of each sync (default: counts syncs; see the module docstring).
        trusted_keys: public key files, one of them the public half of ``signing_key=`` (required with it): the
            server applies only steps this trainer's key signed for this trainer's stream (the publisher's
            ``trust``, pinned to its stream id). A signing trainer's server checks that with or without this
            argument; with a ``VllmTarget``, its own ``trusted_keys`` (a ``TrustedKeys``) decide.
        timeout_s: how long a sync waits for its step to be committed (seconds).
        options: the publisher's settings (:class:`deltasync.PublishOptions`); ``publisher_kwargs`` set the
            same ones by name (``files=`` the model folder, so that ``deltasync replay`` writes loadable
            checkpoints; ``anchor_every=``, ``signing_key=``, ...). ``dtype`` defaults to the dtype the server
            serves (read from its ``/server_info``), so fp32 master weights publish as the server's bf16.

    Raises:
        ConfigError: an argument of the wrong type or value, naming it (``TypeError`` for an unknown
            publisher option).
        MissingDependencyError: TRL is missing or its protocol is not 1.16.0's (:func:`check_trl`).

    Example::

        transfer = DeltasyncWeightTransfer("/data/run-7", server="http://127.0.0.1:8000", files=model_dir,
                                           step_fn=lambda: trainer.state.global_step)
        trainer = AsyncGRPOTrainer(model=model_dir, args=config, reward_funcs=reward, train_dataset=prompts,
                                   weight_transfer=transfer)
        trainer.train()        # every sync: a committed step, applied and verified in the server
    """

    def __init__(self, url: str, server: str | VllmTarget, *, storage_options: dict[str, Any] | None = None,
                 step_fn: Callable[[], int] | None = None, trusted_keys: Any = None, timeout_s: float = 1800.0,
                 options: PublishOptions | None = None, **publisher_kwargs: Any) -> None:
        self.trl_version = check_trl()
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"{_WHO}: url must be the stream's URL (a folder, s3://bucket/prefix, ...), got {url!r}")
        try:  # the store as one value, made here (the options are a convenience beside the URL)
            location = StoreLocation.of(url, storage_options)
        except ConfigError as e:
            raise ConfigError(f"{_WHO}: storage_options must be a dict with string keys (the store's options): "
                              f"{e}") from None
        if step_fn is not None and not callable(step_fn):
            raise ConfigError(f"{_WHO}: step_fn must be a function returning each sync's step number, got "
                              f"{type(step_fn).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ConfigError(f"{_WHO}: timeout_s must be seconds > 0, got {timeout_s!r}")
        self.options = PublishOptions.build(options, publisher_kwargs)  # ConfigError naming the option
        if self.options.sharded:
            raise ConfigError(f"{_WHO}: sharded=True cannot apply: TRL hands the full tensors to rank 0 alone, "
                              "so rank 0 publishes them (leave sharded unset)")
        self.target = _target(server, trusted_keys)
        if trusted_keys is not None:
            _check_signing_pair(trusted_keys, self.options.signing_key)
        self.url = url
        self.location = location
        self.step_fn = step_fn
        self.timeout_s = float(timeout_s)
        # the publisher, the steps and what a committed step means: shared with every framework seam
        self.sync = TrainerSync(location, options=self.options, target=self.target,
                                who=_WHO, timeout_s=self.timeout_s)

    # --- TRL's WeightTransferProtocol (rank 0) ---

    def init_weight_transfer(self) -> None:
        """Take the stream's writer lease and point the server's deltasync engine at the stream (no weights
        change). Called by TRL once at train begin; again (after :meth:`destroy`) by the next sync."""
        self.sync.open()

    def pause(self) -> None:
        """Nothing: generation goes on while the step is published; ``send_weights`` pauses the server only
        around the in-place apply."""

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Publish ``iterator``'s tensors as the next step, wait for its commit, and bring the server to it.

        Each tensor is diffed as it arrives and released before the next is read (``DeltaPublisher.publish(step,
        weights=...)``), so rank 0 holds one tensor beyond the publisher's snapshot, never a second model. The
        iterator is read to its end even on an error: on FSDP2 each item is a collective the other ranks are
        in. On a failure the server keeps its previous verified step and the error is raised (``PublishError``,
        ``TensorMismatchError``, ``EngineError``, ``NonFiniteStepError`` for weights that turned NaN or ±Inf, ...);
        the step may already be committed in the stream (never a refused one).
        """
        items = iter(iterator)
        try:
            step = self._wanted_step()
        except BaseException:
            drain(items, _WHO)
            raise
        step = self.sync.send(items, step=step)
        log.info("%s: server at step %d", _WHO, step)

    def resume(self) -> None:
        """Nothing: ``send_weights`` resumed the server after the apply (see :meth:`pause`)."""

    def destroy(self) -> None:
        """Flush and close the publisher (releases the stream's lease). Called by TRL at train end."""
        self.sync.close()

    # --- helpers ---

    @property
    def publisher(self) -> DeltaPublisher | None:
        """The publisher while the stream's lease is held (between the first sync and :meth:`destroy`)."""
        return self.sync.publisher

    @property
    def steps(self) -> list[int]:
        """Every step this object brought the server to, in order."""
        return self.sync.steps

    @property
    def step(self) -> int | None:
        """The step the server was last brought to by this object (None before the first sync)."""
        return self.sync.step

    def _wanted_step(self) -> int | None:
        """``step_fn()``'s step, checked; None (the next one) without ``step_fn``."""
        if self.step_fn is None:
            return None
        step = self.step_fn()
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ConfigError(f"{_WHO}: step_fn must return a step number 0..{MAX_STEP}, returned {step!r}")
        return step


def _check_signing_pair(trusted_keys: Any, signing_key: Any) -> None:
    """``trusted_keys`` must hold the public half of ``signing_key`` (the server then applies what it signs)."""
    from deltasync.engine import SigningKey, read_public_key

    if signing_key is None:
        raise ConfigError(f"{_WHO}: trusted_keys makes the server apply signed steps only, and no signing_key= "
                          "signs them: give the private key the trusted keys belong to")
    files = [trusted_keys] if isinstance(trusted_keys, (str, Path)) else trusted_keys
    if not isinstance(files, (list, tuple)) or not files:
        raise ConfigError(f"{_WHO}: trusted_keys must be a list of public key files, got {type(trusted_keys).__name__}")
    key = signing_key if isinstance(signing_key, SigningKey) else SigningKey(signing_key)
    if key.public_key not in {read_public_key(k) for k in files}:
        raise ConfigError(f"{_WHO}: none of trusted_keys is the public half of signing_key ({key.path}): the server "
                          "would refuse every step this trainer signs")


def _target(server: Any, trusted_keys: Any) -> VllmTarget:
    """The engine target for ``server`` (a URL or a ``VllmTarget``); ``ConfigError`` naming ``server``."""
    if isinstance(server, VllmTarget):
        if trusted_keys is not None:
            raise ConfigError(f"{_WHO}: trusted_keys goes to the VllmTarget given as server "
                              "(VllmTarget(url, trusted_keys=...)), not here")
        return server
    if isinstance(server, str):
        parts = urllib.parse.urlsplit(server)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{_WHO}: server must be the vLLM server's URL (http://host:port, what "
                              f"AsyncGRPOConfig.vllm_server_base_url names), got {server!r}")
        return VllmTarget(server)  # a signing trainer's server checks its signatures (TrainerSync gives the trust)
    raise ConfigError(f"{_WHO}: server must be the vLLM server's URL (http://host:port) or a VllmTarget, got "
                      f"{type(server).__name__}")
