"""``DeltaSyncCallback``: publish a transformers ``Trainer``'s weights (and so a TRL trainer's) every optimizer step.

Two lines in a training script::

    from deltasync.integrations.transformers import DeltaSyncCallback
    trainer = Trainer(..., callbacks=[DeltaSyncCallback("s3://bucket/run-7", dtype=torch.bfloat16)])

One process publishes: rank 0 under DDP (every rank holds the same full weights, so one copy is enough), the
only process otherwise. Sharded trainers (FSDP, DeepSpeed ZeRO-3) hold no rank with the full weights; they are
refused at train begin until per-rank sharded publishing lands (issue 11).

This module imports transformers; ``import deltasync`` does not import this module.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from deltasync.errors import ConfigError, MissingDependencyError
from deltasync.integrations.metrics import PREFIX, metrics_for_logs
from deltasync.publish.names import NameMap
from deltasync.publish.publisher import DeltaPublisher

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

SHARDED_ISSUE = "issue 11: per-rank sharded publishing"


class DeltaSyncCallback(TrainerCallback):
    """Publish the model after every optimizer step as step ``state.global_step``; metrics go to the logs.

    ``publisher_kwargs`` go to ``DeltaPublisher`` (``dtype``, ``anchor_every``, ``storage_options``, ``files``,
    ...). ``names`` maps each canonical tensor name (wrapper prefixes such as DDP's ``module.`` removed) to
    the name the inference engine knows. ``publish_initial`` also publishes the weights at train begin, as
    step ``state.global_step`` (0 for a fresh run), so that a consumer can start from the stream alone; it
    is skipped when the stream already holds that step (a resumed run).

    Publishing errors are not swallowed: a step that failed in the background raises ``PublishError`` from the
    next ``on_step_end`` and stops training, as a failed checkpoint save would.
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
        self._logged_step: int | None = None

    # --- Trainer events ---

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        """Check that one rank holds the full weights (on every rank, so all fail alike), then start publishing on it."""
        if model is None:
            raise ConfigError("DeltaSyncCallback: the Trainer passed no model to on_train_begin")
        sharding = _sharding(args, model)
        if sharding is not None:
            raise ConfigError(
                f"DeltaSyncCallback: the model is sharded ({sharding}): no rank holds the full weights; expected "
                f"single-process or DDP training. Sharded trainers are not supported yet ({SHARDED_ISSUE})"
            )
        if not state.is_world_process_zero:
            return
        self.close()  # a second train() call starts a new publisher on the same stream
        self.publisher = DeltaPublisher(self.url, model, names=self.names, **self.publisher_kwargs)
        committed = self.publisher.last_committed_step
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
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kwargs: Any
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

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Flush every captured step to the store, then release the stream."""
        self.close()

    # --- plain API ---

    def attach(self, trainer: Any) -> Any:
        """Add this callback to ``trainer`` ahead of every other callback, so that the reporting callbacks (W&B,
        TensorBoard, ...) receive the metrics it adds to each log; returns ``trainer``."""
        trainer.callback_handler.callbacks.insert(0, self)
        return trainer

    def metrics(self, trainer_step: int | None = None) -> dict[str, float]:
        """The newest committed step's metrics as numbers (empty before the first commit); with ``trainer_step``,
        also ``lag_steps``: how far the newest committed step is behind it."""
        pub = self.publisher
        if pub is None or not pub.metrics:
            return {}
        newest = pub.metrics[-1]
        out = metrics_for_logs(newest, prefix=self.log_prefix)
        if trainer_step is not None:
            out[self.log_prefix + "lag_steps"] = trainer_step - newest.step
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


def _sharding(args: Any, model: Any) -> str | None:
    """How the model is sharded across ranks, in words, or None when this process holds its full weights."""
    fsdp = getattr(args, "fsdp", None)
    if fsdp:
        return f"TrainingArguments.fsdp={fsdp!r}"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return "accelerate FSDP (ACCELERATE_USE_FSDP)"
    if getattr(args, "deepspeed", None):
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            return "DeepSpeed ZeRO-3"
    if isinstance(model, torch.nn.Module) and torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torch.distributed.tensor import DTensor

        for module in model.modules():
            if isinstance(module, (FSDPModule, FullyShardedDataParallel)):  # FSDP2, FSDP1
                return f"a {type(module).__name__} module"
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                return f"parameter {name!r} is a DTensor"
    return None
