"""What every framework seam does on the trainer's side, once: publish the trainer's weights as a step, wait for its
commit, and bring the inference engines to it.

vLLM's trainer engine (rollout_loader/vllm/trainer.py), TRL's weight transfer (rollout_loader/integrations/trl.py)
and verl's checkpoint engine (rollout_loader/integrations/verl/engine.py) differ in who calls them and when; the step
they publish and what the engines do with it are this module's :class:`TrainerSync`:

* the step number: the caller's (a framework's global step), else the one after the newest committed step, so a
  restarted trainer goes on where the stream is;
* a step the stream holds already (a resumed run's first sync at its checkpoint's step, or a framework syncing the
  same step again) publishes nothing: the trainer's tensors are proved to be that step's, tensor by tensor, against
  its checksums (a checkpoint of another run is refused); a step older than the newest committed one is refused
  (a committed step is never replaced);
* the weights: the publisher's source (a module, a sharded module on every rank), or a stream of ``(name,
  tensor)`` pairs diffed as they arrive (no second copy of the model), always read to its end, also on an error
  (on FSDP2 each pair is a collective the other ranks wait in);
* the dtype: the one the engines serve (a server's ``/server_info``) unless the publish options name it: a step in
  another dtype would be refused by every engine after a full upload;
* then every engine applies the step in place through its deltasync engine (``VllmTarget.advance``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from deltasync import DeltaPublisher, PublishOptions, StreamReader
from deltasync.engine import MAX_STEP, StoreLocation
from deltasync.errors import ConfigError

from .client import HttpWeightTransfer
from .target import VllmTarget

log = logging.getLogger(__name__)

__all__ = ["TrainerSync", "drain"]

Pairs = Iterable[tuple[str, torch.Tensor]]
# the dtypes a vLLM server holds a model in (its model_config.dtype: "half", "bfloat16", "float"): a step in another
# (int8, bool, float64) would be cast from the trainer's weights by a server's say-so and break the stream for all
SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TrainerSync:
    """A trainer's publisher and (on the rank that drives them) its inference engines, moved one step at a time.

    Args:
        url: the stream the trainer writes (and, unless the target's settings name another, the engines read): a URL,
            or a :class:`deltasync.engine.StoreLocation` (its URL and options as one value).
        source: the publisher's source (a module, a state dict; every rank of a sharded module), or None when each
            :meth:`send` passes the round's pairs.
        options: the publisher's settings (``on_backlog`` is always ``"block"``: each round waits for its commit).
        storage_options: the store's options beside a URL (a convenience: made into the location at once).
        target: the engines (a :class:`~rollout_loader.vllm.VllmTarget`), or None on a rank that only publishes.
        who: names the caller in messages (``"DeltasyncWeightTransfer"``).
        timeout_s: how long a send waits for its step to be committed.
        served_dtype: publish in the dtype a server target serves when ``options`` names none (off for a sharded
            source: every rank must publish in the same dtype, and only the driving rank asks the server).

    Raises:
        ConfigError: a bad argument; a step that cannot be published (older than the stream's newest, or a resumed
            checkpoint whose weights are not the committed step's).
        NonFiniteStepError: (``send``) the round's weights turned NaN or ±Inf (``PublishOptions.refuse_nonfinite``):
            nothing is published, the engines keep their step, and the next ``send`` takes the same step number.
    """

    def __init__(self, url: str | StoreLocation, *, source: Any = None, options: PublishOptions | None = None,
                 storage_options: dict[str, Any] | None = None, target: VllmTarget | None = None,
                 who: str = "deltasync", timeout_s: float | None = None, served_dtype: bool = True) -> None:
        self.location = StoreLocation.of(url, storage_options)  # the store, as one value: what both sides open
        self.url = self.location.shown  # what messages show (a URL's password hidden)
        self.source = source
        self.options = options if options is not None else PublishOptions()
        self.target = target
        self.who = who
        self.timeout_s = timeout_s
        self.served_dtype = served_dtype
        self.publisher: DeltaPublisher | None = None
        self.steps: list[int] = []  # the steps the engines were brought to (or, with no target, published), in order
        self._sent_here = False  # a step was sent since open(): the next default step follows it
        self._reader: StreamReader | None = None  # the stream as the engines are told to read it (open() to close())

    @property
    def step(self) -> int | None:
        """The step last sent (None before the first)."""
        return self.steps[-1] if self.steps else None

    def open(self) -> None:
        """Take the stream's writer lease (the publisher) and point the engines at the stream; again: nothing."""
        if self.publisher is not None:
            return
        options = dataclasses.replace(self._served_dtype(self.options), on_backlog="block")
        publisher = DeltaPublisher(self.location, self.source, options)
        try:
            if self.target is not None:
                # a signing trainer's engines apply only what its key signed for its stream (docs/FORMAT.md 5e),
                # unless the target's settings name their own trust
                self._reader = reader = StreamReader(self.location, trusted_keys=publisher.trust)
                sent = self.target.engine_settings(reader).location().options
                if sent and sent == self.location.options:
                    # the trainer's store options may carry write access; an engine only reads (SECURITY.md)
                    log.warning("%s: the inference engines get the trainer's storage options (its credentials): "
                                "give them read-only ones in the engine settings (storage_options)", self.who)
                held = self.target.connect(reader)  # the engines read this stream unless the target names another
                log.info("%s: stream %s (newest committed step %s), engines at step %s", self.who, self.url,
                         publisher.last_committed_step, held)
        except BaseException:
            publisher.close()
            self._close_reader()
            raise
        self.publisher, self._sent_here = publisher, False

    def send(self, weights: Pairs | None = None, *, step: int | None = None) -> int:
        """Publish this round as ``step`` (default: after the last one), wait for its commit, bring the engines to it.

        ``weights``: the round's pairs (read to their end whatever happens), or None to publish the source. A step
        the stream holds already publishes nothing (see the module docstring). Returns the step.
        """
        items = None if weights is None else iter(weights)
        try:
            self.open()
            publisher = self.publisher
            assert publisher is not None
            step, committed = self._next_step(publisher, step)
        except BaseException:
            drain(items, self.who)
            raise
        if committed:
            self._prove_committed(publisher, items, step)
            log.info("%s: the stream holds step %d already, the trainer's weights bit for bit: nothing published",
                     self.who, step)
        else:
            if items is None:
                publisher.publish(step)
            else:
                publisher.publish(step, weights=items)  # reads the rest of items itself when it fails
            publisher.flush(self.timeout_s)
            self._sent_here = True
        if self.target is not None and self.target.step != step:
            assert self._reader is not None  # open() made it with the target's connection
            self.target.advance(self._reader, step)
        self.steps.append(step)
        return step

    def close(self) -> None:
        """Flush and close the publisher (the lease released); the engines keep their step."""
        publisher, self.publisher = self.publisher, None
        try:
            if publisher is not None:
                publisher.close()
        finally:
            self._close_reader()

    def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    # --- helpers ---

    def _next_step(self, publisher: DeltaPublisher, want: int | None) -> tuple[int, bool]:
        """This round's step, and whether the stream holds it already."""
        newest = publisher.last_committed_step
        if want is None:
            if self._sent_here and self.steps:
                return self.steps[-1] + 1, False
            return (0 if newest is None else newest + 1), False
        if isinstance(want, bool) or not isinstance(want, int) or not 0 <= want <= MAX_STEP:
            raise ConfigError(f"{self.who}: a step must be a step number 0..{MAX_STEP}, got {want!r}")
        if newest is not None and want < newest:
            raise ConfigError(
                f"{self.who}: {self.url} already holds step {newest}, after the trainer's step {want}: a committed "
                "step is never replaced; resume from a later checkpoint or publish to a new URL")
        return want, want == newest

    def _prove_committed(self, publisher: DeltaPublisher, items: Iterator[tuple[str, torch.Tensor]] | None,
                         step: int) -> None:
        """The trainer's weights (``items``, or the source) are the committed ``step``'s, bit for bit
        (``DeltaPublisher.differs_from``); ``ConfigError`` naming those that differ. Reads every item."""
        try:
            differ = publisher.differs_from(step, items)
        except BaseException:
            drain(items, self.who)
            raise
        if differ:
            raise ConfigError(
                f"{self.who}: {self.url} holds step {step}, the trainer's step, but not its weights ({len(differ)} "
                f"tensors differ: {differ[:5]}): the checkpoint is not the one this stream published at step {step}; "
                "resume from that run's checkpoint, or publish to a new URL")

    def _served_dtype(self, options: PublishOptions) -> PublishOptions:
        """``options`` with ``dtype`` the one a server serves when not given; ``ConfigError`` for another one."""
        client = None if self.target is None or not self.served_dtype else self.target.client
        if not isinstance(client, HttpWeightTransfer):  # the caller says the dtype
            return options
        if self.target is not None and self.target.settings.representation != "checkpoint":
            return options  # the engine's own representation (FP8 bytes, fp32 scales): published as it is
        name = client.served_dtype()
        served = getattr(torch, name.removeprefix("torch."), None)
        if served not in SERVED_DTYPES:  # the server's word decides every step's dtype: only what vLLM serves
            raise ConfigError(f"{self.who}: the server at {client.base_url} says it serves dtype {name!r}, not one of "
                              f"{', '.join(map(str, SERVED_DTYPES))}: name the dtype to publish in (the publish "
                              "option dtype) if that server is the right one")
        if options.dtype is None:
            log.info("%s: publishing in %s, the dtype the server serves", self.who, served)
            return dataclasses.replace(options, dtype=served)
        if options.dtype != served:
            raise ConfigError(f"{self.who}: dtype is {options.dtype} but the server at {client.base_url} serves "
                              f"{served}: its engine cannot apply steps of another dtype (leave dtype unset to "
                              "publish in the server's)")
        return options


def drain(items: Iterator[Any] | None, who: str) -> None:
    """Read the rest of the trainer's tensors without using them: on FSDP2 every one is a collective
    (``full_tensor()``) that the other ranks wait in."""
    if items is None:
        return
    try:
        for _ in items:
            pass
    except Exception as e:  # noqa: BLE001 - the error being raised is the one the caller must see
        log.warning("%s: reading the rest of the trainer's tensors failed too: %s", who, e)
