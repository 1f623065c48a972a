"""``DeltaSyncCallback``: publish a transformers ``Trainer``'s weights (and so a TRL trainer's) every optimizer step.

Two lines in a training script::

    from deltasync.integrations.transformers import DeltaSyncCallback
    trainer = Trainer(..., callbacks=[DeltaSyncCallback("s3://bucket/run-7", dtype=torch.bfloat16)])

Who publishes depends on how the weights are held:

- one process, or DDP: every rank holds the same full weights, so rank 0 alone publishes;
- FSDP2 (``fully_shard``: accelerate's ``fsdp_version: 2``, or ``from_pretrained(distributed_config=
  DistributedConfig(fsdp_size=N))``): every parameter is a ``DTensor`` and no rank holds the full weights, so
  every rank makes a publisher and publishes its own shard (sharded publishing, deltasync/publish/sharded.py);
  rank 0 commits each step's manifest;
- FSDP1 (``FullyShardedDataParallel``) and DeepSpeed ZeRO-3 are refused at train begin: their parameters are
  flat, rank-local buffers with no ``DTensor`` state dict saying which elements of which tensor a rank holds,
  so a rank cannot publish its shard without gathering the model. Use FSDP2.

This module imports transformers; ``import deltasync`` does not import this module.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import torch

from deltasync.errors import ConfigError, MissingDependencyError
from deltasync.integrations.metrics import (
    PREFIX,
    metrics_for_logs,
    sharded_metrics_for_logs,
)
from deltasync.publish.names import NameMap
from deltasync.publish.publisher import DeltaPublisher
from deltasync.publish.sharded import is_sharded

try:
    from transformers import (
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
except ImportError as e:  # pragma: no cover - exercised only where transformers is missing
    raise MissingDependencyError(
        f"DeltaSyncCallback needs transformers and accelerate: pip install 'deltasync[trainer]' ({e})"
    ) from e

log = logging.getLogger(__name__)

__all__ = ["DeltaSyncCallback", "publishing_mode"]

Mode = Literal["single", "sharded"]


class DeltaSyncCallback(TrainerCallback):
    """Publish the model after every optimizer step as step ``state.global_step``; metrics go to the logs.

    ``publisher_kwargs`` go to ``DeltaPublisher`` (``dtype``, ``anchor_every``, ``storage_options``, ``files``,
    ...). ``names`` maps each canonical tensor name (wrapper prefixes such as DDP's ``module.`` removed) to
    the name the inference engine knows. ``publish_initial`` also publishes the weights at train begin, as
    step ``state.global_step`` (0 for a fresh run), so that a consumer can start from the stream alone; it
    is skipped when the stream already holds that step (a resumed run).

    Publishing errors are not swallowed: a step that failed in the background raises ``PublishError`` from the
    next ``on_step_end`` and stops training, as a failed checkpoint save would; so does a step whose weights
    turned NaN or ±Inf (``NonFiniteStepError`` naming the tensors, the ``refuse_nonfinite`` option): nothing of it
    is published, and the stream ends at the last good step.
    """

    def __init__(
        self,
        url: str,
        *,
        names: NameMap | None = None,
        publish_initial: bool = True,
        log_prefix: str = PREFIX,
        **publisher_kwargs: Any,
    ) -> None:
        if "source" in publisher_kwargs:
            raise ConfigError("DeltaSyncCallback publishes the Trainer's model: pass no source=")
        self.url = url
        self.names = names
        self.publish_initial = publish_initial
        self.log_prefix = log_prefix
        self.publisher_kwargs = publisher_kwargs
        self.publisher: DeltaPublisher | None = None
        self.mode: Mode | None = None  # decided at train begin

    # --- Trainer events ---

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        """Decide who publishes (on every rank, so that all fail alike), then start publishing there.

        Sharded (FSDP2): every rank makes its publisher (a collective: ranks agree on where the stream
        stands) and publishes. Otherwise rank 0 alone does.
        """
        if model is None:
            raise ConfigError("DeltaSyncCallback: the Trainer passed no model to on_train_begin")
        self.mode = publishing_mode(args, model)
        if self.mode == "single" and not state.is_world_process_zero:
            return
        self.close()  # a second train() call starts a new publisher on the same stream
        self.publisher = DeltaPublisher(self.url, model, names=self.names, sharded=self.mode == "sharded",
                                        **self.publisher_kwargs)
        committed = self.publisher.last_committed_step  # the same on every rank of a sharded publisher
        if committed is not None and committed > state.global_step:
            self.close()
            raise ConfigError(
                f"{self.url}: the stream already holds step {committed}, after the Trainer's step {state.global_step}: "
                "a committed step is never replaced; resume from a later checkpoint or publish to a new URL"
            )
        if self.publish_initial and committed != state.global_step:
            self._publish(state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Called after the optimizer step and ``global_step += 1``: the weights of step ``global_step``."""
        if self.publisher is not None:
            self._publish(state.global_step)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None,
        **kwargs: Any
    ) -> None:
        """Add the newest committed step's metrics, and how many steps uploads run behind, to ``logs`` and to the
        matching ``state.log_history`` entry (saved in the Trainer's checkpoints).

        Callbacks see ``logs`` in order, and the Trainer puts its reporting callbacks (W&B, TensorBoard) before
        the ones passed to it: use :meth:`attach` for those to receive the metrics.
        """
        if self.publisher is None or logs is None:
            return
        metrics = self.metrics(state.global_step)
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Flush every captured step to the store, then release the stream."""
        self.close()

    # --- plain API ---

    def attach(self, trainer: Any) -> Any:
        """Add this callback to ``trainer`` ahead of every other callback, so that the reporting callbacks (W&B,
        TensorBoard, ...) receive the metrics it adds to each log; returns ``trainer``."""
        trainer.callback_handler.callbacks.insert(0, self)
        return trainer

    def metrics(self, trainer_step: int | None = None) -> dict[str, float]:
        """The newest committed step's metrics as numbers; with ``trainer_step``, also ``lag_steps``: how far the
        newest committed step is behind it (before the first commit only that, counted from step -1: the
        initial weights' upload may still run when the first log comes).

        A sharded publisher reports fewer figures (``step``, ``anchor``, ``bytes`` of the whole step,
        ``part_bytes`` of this rank's part, ``capture_s``, ``encode_s``), the same on every rank but the
        part sizes and seconds, which are this rank's own.
        """
        pub = self.publisher
        if pub is None:
            return {}
        out: dict[str, float] = {}
        step = -1  # nothing committed yet
        if pub.metrics:
            newest = pub.metrics[-1]
            out, step = metrics_for_logs(newest, prefix=self.log_prefix), newest.step
        elif (sharded := _sharded_metrics(pub)) is not None:
            out, step = sharded_metrics_for_logs(sharded, prefix=self.log_prefix), int(sharded["step"])
        if trainer_step is not None:
            out[self.log_prefix + "lag_steps"] = trainer_step - step
        return out

    def _publish(self, step: int) -> None:
        """Publish, or on failure close the publisher (training stops: ``on_train_end`` will not come) and raise."""
        assert self.publisher is not None
        try:
            self.publisher.publish(step)
        except BaseException:
            pub, self.publisher = self.publisher, None
            try:
                pub.close()  # releases the stream and removes the spool folder
            except Exception as e:  # noqa: BLE001 - the first error is the one to report
                log.warning("closing the publisher after a failed step %d: %s", step, e)
            raise

    def close(self) -> None:
        """Flush and close the publisher, if any (also called by ``on_train_end``)."""
        pub, self.publisher = self.publisher, None
        if pub is not None:
            pub.close()


def publishing_mode(args: Any, model: Any) -> Mode:
    """``"sharded"`` for an FSDP2 / DTensor model (every rank publishes), ``"single"`` when each process holds the
    full weights (rank 0 publishes); ``ConfigError`` for the sharded trainers that cannot publish per rank.

    Decided from the model the Trainer trains (already wrapped by accelerate at train begin), not from the
    arguments alone: accelerate falls back to DDP where FSDP is not available (on CPU), and then every rank
    does hold the full weights.
    """
    refused = _unsupported_sharding(args, model)
    if refused is not None:
        raise ConfigError(
            f"DeltaSyncCallback: the model is sharded by {refused}: its parameters are flat rank-local buffers with "
            "no DTensor state dict, so no rank can publish its shard without gathering the whole model; expected "
            "single-process, DDP or FSDP2 training (accelerate fsdp_version 2, torch fully_shard, or from_pretrained("
            "distributed_config=DistributedConfig(fsdp_size=N)))"
        )
    if isinstance(model, torch.nn.Module) and is_sharded(model.state_dict()):
        return "sharded"
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        log.info("DeltaSyncCallback: FSDP was asked for but the model holds no DTensor (accelerate fell back to "
                 "DDP?): every rank holds the full weights, rank 0 publishes")
    return "single"


def _unsupported_sharding(args: Any, model: Any) -> str | None:
    """The sharding that leaves no per-rank ``DTensor`` state dict (FSDP1, DeepSpeed ZeRO-3), in words, or None."""
    if getattr(args, "deepspeed", None):
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            return "DeepSpeed ZeRO-3"
    if isinstance(model, torch.nn.Module) and torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        for module in model.modules():
            if isinstance(module, FullyShardedDataParallel):
                return "FSDP1 (a FullyShardedDataParallel module)"
        if any(hasattr(p, "ds_id") for p in model.parameters()):  # DeepSpeed ZeRO-3 partitioned parameters
            return "DeepSpeed ZeRO-3 (partitioned parameters)"
    return None


def _sharded_metrics(pub: DeltaPublisher) -> dict[str, Any] | None:
    """The newest step of a sharded publisher, from its writer's per-step record (None before the first)."""
    writer = getattr(pub, "_sharded", None)  # deltasync.publish.sharded.ShardedWriter: records dicts per step
    records = getattr(writer, "metrics", None)
    return records[-1] if records else None
