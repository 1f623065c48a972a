"""The trainer's side: ``DeltaPublisher`` captures each step's change and publishes it in the background.

``publish(step)`` runs the diff on the weights' own device (fast on GPU, and it needs no copy of the
model) and returns; encoding, writing and uploading run in a background thread behind a bounded queue.
When that queue is full, steps coalesce: the step is not captured, and the next capture (diffed against
what was last *captured*) carries its change, so memory stays bounded and nothing is lost.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltasync.errors import ConfigError, DeltaSyncError, NonFiniteStepError, PublishError, StepOrderError
from deltasync.format.documents import Kind, check_step
from deltasync.format.objects import TensorHeader
from deltasync.format.patch import Patch
from deltasync.publish.finite import refusal, refused_tensors
from deltasync.publish.names import canonical_name, named_tensors
from deltasync.publish.options import PublishOptions
from deltasync.publish.sharded import ShardedWriter, ShardGroup, is_sharded
from deltasync.publish.sinks import CommitAnnouncement, CommitSink, EventSink, rdma_sink
from deltasync.publish.steps import (
    anchor_delta,
    snapshot_headers,
    step_manifest,
    write_step_object,
)
from deltasync.publish.stream import StreamCapture, Weights, checked_entry, drain, stream_entries
from deltasync.signing import SigningKey, StreamSigner
from deltasync.stages.diff import Snapshot, published_dtype
from deltasync.store import open_store
from deltasync.store.location import Where
from deltasync.store.model_files import collect_model_files, store_model_files
from deltasync.store.scratch import ScratchFolder
from deltasync.trust import TrustedKeys, own_trust, writer_signer

log = logging.getLogger(__name__)

__all__ = ["DeltaPublisher", "PublishOptions", "StepMetrics"]



@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one published step cost and weighed."""

    step: int
    base_step: int | None
    kind: Kind
    coalesced_steps: tuple[int, ...]
    numel: int
    changed: int
    object_bytes: int
    full_bytes: int
    capture_s: float  # diff (and for anchors the copy), on the trainer's thread
    encode_s: float
    write_s: float
    upload_s: float

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def bytes_per_changed(self) -> float:
        return self.object_bytes / self.changed if self.changed else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "density": self.density}


@dataclass(kw_only=True)
class _Job:
    step: int
    base_step: int | None
    kind: Kind
    coalesced: tuple[int, ...]
    headers: dict[str, TensorHeader]
    aliases: dict[str, str]
    changes: list[Patch] = field(default_factory=list)
    anchor_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    delta_base: int | None = None  # an anchor that also carries its delta from this step (``changes``)
    capture_s: float = 0.0
    # an anchor written from the snapshot itself (a stream's): set once its object is written, so that the
    # next capture, which changes the snapshot, waits for it
    released: threading.Event | None = None


