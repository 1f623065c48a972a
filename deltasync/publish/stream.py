"""Publishing from a stream: a step's weights as ``(name, tensor)`` pairs, each diffed as it arrives.

Frameworks hand weights over one tensor at a time (verl's per-tensor generator, vLLM's ``WeightSource``, TRL's
``send_weights`` iterator), materialising each one (an FSDP ``full_tensor()``) just before it is yielded.
Collecting them into a dict first would hold a second full model on the publishing rank; here each tensor is
named, cast, checked and diffed into the snapshot on arrival, and no reference to it is left once the next one
is asked for: the extra memory is one tensor, plus the step's patches (which the upload needs anyway).

A step that fails part-way (a name twice, a shape or dtype that changed, a name missing or new, a value that is
not a tensor, the stream itself raising), or that ``refuse_nonfinite`` refuses once the stream has ended (every
tensor that turned NaN or ±Inf named: publish/finite.py), leaves the snapshot at the last published bits: the
patches already diffed in are XORed back (they are what changed, kept for the upload anyway: undoing costs no
copy), and a snapshot being built by a first step is dropped.

Aliases (tied weights, published once under their first name): in a first step, a tensor is an alias of an
earlier one when it arrives in the same memory (the same storage, still alive, at the same offset, shape,
stride and dtype) with the bits that one was captured with; a buffer the stream reuses for the next tensor
holds other bits, so it is not mistaken for a tie. Later steps keep the first step's aliases: an alias must
arrive after its tensor, with its bits (in any memory: a materialising stream copies a tied weight twice).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Iterable, Iterator, Mapping, Set
from typing import Any

import torch

from deltasync.errors import ConfigError, TensorMismatchError
from deltasync.format.patch import Patch
from deltasync.publish.finite import refusal, refused_tensors
from deltasync.publish.names import NameMap, canonical_name
from deltasync.publish.sharded import is_sharded
from deltasync.stages.diff import Snapshot, SnapshotDevice

log = logging.getLogger(__name__)

__all__ = ["StreamCapture", "Weights", "drain"]

# what ``publish(step, weights=...)`` takes: (name, tensor) pairs, or a mapping (its items are used)
Weights = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


class StreamCapture:
    """One stream step's capture against ``snapshot`` (None: the first step builds it); ``run`` it once.

    After ``run``: ``snapshot`` (built or advanced), ``changes`` (every tensor's patch, empty ones included;
    none when the snapshot was built), ``aliases`` (name -> the name it is published under). After a failure,
    ``snapshot`` holds the last published bits again, or is None (a first step, or bits that could not be put
    back: the next step then anchors).
    """

    def __init__(self, snapshot: Snapshot | None, aliases: Mapping[str, str], *, where: str,
                 names: NameMap | None, device: SnapshotDevice, max_chunk_bytes: int,
                 dtype: torch.dtype | None, refuse_nonfinite: bool = False, url: str = "", step: int = 0,
                 last_step: int | None = None) -> None:
        self.where = where
        self.names = names
        self.built = snapshot is None
        self.refuse_nonfinite = refuse_nonfinite
        self.url, self.step, self.last_step = url, step, last_step  # (for the refusal)
        self.snapshot: Snapshot | None = snapshot if snapshot is not None else Snapshot(
            {}, device=device, max_chunk_bytes=max_chunk_bytes, dtype=dtype, track_finite=refuse_nonfinite)
        self._expected_aliases = {} if self.built else dict(aliases)
        self.aliases: dict[str, str] = {}
        self.changes: list[Patch] = []
        self.count = 0  # entries read
        self.stream_raised = False  # the failure came from reading ``weights`` itself

    def run(self, weights: Weights) -> None:
        """Read ``weights`` to its end, diffing (or copying) each tensor as it arrives; see the class."""
        snap = self.snapshot
        assert snap is not None
        before, nonfinite = dict(snap.checksums), set(snap.nonfinite)
        it: Iterator[Any] | None = None
        arrived: dict[str, str] = {}  # canonical name -> the name it arrived as
        memory: dict[tuple[Any, ...], tuple[weakref.ref[torch.UntypedStorage], str]] = {}
        try:
            it = stream_entries(weights, self.where)
            while True:
                try:
                    entry = next(it)
                except StopIteration:
                    break
                except BaseException:
                    self.stream_raised = True
                    raise
                self.count += 1
                name, t = checked_entry(entry, self.count, self.where)
                del entry
                canon = canonical_name(name, self.names)
                if canon in arrived:
                    raise TensorMismatchError(
                        f"{self.where}: tensor {canon!r} arrived twice (as {arrived[canon]!r}, then as {name!r} in "
                        f"entry {self.count}): expected each name once per step")
                arrived[canon] = name
                if self.built:
                    self._add(snap, canon, t, memory)
                else:
                    self._diff(snap, canon, t, arrived)
                del t  # before the next tensor is asked for: the stream may free or reuse its memory
            self._check_complete(snap, arrived)
            if self.refuse_nonfinite:
                refused = refused_tensors(snap, None if self.built else nonfinite)
                if refused:
                    raise refusal(self.url, self.step, refused, last_step=None if self.built else self.last_step)
        except BaseException as e:
            self._fail(snap, before, nonfinite)
            if not self.stream_raised and isinstance(e, Exception):
                drain(weights if it is None else it, self.where)
            raise

    def _add(self, snap: Snapshot, name: str, t: torch.Tensor,
             memory: dict[tuple[Any, ...], tuple[weakref.ref[torch.UntypedStorage], str]]) -> None:
        """First step: copy ``t`` into the new snapshot, or record it as an alias of the tensor whose memory it is."""
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        seen = memory.get(key) if t.numel() else None
        # the storage must be the same object, alive: an address alone may be a freed tensor's, reused
        if seen is not None and seen[0]() is storage and snap.holds(seen[1], t):
            self.aliases[name] = seen[1]
            return
        snap.add(name, t)
        if t.numel():
            memory[key] = (weakref.ref(storage), name)

    def _diff(self, snap: Snapshot, name: str, t: torch.Tensor, arrived: Mapping[str, str]) -> None:
        """A later step: diff ``t`` into the snapshot, or check that an alias still has its tensor's bits."""
        target = self._expected_aliases.get(name)
        if target is not None:
            if target not in arrived:
                raise TensorMismatchError(
                    f"{self.where}: tensor {name!r} is published as an alias of {target!r} (they shared memory in the "
                    f"first step) and must arrive after it; it arrived first")
            if not snap.holds(target, t):
                raise TensorMismatchError(
                    f"{self.where}: tensor {name!r} is published as an alias of {target!r} (they shared memory in the "
                    f"first step) but now differs from it (shape {tuple(t.shape)} {t.dtype}); a stream whose tied "
                    f"tensors come apart needs a new publisher")
            self.aliases[name] = target
            return
        if name not in snap.tensors:
            before = len(snap.tensors) + len(self._expected_aliases)
            raise TensorMismatchError(
                f"{self.where}: tensor {name!r} is new: the step before had {before} tensors and not this one (a "
                f"stream must yield the same names every step)")
        try:
            snap.check_tensor(name, t)
        except TensorMismatchError as e:
            raise TensorMismatchError(f"{self.where}: {e}") from None
        self.changes.append(snap.diff_tensor(name, t))

    def _check_complete(self, snap: Snapshot, arrived: Mapping[str, str]) -> None:
        if not arrived:
            raise TensorMismatchError(
                f"{self.where}: the weights stream yielded no tensors (a generator can be read once: pass a fresh "
                f"one for every step)")
        if self.built:
            return
        missing = sorted((snap.tensors.keys() | self._expected_aliases.keys()) - arrived.keys())
        if missing:
            raise TensorMismatchError(
                f"{self.where}: the weights stream ended without {len(missing)} tensor(s) the step before had: "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''} (a stream must yield the same names every step)")

    def _fail(self, snap: Snapshot, before: Mapping[str, int], nonfinite: Set[str]) -> None:
        """Put the snapshot back at the last published bits (or drop it), after a failed step."""
        if self.built:
            self.snapshot = None
            return
        try:
            snap.undo(self.changes, before, nonfinite)
        except BaseException:
            log.exception("%s: the snapshot could not be put back after a failed stream; the next step anchors",
                          self.where)
            self.snapshot = None
        self.changes = []


