"""How a ``DeltaPublisher`` publishes: one typed, validated record of its settings.

Given to the publisher as ``options=PublishOptions(...)`` or as keyword arguments of the same names (the
two-line use: ``DeltaPublisher(url, model, anchor_every=10)``); the publisher hands the record and the store
to its writer (one process, or the ranks of a sharded model), never itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from deltasync.errors import ConfigError
from deltasync.format import digest as digests
from deltasync.notify import host_port
from deltasync.publish.names import NameMap
from deltasync.rdma.options import RdmaOptions, rdma_options
from deltasync.stages.diff import SnapshotDevice

if TYPE_CHECKING:
    from deltasync.signing import SigningKey
    from deltasync.store.model_files import ModelFiles

OnBacklog = Literal["coalesce", "block"]

__all__ = ["OnBacklog", "PublishOptions"]


@dataclass(frozen=True, kw_only=True)
class PublishOptions:
    """A publisher's settings.

    Args:
        anchor_every: a full checkpoint (anchor) every this many published steps (>= 1); the others are deltas.
        anchor_deltas: store an anchor's delta from the step before too, so a follower crosses it cheaply.
        snapshot_device: where the last-published copy lives: ``"same"`` (the weights' device) or ``"cpu"``.
        max_pending: steps captured but not yet uploaded before ``on_backlog`` applies (>= 1).
        on_backlog: ``"coalesce"`` (skip a step while uploads lag: the next one carries its change) or
            ``"block"`` (the trainer waits).
        zstd_level: zstd's level for the encoded changes (1-22).
        max_chunk_bytes: host memory a device tensor's diff may use at once.
        dtype: the published dtype of floating tensors of 16 bits or more (e.g. ``torch.bfloat16`` for fp32 master
            weights; or its name, ``"bfloat16"``, from a config file); 8-bit floats (an FP8 representation) are
            published as they are.
        spool_dir: where objects are written before upload (a temp folder by default).
        writer_id: this writer's name in the stream's lease (host, pid and a random suffix by default).
        take_over: take the stream's lease from another writer that still holds it.
        lease_s: how long the lease lasts unless renewed (the publisher renews it at a third of this).
        names: renames the model's tensor names (after wrapper prefixes are removed).
        sharded: publish from every rank of a sharded (DTensor) model; None detects it.
        files: the model's non-weight files (a checkpoint folder, or name -> bytes), stored once per stream.
        signing_key: a private key (``deltasync keygen``) that signs every step.
        stream_id: the stream's id (1 to 128 letters, digits, ``.``, ``_``, ``-``): a new stream is created with
            it, an existing one must have it (``ConfigError`` otherwise), and a signing publisher signs for it.
            Followers pin the same id beside the trusted keys (docs/FORMAT.md section 5e). None: a new stream gets
            a random id (``DeltaPublisher.stream_id``, logged).
        events: ``"HOST:PORT"`` (port 0: any free port): serve an event feed there announcing each step as it
            is committed (``DeltaPublisher.events_url``), the feed a mirror serves with ``--events``. Followers
            and engines given it (``notify``) fetch a step as soon as it lands instead of at their next poll.
            On a sharded trainer, rank 0 serves it.
        rdma: offer each committed step's object over NIXL too (docs/RDMA.md): the controller's address
            (``"tcp://host:5555"``), a dict of ``RdmaOptions`` fields or ``RdmaOptions``. The store still gets
            every step; consumers that follow with an ``RdmaConsumer`` read the object from this rank's ring, the
            others (and any step the ring cannot hold) from the store. ``DeltaPublisher.rdma.stats`` says which
            steps went which way. Needs ``pip install 'deltasync[rdma]'`` and the cluster secret. On a sharded
            trainer, rank 0 runs it (its steps go by the store: one object per rank).
        refuse_nonfinite: refuse a step whose weights turned NaN or ±Inf (a diverged optimizer) with
            ``NonFiniteStepError`` naming the tensors: a floating tensor all finite in the step published before
            that holds NaN or ±Inf now (in the published dtype); in a publisher's first step, one holding NaN. A tensor
            that held non-finite values already (a ``-inf`` mask) never refuses a step. Nothing of a refused step
            is published and the publisher goes on from the last published step (publish/finite.py). Only changed
            tensors are read. False publishes such steps.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the option; ``DELTASYNC_DIGEST`` set to an
            algorithm writers do not know (format/digest.py).

    Example::

        opts = PublishOptions(anchor_every=50, dtype=torch.bfloat16)
        DeltaPublisher("s3://bucket/run1", model, options=opts)
    """

    anchor_every: int = 20
    anchor_deltas: bool = True
    snapshot_device: SnapshotDevice = "same"
    max_pending: int = 2
    on_backlog: OnBacklog = "coalesce"
    zstd_level: int = 1
    max_chunk_bytes: int = 64 << 20
    dtype: torch.dtype | None = None
    spool_dir: str | Path | None = None
    writer_id: str | None = None
    take_over: bool = False
    lease_s: float = 120.0
    names: NameMap | None = None
    sharded: bool | None = None
    files: str | Path | ModelFiles | None = None
    signing_key: str | Path | SigningKey | None = None
    stream_id: str | None = None
    events: str | None = None
    rdma: str | RdmaOptions | dict[str, Any] | None = None
    refuse_nonfinite: bool = True

    def __post_init__(self) -> None:
        def whole(name: str, value: Any, low: int, high: int | None = None) -> None:
            if (isinstance(value, bool) or not isinstance(value, int) or value < low
                    or (high is not None and value > high)):
                span = f"{low}-{high}" if high is not None else f">= {low}"
                raise ConfigError(f"publish option {name} must be a whole number {span}, got {value!r}")

        if not isinstance(self.refuse_nonfinite, bool):
            raise ConfigError(f"publish option refuse_nonfinite must be True or False, got {self.refuse_nonfinite!r}")
        whole("anchor_every", self.anchor_every, 1)
        whole("max_pending", self.max_pending, 1)
        whole("zstd_level", self.zstd_level, 1, 22)
        whole("max_chunk_bytes", self.max_chunk_bytes, 1)
        for name, allowed in (("snapshot_device", SnapshotDevice), ("on_backlog", OnBacklog)):
            if getattr(self, name) not in get_args(allowed):
                raise ConfigError(f"publish option {name} must be one of {get_args(allowed)}, got "
                                  f"{getattr(self, name)!r}")
        if isinstance(self.lease_s, bool) or not isinstance(self.lease_s, (int, float)) or not 0 < self.lease_s < 1e7:
            raise ConfigError(f"publish option lease_s must be seconds > 0, got {self.lease_s!r}")
        if isinstance(self.dtype, str):  # from a config file: "bfloat16" or "torch.bfloat16"
            named = getattr(torch, self.dtype.removeprefix("torch."), None)
            if not isinstance(named, torch.dtype):
                raise ConfigError(f"publish option dtype must be a torch.dtype or its name (e.g. 'bfloat16'), got "
                                  f"{self.dtype!r}")
            object.__setattr__(self, "dtype", named)
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"publish option dtype must be a torch.dtype, got {self.dtype!r}")
        if self.events is not None:
            host_port(self.events, what="publish option events")
        if self.rdma is not None:  # checked (and made options) now: a config's typo fails here, not on a thread
            try:
                object.__setattr__(self, "rdma", rdma_options(self.rdma))
            except ConfigError as e:
                raise ConfigError(f"publish option {e}") from None
        if self.stream_id is not None:
            from deltasync.trust import check_stream_id

            check_stream_id(self.stream_id, what="publish option stream_id")
        if self.writer_id is not None and (not isinstance(self.writer_id, str) or not self.writer_id):
            raise ConfigError(f"publish option writer_id must be a non-empty string, got {self.writer_id!r}")
        digests.write_algorithm()  # DELTASYNC_DIGEST: a typo fails here, not on the committing thread

    @classmethod
    def parse(cls, options: Any, *, where: str = "publish options") -> PublishOptions:
        """Options from a mapping of their fields (a framework's config section); an unknown field is a
        ``ConfigError`` naming it, ``where`` and the known ones."""
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}: expected a mapping of publish options, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ConfigError(f"{where}: unknown publish option(s) {unknown}; the options are {sorted(known)}")
        return cls(**options)

    @classmethod
    def build(cls, options: PublishOptions | None, overrides: dict[str, Any]) -> PublishOptions:
        """``options`` (or the defaults) with ``overrides`` applied; ``TypeError`` naming an unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"DeltaPublisher got unknown option(s) {unknown}; the options are {sorted(known)}")
        base = options if options is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"options must be a PublishOptions, got {type(base).__name__}")
        return replace(base, **overrides)  # validated again (__post_init__)