class DeltaPublisher:
    """Publish a model's weights to a deltasync stream after each optimizer step.

    ``source`` is a module, a state dict (whose tensors the trainer updates in place) or a function
    returning one. ``anchor_every`` writes a full snapshot every N published steps (also the first step,
    after a restart, after a failed upload, and on ``publish(step, anchor=True)``); with ``anchor_deltas`` an
    anchor also carries its delta from the step published before it, so that followers that hold that step
    never download the anchor's dense bytes (docs/FORMAT.md section 5). ``snapshot_device``
    says where the last-published copy lives: ``"same"`` (the weights' device) or ``"cpu"``; either way it
    costs one copy of the model. ``dtype`` publishes floating tensors in that dtype (e.g. fp32 master
    weights as the bf16 weights the engine serves). ``max_pending`` bounds captured steps waiting for upload;
    ``on_backlog="block"`` waits instead of coalescing. Use as a context manager or call ``close()``.

    Bad steps never reach the fleet: with ``refuse_nonfinite`` (the default) a step whose weights turned NaN or ±Inf
    is refused on the trainer's thread with ``NonFiniteStepError`` naming the tensors, before anything of it is
    queued, and the publisher goes on from the last published step (publish/finite.py states the rule).

    One publisher per stream: it holds a lease object (``writer_id``, renewed every ``lease_s / 3``) and a
    second publisher is refused with ``WriterConflictError`` unless it passes ``take_over=True``; a writer
    that lost its lease commits nothing more.

    Tensors publish under the model's own names: ``module.`` (DDP), ``_orig_mod.`` (``torch.compile``) and
    other wrapper prefixes are removed, and ``names`` (a function) renames what remains.

    ``files`` (a checkpoint folder, or name -> bytes) are the model's non-weight files: config, tokenizer,
    generation config. They are stored once per stream, before the first commit, so that
    ``deltasync replay`` writes folders that transformers and vLLM load as they are.

    A sharded model (FSDP2 ``fully_shard``, any ``DTensor`` state dict; ``sharded=None`` detects it) is
    published by every rank: make the publisher and call ``publish(step)`` on every rank. Each rank writes
    its own shard as one part of the step (docs/FORMAT.md section 5b; publish/sharded.py), rank 0 holds
    the lease and commits; steps run on the trainer's thread. A function ``source`` needs ``sharded=True``.

    Settings come as ``options`` (a ``PublishOptions``: publish/options.py documents each) or as keyword
    arguments of the same names; ``ConfigError`` names one that makes no sense, ``TypeError`` an unknown one.

    ``signing_key`` (a private key file made by ``deltasync keygen``, mode 0600) signs every step before it
    is committed, and the stream's head in ``latest.json`` after each commit, every third of the lease while it
    runs and, closed, when it closes (docs/FORMAT.md section 5e): followers given its public half and the stream's
    id (``stream_id``, logged; pin it with the ``stream_id`` option) accept nothing else. A signing publisher
    resumes after the newest step its own key signed: a forged manifest in the store does not exist for it.

    A framework that hands weights over as a stream (verl's per-tensor generator, vLLM's ``WeightSource``, TRL's
    ``send_weights`` iterator) passes ``source=None`` and gives every step's tensors as
    ``publish(step, weights=...)``: each tensor is diffed as it arrives and released before the next, so the
    publishing rank never holds a second copy of the model (publish/stream.py).

    Args:
        url: the stream (``"s3://bucket/run1"``, a local path, any fsspec URL) or a ``Store``.
        source: a module, a state dict, a function returning one, or None when every ``publish`` passes
            ``weights``.
        options: a ``PublishOptions``; keyword arguments of the same names override its fields.
        storage_options: fsspec options for ``url`` (credentials, endpoint).

    Raises:
        ConfigError: an option that makes no sense (naming it), or ``sharded=True`` with ``source=None``.
        TypeError: an unknown option.
        WriterConflictError: another writer holds the stream (pass ``take_over=True`` to take it).

    Example::

        with DeltaPublisher("s3://bucket/run1", model, dtype=torch.bfloat16) as pub:
            for step in range(steps):
                train_one_step(model)
                pub.publish(step)

        with DeltaPublisher("s3://bucket/run1", None, dtype=torch.bfloat16) as pub:  # a framework's stream
            pub.publish(step, weights=weight_source)
    """

    def __init__(
        self,
        url: Where,
        source: Any,
        options: PublishOptions | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        opts = self.options = PublishOptions.build(options, overrides)
        # read (and its file's mode checked) before anything is written; None on the ranks of a sharded trainer
        # other than rank 0 is fine: rank 0 signs every commit
        key = opts.signing_key
        self.signing_key = key if key is None or isinstance(key, SigningKey) else SigningKey(key)
        self.store, _ = open_store(url, storage_options)
        self.source = source
        self._model_files = collect_model_files(opts.files) if opts.files is not None else None
        self.metrics: list[StepMetrics] = []
        # where objects are written before upload: made on first use, removed by close() (deltasync/store/scratch.py)
        self._spool_folder = ScratchFolder("spool", opts.spool_dir)
        self._snapshot: Snapshot | None = None
        self._pinned: threading.Event | None = None  # set when the anchor written from the snapshot is out of it
        self._aliases: dict[str, str] = {}
        self._since_anchor = 0
        self._force_anchor = True  # the first step of every publisher is an anchor
        self._skipped: list[int] = []
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=opts.max_pending)
        self.writer_id = opts.writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        sharded = opts.sharded
        if source is None and sharded:
            raise ConfigError("publish option sharded=True needs the model as source: every rank publishes its own "
                              "shards of the module's DTensors (a stream of weights= is published by one writer)")
        if sharded is None:
            # a function is not called before the first publish: it may not be ready yet (say sharded=True)
            sharded = source is not None and (
                not callable(source) and is_sharded(source)
                or isinstance(source, torch.nn.Module) and is_sharded(source.state_dict()))
        # rank 0 signs what it commits: its signer (the key bound to the stream) is set once the stream is found
        self._sharded = (ShardedWriter(source, opts, self.store, writer_id=self.writer_id, signing_key=None,
                                       spool=lambda: self._spool, group=ShardGroup()) if sharded else None)
        self._holds_lease = self._sharded is None or self._sharded.rank == 0  # one lease per stream: rank 0's
        self.signer: StreamSigner | None = None  # the key bound to this stream (rank 0 of a signing publisher)
        # the committer announces each step to its sinks (publish/sinks.py): followers that listen (events), the
        # RDMA ring (rdma); made before the lease: a port in use fails here; on a sharded trainer every rank fails
        # with rank 0, below
        self._events: EventSink | None = None
        self._rdma: CommitSink | None = None
        self._commits = CommitAnnouncement()
        start_error: DeltaSyncError | None = None
        try:
            if opts.events is not None and self._holds_lease:
                self._events = EventSink(opts.events)
                self._commits.sinks.append(self._events)
            if opts.rdma is not None and self._holds_lease:
                self._rdma = rdma_sink(opts.rdma)
                self._commits.sinks.append(self._rdma)
        except BaseException as e:  # ConfigError, MissingDependencyError: on a sharded trainer, every rank fails
            if self._sharded is None or not isinstance(e, DeltaSyncError):
                self._commits.close()  # a sink made before stops again (the feed's port, the ring's memory)
                raise
            start_error = e
        try:
            self._start(start_error)
        except BaseException:
            self._commits.close()
            raise

    def _start(self, start_error: DeltaSyncError | None) -> None:
        """Take the stream's lease (rank 0), agree on where the stream stands, start the background thread."""
        opts = self.options
        self.last_committed_step: int | None = None
        if self._holds_lease and start_error is None:
            held = False
            try:
                info = self.store.stream_info()  # a stream told apart before its lease is taken
                if opts.stream_id is not None and info is not None and info.stream_id != opts.stream_id:
                    raise ConfigError(f"{self.store.url}: stream.json names stream {info.stream_id!r}, this publisher "
                                      f"was told to write stream {opts.stream_id!r}: another stream lives at this URL")
                if self.signing_key is not None and opts.stream_id is None and info is None and self.store.steps():
                    # a new random id would orphan every step signed before: whoever deleted stream.json wins nothing
                    raise ConfigError(f"{self.store.url}: the stream has steps but no stream.json, and this signing "
                                      "publisher was given no stream_id: give it the id its steps were signed for "
                                      "(stream_id=..., the id followers pin)")
                self.store.acquire_lease(self.writer_id, ttl_s=opts.lease_s, take_over=opts.take_over,
                                         stream_id=opts.stream_id)
                held = True
                # leftovers of a writer that died; a young folder may belong to a writer still finishing its upload
                self.store.remove_uncommitted(older_than_s=opts.lease_s)
                # resume after the newest committed manifest, never after the latest.json hint (it may be stale);
                # a signing publisher after the newest its own key signed (a forged manifest does not exist for it)
                if self.signing_key is not None:
                    self.signer, self.last_committed_step = writer_signer(self.store, self.signing_key,
                                                                          stream_id=opts.stream_id)
                    if self.last_committed_step is not None:
                        self.store.resume_head(self.last_committed_step, self.signer)
                else:
                    committed = self.store.steps()
                    self.last_committed_step = committed[-1] if committed else None
            except DeltaSyncError as e:
                if held:  # a publisher that cannot start leaves the stream to the next one
                    try:
                        self.store.release_lease(self.writer_id)
                    except DeltaSyncError as released:
                        log.warning("could not release the writer lease: %s", released)
                if self._sharded is None:
                    raise
                start_error, self.last_committed_step = e, None
        if self._sharded is not None:  # every rank starts where rank 0 found the stream, or fails with it
            self._sharded.signing_key = self.signer  # rank 0 commits, and signs what it commits
            mine = self.last_committed_step if self._holds_lease else None
            start_error, self.last_committed_step = self._sharded.group.broadcast((start_error, mine))
            if start_error is not None:
                self._sharded.group.destroy()
                raise start_error
        self._last_captured = self.last_committed_step
        if self.last_committed_step is not None:
            log.info("%s: resuming after committed step %d", self.store.url, self.last_committed_step)
            if self._events is not None:  # the feed's newest step for followers that connect (nothing to offer)
                self._events.server.announce(self.last_committed_step)
        self._thread = threading.Thread(target=self._run, name="deltasync-publisher", daemon=True)
        if self._holds_lease:  # other ranks of a sharded model hold no lease: nothing to renew
            self._thread.start()

    # --- trainer thread ---

    def publish(self, step: int, *, anchor: bool = False, weights: Weights | None = None) -> bool:
        """Capture the weights as ``step``: the source's, or the tensors of ``weights``.

        Args:
            step: the step's number, larger than every step published before (not necessarily consecutive).
            anchor: publish a full checkpoint (an anchor) at this step, whatever ``anchor_every`` says.
            weights: the step's tensors as ``(name, tensor)`` pairs (a generator, a vLLM ``WeightSource``, a
                dict's ``items()``; a mapping is read as its items) instead of the publisher's ``source``: each
                tensor is cast, checked and diffed as it arrives and released before the next one is asked for,
                so publishing holds one tensor beyond the snapshot instead of a second copy of the model. Names
                follow the source's rules (wrapper prefixes removed, ``names`` applied; a tensor arriving in the
                memory of an earlier one, with its bits, is published as its alias), and every step must yield
                the same names, shapes and dtypes. A stream's step is never coalesced (its tensors cannot be read
                again later): while the upload queue is full, or an anchor is still being written from the
                snapshot, ``publish`` waits.

        Returns:
            True when the step was captured (it is committed in the background: ``flush()`` waits for that); False
            when it was coalesced into the next step (``on_backlog="coalesce"`` with a full upload queue; never
            with ``weights``).

        Raises:
            PublishError: an earlier step failed in the background (that step is then covered by an anchor at this
                call), or the publisher is closed.
            StepOrderError: ``step`` does not increase.
            TensorMismatchError: the tensors differ from the step before's (a name missing, new or twice, a shape
                or dtype), or a stream entry is not a ``(str, Tensor)`` pair: nothing of the step is published, and
                the snapshot keeps the last published bits (the next step diffs against them).
            ConfigError: ``weights`` on a sharded publisher, a ``DTensor`` in the stream, ``weights`` that is not
                iterable, or no ``weights`` on a publisher made with ``source=None``.
            NonFiniteStepError: ``refuse_nonfinite`` (on by default) refused the step: floating tensors that held
                only finite values in the step published before hold NaN or ±Inf (``.tensors`` names them all; in
                a publisher's first step, tensors holding NaN). Nothing of the step is published, the snapshot
                keeps the last published bits, and the next ``publish`` with good weights (this step number again,
                or a later one) is its delta from them. A sharded step is refused on every rank. A coalesced step
                is not read: the step that carries its change is checked (at the latest, by ``flush``).

        When ``weights`` itself raises, its exception propagates unchanged (with a note saying the step was not
        published). Any other error reads the rest of ``weights`` before it is raised: the other ranks of an FSDP
        trainer materialise each tensor with a collective and would otherwise wait for this one.

        Example::

            pub = DeltaPublisher(url, None, dtype=torch.bfloat16)
            pub.publish(step, weights=((n, p.full_tensor()) for n, p in model.named_parameters()))
        """
        if weights is not None:
            return self._publish_stream(step, anchor=anchor, weights=weights)
        if self._closed:  # a step published after close() would be lost without a word
            raise PublishError(f"{self.store.url}: step {step}: the publisher is closed (make a new one)")
        if self._sharded is not None:
            return self._publish_sharded(step, anchor=anchor)
        if self.source is None:
            raise ConfigError(f"{self.store.url}: step {step}: this publisher was made with source=None: pass the "
                              f"step's tensors as publish(step, weights=...)")
        self._raise_background_error()
        self._check_order(step)
        if self.options.on_backlog == "coalesce" and self._queue.full() and not anchor:
            self._skipped.append(step)
            log.debug("step %d coalesced (upload backlog)", step)
            return False
        self._capture(step, anchor=anchor)
        return True

    def _publish_stream(self, step: int, *, anchor: bool, weights: Weights) -> bool:
        """``publish(step, weights=...)``: the step read from a stream, each tensor diffed as it arrives."""
        where = f"{self.store.url}: step {step}"
        try:
            if self._closed:
                raise PublishError(f"{where}: the publisher is closed (make a new one)")
            if self._sharded is not None:
                raise ConfigError(f"{where}: a sharded publisher reads each rank's shards from its source (the "
                                  f"module): call publish(step) on every rank; weights= is for one writer of full "
                                  f"tensors")
            self._raise_background_error()
            self._check_order(step)
            self._wait_for_snapshot()
        except Exception:
            drain(weights, where)
            raise
        t0 = time.perf_counter()
        opts = self.options
        cap = StreamCapture(self._snapshot, self._aliases, where=where, names=opts.names,
                            device=opts.snapshot_device, max_chunk_bytes=opts.max_chunk_bytes, dtype=opts.dtype,
                            refuse_nonfinite=opts.refuse_nonfinite, url=self.store.url, step=step,
                            last_step=self._last_captured)
        try:
            cap.run(weights)
        except BaseException as e:
            self._snapshot = cap.snapshot  # the last published bits again, or None: the next step anchors
            if self._snapshot is None:
                with self._lock:
                    self._force_anchor = True
            log.warning("%s was not published (%s after %d tensors of the stream); the snapshot holds step %s",
                        where, type(e).__name__, cap.count,
                        self._last_captured if self._snapshot is not None else None)
            if cap.stream_raised and hasattr(e, "add_note"):
                e.add_note(f"deltasync: {where} was not published (the weights stream raised after {cap.count} "
                           f"tensors); the next publish diffs against the last published step")
            raise
        self._snapshot, self._aliases = cap.snapshot, cap.aliases
        self._enqueue(step, anchor=anchor, changes=cap.changes, diffed=not cap.built, pin=True, t0=t0)
        return True

    def _wait_for_snapshot(self) -> None:
        """Wait until an anchor being written from the snapshot itself (a stream's) is out of it."""
        pinned = self._pinned
        if pinned is not None:
            if not pinned.is_set():
                log.debug("waiting for the anchor being written from the snapshot")
            pinned.wait()
            self._pinned = None

    def _check_order(self, step: int) -> None:
        check_step(step, what=f"{self.store.url}: step", error=StepOrderError)
        if self._last_captured is not None and step <= self._last_captured:
            raise StepOrderError(f"{self.store.url}: step {step} is not after the last published step "
                                 f"{self._last_captured}")
        if self._skipped and step <= self._skipped[-1]:
            raise StepOrderError(f"{self.store.url}: step {step} is not after the last coalesced step "
                                 f"{self._skipped[-1]}")

    def _publish_sharded(self, step: int, *, anchor: bool) -> bool:
        """Every rank's part of ``step``, committed by rank 0 (publish/sharded.py); always published."""
        assert self._sharded is not None
        precheck: BaseException | None = None
        try:
            self._raise_background_error()  # rank 0's lease renewals
            self._check_order(step)
        except DeltaSyncError as e:
            precheck = e
        due = anchor or self._force_anchor or self._since_anchor + 1 >= self.options.anchor_every
        kind: Kind = "anchor" if due else "delta"
        t0 = time.perf_counter()
        try:
            nbytes = self._sharded.publish(step, kind=kind, base_step=None if kind == "anchor" else self._last_captured,
                                           precheck=precheck, last_step=self._last_captured)
        except NonFiniteStepError:  # refused on every rank, every snapshot as it was: the next step goes on from them
            raise
        except BaseException:
            self._force_anchor = True  # every rank failed the step: every rank anchors next
            raise
        self._force_anchor = False
        self._since_anchor = 0 if kind == "anchor" else self._since_anchor + 1
        self._last_captured = self.last_committed_step = step
        self._commits.committed(step, None)  # the ranks wrote the parts: no single object to hand over
        log.info("committed sharded %s step %d (%d bytes, %.3f s)", kind, step, nbytes, time.perf_counter() - t0)
        return True

    def differs_from(self, step: int, weights: Weights | None = None) -> list[str]:
        """The tensors whose bits, in the published dtype and under canonical names, differ from committed
        ``step``'s (checksums against its header; a tensor missing on either side counts): empty when the source's
        weights (or ``weights``', read to their end) are that step's exactly.

        What a resumed trainer asks when its checkpoint's step is one the stream holds already: a committed step is
        never replaced, so it publishes nothing and goes on, provided its weights are that step's.

        Raises:
            ConfigError: a sharded publisher (its shards cannot be proved from one rank: publish the next step), or
                bad ``weights`` entries.
            StepNotFoundError: ``step`` is not committed.
        """
        where = f"{self.store.url}: step {step}"
        if weights is None and self._sharded is not None:
            raise ConfigError(f"{where}: a sharded publisher cannot prove a committed step from one rank: publish the "
                              "next step instead")
        if weights is None:
            tensors, tied = named_tensors(self.source, self.options.names)
            pairs: Any = iter([*tensors.items(), *((alias, tensors[name]) for alias, name in tied.items())])
        else:
            pairs = stream_entries(weights, where)
        from deltasync.follow.reader import StreamReader  # (the reader sits above the publisher)
        from deltasync.format.checksum import tensor_checksum

        try:
            with StreamReader(self.store, trusted_keys=self.trust) as reader, reader.open(step) as obj:
                headers = dict(obj.header.tensors)
                aliases = dict(obj.header.aliases)
            differ: list[str] = []
            seen: set[str] = set()
            for index, entry in enumerate(pairs):
                name, t = checked_entry(entry, index, where) if weights is not None else entry
                name = canonical_name(name, self.options.names) if weights is not None else name
                seen.add(name)
                t = t.to(published_dtype(t, self.options.dtype))
                # the step's tensor of that name (an alias: the tensor it was published as, whose bits the trainer's
                # copy must have); a checksum sums elements, so the shape and dtype are compared too
                h = headers.get(aliases.get(name, name))
                if (h is None or tuple(t.shape) != tuple(h.shape) or t.dtype != h.torch_dtype
                        or int(h.checksum, 16) != tensor_checksum(t.detach())):
                    differ.append(name)
        except BaseException:
            if weights is not None:
                drain(pairs, where)
            raise
        return differ + sorted((headers.keys() | aliases.keys()) - seen)

    def flush(self, timeout_s: float | None = None) -> None:
        """Capture a trailing coalesced step, then wait until everything captured is committed.

        Raises:
            NonFiniteStepError: the trailing coalesced step is refused (``refuse_nonfinite``): it is not published,
                and is not tried again.
            PublishError: a step failed in the background.
            TimeoutError: ``timeout_s`` passed first.
        """
        if self._skipped:
            try:
                self._capture(self._skipped[-1], anchor=False)
            except NonFiniteStepError:
                self._skipped = []  # refused, not coalesced: a second flush (close()) does not refuse it again
                raise
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.store.url}: publishing did not finish within {timeout_s}s")
            time.sleep(0.005)
        self._raise_background_error()

    def close(self) -> None:
        """Flush, stop the background thread, release the stream, remove the spool folder (also on error)."""
        self._closed = True
        try:
            self.flush()
        finally:
            try:
                if self._thread.is_alive():
                    self._queue.put(None)
                    self._thread.join()
                try:
                    if self._holds_lease:
                        if self.signer is not None:  # the newest step, closed: no freshness expected after it
                            self.store.check_lease(self.writer_id)
                            self.store.refresh_head(self.signer, closed=True)
                        self.store.release_lease(self.writer_id)
                except DeltaSyncError as e:
                    log.warning("could not close the stream's head and release the writer lease: %s", e)
                if self._sharded is not None:
                    self._sharded.group.destroy()
            finally:
                try:
                    self._spool_folder.remove()  # also after a failed step: nothing stays in the temp folder
                finally:
                    self._commits.close()  # the RDMA ring last: consumers may still be reading the newest steps

    @property
    def stream_id(self) -> str | None:
        """The id of the stream this publisher writes (what followers pin beside the trusted keys, docs/FORMAT.md
        section 5e); None on the ranks of a sharded trainer other than rank 0."""
        if self.signer is not None:
            return self.signer.stream_id
        return self.store.stream_id() if self._holds_lease else None

    @property
    def trust(self) -> TrustedKeys | None:
        """What this signing publisher trusts of its own stream (its key, and the key that endorsed it for the
        steps before), pinned to it; None without a signing key."""
        return None if self.signer is None else own_trust(self.signer.key, self.signer.stream_id)

    @property
    def events_url(self) -> str | None:
        """The event feed's URL (``http://HOST:PORT/events``) with the ``events`` option (on rank 0), else None:
        give it to followers and engines as ``notify``."""
        return self._events.url if self._events is not None else None

    @property
    def rdma(self) -> Any:
        """The RDMA offer (``rdma`` option, on rank 0: a ``deltasync.rdma.trainer.RdmaTrainer``), else None. Its
        ``stats`` say which steps were announced over NIXL and which went by the store only, and why."""
        return self._rdma

    @property
    def _spool(self) -> Path:
        return self._spool_folder.path

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _capture(self, step: int, *, anchor: bool) -> None:
        """The source's tensors as ``step``: diffed against the snapshot (or copied into a new one), then queued;
        ``NonFiniteStepError`` (nothing queued, the snapshot as it was) for a step ``refuse_nonfinite`` refuses."""
        self._wait_for_snapshot()  # a stream's anchor may still be written from it
        t0 = time.perf_counter()
        opts = self.options
        tensors, aliases = named_tensors(self.source, opts.names)
        diffed = self._snapshot is not None  # against the bits of this publisher's last captured step
        if self._snapshot is None:
            snapshot = Snapshot(tensors, device=opts.snapshot_device, max_chunk_bytes=opts.max_chunk_bytes,
                                dtype=opts.dtype, track_finite=opts.refuse_nonfinite)
            refused = refused_tensors(snapshot, None) if opts.refuse_nonfinite else []
            if refused:  # the snapshot is dropped with the step: the next capture builds it again
                raise refusal(self.store.url, step, refused, last_step=None)
            self._snapshot = snapshot
            changes: list[Patch] = []
        else:
            checksums, nonfinite = dict(self._snapshot.checksums), set(self._snapshot.nonfinite)
            changes = self._snapshot.diff(tensors)
            refused = refused_tensors(self._snapshot, nonfinite) if opts.refuse_nonfinite else []
            if refused:
                self._snapshot.undo(changes, checksums, nonfinite)  # the last published bits again
                raise refusal(self.store.url, step, refused,
                              last_step=self._last_captured)
        self._aliases = aliases
        self._enqueue(step, anchor=anchor, changes=changes, diffed=diffed, pin=False, t0=t0)

    def _enqueue(self, step: int, *, anchor: bool, changes: list[Patch], diffed: bool, pin: bool, t0: float) -> None:
        """Queue a captured step for the background thread, as an anchor or a delta by the publisher's schedule.

        An anchor's tensors are copied to the host (the trainer goes on changing the snapshot), or with ``pin`` (a
        stream's: no second copy of the model) written from the snapshot itself, which the next capture then
        waits for."""
        assert self._snapshot is not None
        coalesced = tuple(s for s in self._skipped if s < step)
        self._skipped = []
        with self._lock:
            due = anchor or self._force_anchor or self._since_anchor + 1 >= self.options.anchor_every
            kind: Kind = "anchor" if due else "delta"
            self._force_anchor = False
        headers = snapshot_headers(self._snapshot)
        job = _Job(
            step=step,
            base_step=None if kind == "anchor" else self._last_captured,
            kind=kind,
            coalesced=coalesced,
            headers=headers,
            aliases=dict(self._aliases),
        )
        if kind == "anchor":
            if pin:
                job.anchor_tensors = dict(self._snapshot.tensors)
                job.released = self._pinned = threading.Event()
            else:
                job.anchor_tensors = {n: t.to("cpu", copy=True) for n, t in self._snapshot.tensors.items()}
            self._since_anchor = 0
            # the diff ran against what this publisher captured last: ship it beside the anchor (a resumed or
            # new publisher's first anchor has nothing to diff against: the stream's last step is another's bits)
            if diffed and self._last_captured is not None and self.options.anchor_deltas:
                job.changes, job.delta_base = [c for c in changes if c.changed], self._last_captured
        else:
            job.changes = [c for c in changes if c.changed]
            self._since_anchor += 1
        job.capture_s = time.perf_counter() - t0
        self._last_captured = step
        self._queue.put(job)  # blocks only with on_backlog="block", or for anchors and the flush tail

    def _raise_background_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise PublishError(f"{self.store.url}: publishing failed in the background: {err}") from err

    # --- background thread ---

    def _run(self) -> None:
        failed_since: int | None = None
        while True:
            try:
                job = self._queue.get(timeout=self.options.lease_s / 3)
            except queue.Empty:
                self._renew_lease()
                continue
            try:
                if job is None:
                    return
                if failed_since is not None and job.kind == "delta":
                    # its base was never committed: the next capture is forced to be an anchor
                    log.warning("dropping step %d: its base step %s was not committed", job.step, job.base_step)
                    continue
                if failed_since is not None:
                    job.delta_base = None  # nobody can hold the step its delta would start from
                failed_since = None
                self._write(job)
            except BaseException as e:
                log.exception("publishing step %s failed", job.step if job else None)
                failed_since = job.step if job else None
                with self._lock:
                    self._error = e
                    self._force_anchor = True
            finally:
                if job is not None:  # written, failed or dropped: nothing of it is needed until the next job comes
                    job.anchor_tensors, job.changes = {}, []
                    if job.released is not None:  # out of the snapshot
                        job.released.set()
                self._queue.task_done()

    def _renew_lease(self) -> None:
        try:
            self.store.renew_lease(self.writer_id, ttl_s=self.options.lease_s)
            if self.signer is not None:  # the head stays fresh while the publisher runs (docs/FORMAT.md 5e)
                self.store.refresh_head(self.signer)
        except DeltaSyncError as e:
            log.error("%s", e)
            with self._lock:
                self._error = e

    def _write(self, job: _Job) -> None:
        """Encode and write the object (encode_s), hash it (write_s), commit it (upload_s)."""
        t0 = time.perf_counter()
        name = f"{job.kind}.safetensors"
        local = self._spool / f"{job.step:012d}-{name}"
        header, written = write_step_object(
            local,
            kind=job.kind,
            step=job.step,
            base_step=job.base_step,
            headers=job.headers,
            changes=job.changes,
            anchor_tensors=job.anchor_tensors,
            aliases=job.aliases,
            zstd_level=self.options.zstd_level,
        )
        if job.released is not None:  # the anchor is on disk: the trainer may change the snapshot again
            job.anchor_tensors = {}
            job.released.set()
        delta, delta_local = None, None
        if job.kind == "anchor" and job.delta_base is not None:  # the anchor's own delta (docs/FORMAT.md section 5)
            delta_local = self._spool / f"{job.step:012d}-anchor-delta.safetensors"
            _, dwritten = write_step_object(delta_local, kind="delta", step=job.step, base_step=job.delta_base,
                                            headers=job.headers, changes=job.changes, aliases=job.aliases,
                                            zstd_level=self.options.zstd_level)
            delta = anchor_delta(dwritten, job.delta_base)
        t1 = time.perf_counter()
        headers = header.tensors
        manifest = step_manifest(written, header, coalesced=job.coalesced, capture_s=job.capture_s, encode_s=t1 - t0,
                                 delta=delta)
        size = manifest.object_bytes
        t2 = time.perf_counter()
        wanted: bytes | None = None
        try:
            # the bytes a sink takes (the RDMA ring), read before the commit: a local store takes the file over
            if size <= self._commits.object_bytes:
                wanted = local.read_bytes()
            if self._model_files is not None:  # once, before the first commit: a reader of any step finds them
                self.store.check_lease(self.writer_id)
                _, files_sha256 = store_model_files(self.store, self._model_files)
                if self.signer is not None:  # the files.json it wrote (or found identical): what its steps name
                    self.signer.files_sha256 = files_sha256
                self._model_files = None
            if delta is not None and delta_local is not None:  # uploaded before the manifest, like the anchor itself
                self.store.put_part(job.step, delta.part, delta_local)
            # never commit after losing the stream: the lease is proven right before the manifest is written
            self.store.commit(manifest, local, owner=self.writer_id, signer=self.signer)
        finally:
            local.unlink(missing_ok=True)
            if delta_local is not None:
                delta_local.unlink(missing_ok=True)
        t3 = time.perf_counter()
        self.last_committed_step = job.step
        self._commits.committed(job.step, manifest, wanted)
        del wanted
        full_bytes = sum(h.numel * h.torch_dtype.itemsize for h in headers.values())
        self.metrics.append(
            StepMetrics(
                step=job.step,
                base_step=job.base_step,
                kind=job.kind,
                coalesced_steps=job.coalesced,
                numel=header.numel,
                changed=header.changed,
                object_bytes=size,
                full_bytes=full_bytes,
                capture_s=job.capture_s,
                encode_s=t1 - t0,
                write_s=t2 - t1,
                upload_s=t3 - t2,
            )
        )
        log.info("committed %s step %d (%d bytes, %d changed)", job.kind, job.step, size, header.changed)