def stream_entries(weights: Weights, where: str) -> Iterator[Any]:
    if isinstance(weights, Mapping):
        return iter(weights.items())
    if isinstance(weights, (str, bytes, torch.Tensor)):
        raise ConfigError(f"{where}: weights must be an iterable of (name, tensor) pairs or a mapping, got a "
                          f"{type(weights).__name__}")
    try:
        return iter(weights)
    except TypeError:
        raise ConfigError(f"{where}: weights must be an iterable of (name, tensor) pairs or a mapping, got a "
                          f"{type(weights).__name__}") from None


def checked_entry(entry: Any, index: int, where: str) -> tuple[str, torch.Tensor]:
    """A stream entry checked: a (name, tensor) pair with a non-empty name and a plain tensor holding data."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise TensorMismatchError(f"{where}: weights entry {index} is a {type(entry).__name__}: expected a "
                                  f"(name, tensor) pair")
    name, t = entry
    if not isinstance(name, str) or not name:
        raise TensorMismatchError(f"{where}: weights entry {index} is named {name!r}: expected a non-empty str")
    if not isinstance(t, torch.Tensor):
        raise TensorMismatchError(f"{where}: weights entry {index} ({name!r}) is a {type(t).__name__}: expected a "
                                  f"torch.Tensor")
    if is_sharded({name: t}):
        raise ConfigError(
            f"{where}: weights entry {index} ({name!r}) is a DTensor: a stream is published by one writer from full "
            f"tensors (materialise them, e.g. full_tensor()); to publish a sharded model without a gather, give the "
            f"module as the publisher's source on every rank and call publish(step)")
    if t.layout != torch.strided or t.device.type == "meta":
        raise TensorMismatchError(f"{where}: weights entry {index} ({name!r}) is a {t.layout} tensor on "
                                  f"{t.device}: expected a dense tensor holding data")
    return name, t.detach()


def drain(weights: Iterator[Any] | Weights, where: str) -> None:
    """Read the rest of a stream without using it: the ranks of an FSDP trainer materialise each tensor with a
    collective (``full_tensor()``), so a publisher that stopped reading would leave the other ranks waiting. A
    collection (a dict, a list) has nothing to wait for and is left alone."""
    if isinstance(weights, Collection):
        return
    try:
        it = weights if isinstance(weights, Iterator) else iter(weights)
    except TypeError:  # not iterable: nothing to read
        return
    try:
        for _ in it:
            pass
    except Exception as e:  # noqa: BLE001 - the error being raised is the one the caller must see
        log.warning("%s: reading the rest of the weights stream failed too: %s", where, e)
