"""deltasync as a trainer-side engine of vLLM's weight-transfer API: a trainer written against vLLM's API switches to
deltasync by one string.

vLLM 0.32 pairs each receiving engine (``WeightTransferEngineFactory``) with a trainer engine
(``WeightTransferTrainerFactory``) that a trainer drives through any ``VLLMWeightSyncClient`` (HTTP, Ray actors)::

    engine = WeightTransferTrainerFactory.trainer_init(
        DeltasyncTrainerInitInfo(url="s3://bucket/run-7", rank=rank),   # was: NCCLTrainerInitInfo(...)
        client=HTTPVLLMWeightSyncClient("http://rollout:8000"), source=ModuleSource(model))
    for step in ...:
        optimizer.step()
        engine.send_weights()            # publish the step, wait for its commit, every engine applies it

``send_weights`` publishes the change since the last step (a sparse delta, an anchor every so often) to the
stream, waits until it is committed, then on rank 0 drives the inference engines' own deltasync engines
(``--weight-transfer-config '{"backend": "deltasync"}'``) through the client: start, update to the step (each
engine fetches, verifies and applies it in place, or rolls back), finish with the step as weight version; the
clients of this package also pause, read back the step and reset prefix caches. Only step numbers cross the
client; the bytes go through the store, which keeps every step (replay, late joiners, other regions).

Where the weights come from:

* ``source=ModuleSource(model)`` (vLLM's): the module itself. A sharded module (FSDP2, DTensor parameters) is
  published by every rank from its own shard, with no gather (docs/FORMAT.md section 5b); otherwise rank 0
  publishes it and the other ranks do nothing.
* any other ``WeightSource``: iterated on every rank (iteration may be a collective), published as a stream of
  tensors by rank 0, each diffed as it arrives.
* no source: ``send_weights(weights)`` with the round's ``(name, tensor)`` pairs, on rank 0.

Registered as ``"deltasync"`` in ``WeightTransferTrainerFactory`` by the same ``vllm.general_plugins`` entry point
as the receiving engine (:mod:`rollout_loader.vllm.plugin`); importing this module imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from deltasync import PublishOptions
from deltasync.engine import StoreLocation
from deltasync.errors import ConfigError

from .settings import EngineSettings
from .target import VllmTarget
from .trainer_sync import TrainerSync

log = logging.getLogger(__name__)

__all__ = ["DeltasyncTrainerEngine", "DeltasyncTrainerInitInfo"]

BACKEND = "deltasync"


@dataclass
class DeltasyncTrainerInitInfo(TrainerInitInfo):
    """The deltasync trainer engine's settings (``rank`` is keyword-only, from vLLM's base: rank 0 drives the
    inference engines).

    Args:
        url: the stream the trainer publishes to (``s3://bucket/run-7``, a path, ...).
        storage_options: fsspec options of the trainer's store.
        publish: the publisher's settings: a :class:`deltasync.PublishOptions` or a mapping of its fields (from a
            config file: ``dtype`` may be a name such as ``"bfloat16"``).
        engine: the receiving engines' settings: an :class:`~rollout_loader.vllm.EngineSettings` or a mapping of its
            fields. Its ``url``/``storage_options`` default to the trainer's (set them when the engines read another
            copy, e.g. a mirror in their region).

    Raises:
        ConfigError: a bad field, naming it.
    """

    backend: ClassVar[str] = BACKEND

    url: str
    # a plain dict, not a StoreLocation: vLLM builds this init info from the JSON/keyword arguments a trainer's
    # config gives (TrainerInitInfo is a plain dataclass); location() makes the one value the publisher opens
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)  # credentials: never in a repr
    publish: PublishOptions | Mapping[str, Any] | None = None
    engine: EngineSettings | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        where = "DeltasyncTrainerInitInfo"
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"{where}.url: expected the stream's URL, got {self.url!r}")
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"{where}.storage_options: expected a mapping of fsspec options, got "
                              f"{type(self.storage_options).__name__}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"{where}.rank: expected this trainer process's rank (>= 0), got {self.rank!r}")
        if self.publish is None or isinstance(self.publish, Mapping):
            self.publish = PublishOptions.parse(self.publish or {}, where=f"{where}.publish")
        elif not isinstance(self.publish, PublishOptions):
            raise ConfigError(f"{where}.publish: expected PublishOptions or a mapping, got "
                              f"{type(self.publish).__name__}")
        if self.engine is None or isinstance(self.engine, Mapping):
            self.engine = EngineSettings.parse(dict(self.engine or {}), key_files=True)  # this trainer's config
        elif not isinstance(self.engine, EngineSettings):
            raise ConfigError(f"{where}.engine: expected EngineSettings or a mapping, got {type(self.engine).__name__}")
        if self.engine.url is None:  # the engines read what the trainer writes
            self.engine = self.engine.replace(url=self.url, storage_options=dict(self.storage_options))


    def location(self) -> StoreLocation:
        """The trainer's stream as one value (its URL and storage options): what its publisher opens."""
        return StoreLocation.of(self.url, self.storage_options)


class DeltasyncTrainerEngine(TrainerWeightTransferEngine[DeltasyncTrainerInitInfo]):
    """Publishes each round as a step of a deltasync stream and moves every inference engine to it (see the module
    docstring). Made by ``WeightTransferTrainerFactory.trainer_init`` on every trainer rank."""

    init_info_cls = DeltasyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sync: TrainerSync | None = None  # this rank's publisher (rank 0; every rank of a sharded module)
        self._module: torch.nn.Module | None = None

    @property
    def target(self) -> VllmTarget | None:
        """The inference engines, on rank 0 (None elsewhere)."""
        return None if self.sync is None else self.sync.target

    @property
    def steps(self) -> list[int]:
        """The steps sent, in order."""
        return [] if self.sync is None else self.sync.steps

    @classmethod
    def trainer_init(cls, init_info: DeltasyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> DeltasyncTrainerEngine:
        """Open the publisher (every rank of a sharded module, else rank 0) and, on rank 0, point every inference
        engine at the stream (its deltasync engine learns the stream, and which step it holds)."""
        if source is not None and not isinstance(source, WeightSource):
            raise ConfigError(f"deltasync trainer engine: source must be a vLLM WeightSource (e.g. ModuleSource), "
                              f"got {type(source).__name__}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine._open(init_info)
        return engine

    def _open(self, info: DeltasyncTrainerInitInfo) -> None:
        assert isinstance(info.publish, PublishOptions) and isinstance(info.engine, EngineSettings)
        module = self.source._module if isinstance(self.source, ModuleSource) else None
        sharded = module is not None and _is_sharded(module)
        self._module = module
        # a client that is none is refused before anything is written
        target = VllmTarget(self.client, info.engine) if self.is_sender else None
        if not (self.is_sender or sharded):
            return
        self.sync = TrainerSync(info.location(), source=module, options=info.publish, target=target,
                                who="deltasync trainer engine", served_dtype=not sharded)
        try:
            self.sync.open()
        except BaseException:
            self.shutdown()
            raise

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                     step: int | None = None) -> int | None:
        """Publish this round as ``step`` (default: the step after the newest committed one), wait for its commit,
        and on rank 0 bring every inference engine to it (verified by each, or rolled back and raised). Called on
        every trainer rank. Returns the step (None on a rank that does not write, unless ``step`` was given).

        A ``step`` the stream holds already (a resumed trainer's first round at its checkpoint's step) publishes
        nothing once the weights are proved to be that step's (``ConfigError`` otherwise).

        Args:
            weights: the round's ``(name, tensor)`` pairs, when the engine was made without a ``source``.
            step: the step number (increasing; e.g. the trainer's global step).

        Raises:
            ConfigError: weights given beside a source, or neither; a step before the stream's newest.
            deltasync errors: publishing or applying failed (the engines keep their previous step).
        """
        if (weights is None) == (self.source is None):
            raise ConfigError("deltasync trainer engine: send_weights needs the round's weights when it was made "
                              "without a source, and none when it was made with one")
        pairs = weights if weights is not None else (iter(self.source) if self._module is None else None)
        if self.sync is None:  # a rank that does not write: drain a source whose iteration is a collective
            if pairs is not None and self.source is not None:
                for _ in pairs:
                    pass
            return step
        sent = self.sync.send(pairs, step=step)
        log.info("deltasync trainer engine: step %d published and live in the inference engines", sent)
        return sent

    def shutdown(self) -> None:
        """Close the publisher (its last steps committed); the inference engines keep their step."""
        sync, self.sync = self.sync, None
        if sync is not None:
            sync.close()


def _is_sharded(module: torch.nn.Module) -> bool:
    """Whether the module's parameters are DTensors (FSDP2 and other DTensor parallelism)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


def _register() -> None:
    """Make ``"deltasync"`` a trainer backend in this process as soon as its init info can be named: a trainer
    process loads no vLLM plugins (only engine processes do), so importing this module is what registers it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        try:
            WeightTransferTrainerFactory.register_engine(BACKEND, DeltasyncTrainerEngine)
        except ValueError:  # registered meanwhile (the plugin, another thread): what is registered stays
            pass


_register()
