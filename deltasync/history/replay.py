"""Replay stage: rebuild tensors through a chain of objects (an anchor, then deltas), one tensor at a time.

Each tensor is read from the anchor into fresh memory, then patched by each delta in turn; its checksum is
computed from the resulting bits and compared with the last step's header (``verify`` instead follows it
through every link, to name the step that broke a tensor). What a replay proves: every object's size and
digest against its manifest (BLAKE3; SHA-256 in older streams), each header's state checksum against its
manifest and its own tensor checksums (``open_checked``), and each tensor's final bits against the last
step's checksum, computed in one full pass over them; the intermediate steps' checksums are not computed (no
step in between is returned). A few tensors are rebuilt at once on worker threads, in order, so that memory
stays near one tensor per worker (one model copy when the caller keeps them all); nothing is memory-mapped,
so nothing counts twice.

A tensor larger than a core's share of the cache is patched a block at a time: several deltas' patches
of it are decoded first (at most ``GROUP_BYTES`` of them), then each block of the tensor receives all of
them while it sits in the cache, instead of every delta streaming the whole tensor through memory once
(XOR patches commute: the order does not change the bits). Used by ``history`` (replay, compare, push)
and ``maintenance`` (verify).

Where a caller keeps every tensor (``reconstruct_state_dict``), a local anchor is read once: a thread reads
its tensors into their final buffers and hashes the same bytes (``_anchor.AnchorFeed``), while the workers
already decode the deltas and patch the tensors that have landed; nothing is handed out before the anchor's
digest matched its manifest.

Why one full checksum pass, at the end. The checksum is a sum over (index, bits) pairs (docs/FORMAT.md
section 4), so it could instead be carried along: the anchor's checksum computed from its bits as they are
read, plus each delta's change hashed from the old and new bits of the elements it changes (what
``check="each"`` does). That is no cheaper and proves less. No cheaper: the anchor's checksum is a full pass
over the same number of elements as the final one, and the changes then add two hashes per changed element
(about 2 x 40M for 20 deltas of a 134M model: more than half a pass again). Proves less: a carried sum equals
the checksum of the bits in memory only if the scatter hashed exactly the bits it left at exactly the
positions it wrote, and nothing else wrote the buffer; a bug or a stray write elsewhere in the tensor would
keep the sum right and the bits wrong. The final pass hashes the bits as they are returned, so a match with
the last header's checksum (bound to the manifest through the state checksum, ``open_checked``) is the
proof of the result whatever happened on the way (a collision aside: the checksum detects accidents, not
adversaries). The digest of every object proves the bytes read; the anchor's own checksums are then not
needed, because the final state is checked directly."""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

import numba
import numpy as np
import torch

from deltasync.errors import (
    ChecksumMismatchError,
    DeltaSyncError,
    FormatError,
    StepNotFoundError,
    TensorMismatchError,
)
from deltasync.follow.reader import StreamReader, open_reader
from deltasync.format import _kernels
from deltasync.format.checksum import (
    add,
    format_checksum,
    parse_checksum,
    state_checksum,
    tensor_checksum,
)
from deltasync.format.objects import StepHeader, StepObject
from deltasync.format.patch import PackedPatch, Patch
from deltasync.history._anchor import AnchorFeed
from deltasync.stages.apply import host_arrays, host_bits, xor_either
from deltasync.store.location import Where

T = TypeVar("T")
R = TypeVar("R")

Check = Literal["result", "each"]
ProgressFn = Callable[[str, int, int], None]
"""``progress(what, done, total)``, called during long work (the CLI draws a progress bar)."""

_WORKERS = max(1, min(4, os.cpu_count() or 1))

BLOCK_BYTES = 2 << 20
"""Tensors of more bytes than this are patched block by block (about a core's share of a shared L3 cache)."""
GROUP_BYTES = 32 << 20
"""The most decoded patches of one tensor a worker holds before applying them (positions and XOR bits)."""


def reader_of(url: Where, storage_options: dict[str, Any] | None = None) -> StreamReader:
    """The reader a history function reads ``url`` with (deltasync.follow.reader.open_reader)."""
    return open_reader(url, storage_options)[0]


def require_steps(reader: StreamReader) -> list[int]:
    """The stream's committed steps, at least one: ``StreamNotFoundError`` where there is no stream at all,
    ``StepNotFoundError`` for a stream with no steps yet."""
    steps = reader.steps()
    if not steps:
        reader.store.require_stream()
        raise StepNotFoundError(f"{reader.store.url}: the stream has no committed steps yet")
    return steps


def chain_steps(reader: StreamReader, step: int) -> list[int]:
    """``reader.chain(step)`` through the steps' own objects (history reads what the trainer published, never a
    catch-up: docs/FORMAT.md section 5g), with clearer errors for a step that is not committed and a URL without a
    stream."""
    try:
        reader.manifest(step)  # a step that is not committed is named as such, with its neighbours
        return reader.chain(step, catchup=False)
    except StepNotFoundError:
        require_steps(reader)
        raise


class Chain:
    """The opened objects of one step's chain, anchor first; rebuilds its tensors one at a time."""

    def __init__(self, objects: list[StepObject], *, feed: AnchorFeed | None = None) -> None:
        self.objects = objects
        self.steps = [o.header.step for o in objects]
        self._feed = feed
        for obj in objects[1:]:
            check_layout(objects[0], obj)

    @classmethod
    def open(
        cls, reader: StreamReader, step: int, *, progress: ProgressFn | None = None, read_anchor_once: bool = False
    ) -> Chain:
        """Fetch and verify every object of ``step``'s chain (size, digest, header against manifest).

        ``read_anchor_once`` (for a caller that keeps every tensor: the whole anchor is read at once, into
        the tensors' final buffers): a local anchor is not hashed here but while a thread reads its tensors
        (``_anchor.AnchorFeed``), so that rebuilding starts at once and the anchor is read once, not twice;
        ``rebuild`` hands out nothing before its digest matched. Elsewhere (remote, several parts) as without.
        """
        steps = chain_steps(reader, step)
        feed = _feed(reader, steps[0]) if read_anchor_once else None
        objects: list[StepObject] = [feed.obj] if feed else []
        # downloads and digest checks on a few threads: the anchor's hash overlaps the deltas'
        with ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="deltasync-fetch") as pool:
            futures = [pool.submit(open_checked, reader, s) for s in steps[len(objects):]]
            try:
                for i, future in enumerate(futures):
                    objects.append(future.result())
                    if progress:
                        progress(f"fetch step {step}'s chain", i + 1 + bool(feed), len(steps))
                return cls(objects, feed=feed)
            except BaseException as e:
                for future in futures:
                    future.cancel()
                for future in futures:
                    if not future.cancelled() and future.exception() is None and future.result() not in objects:
                        future.result().close()
                try:
                    if feed and isinstance(e, DeltaSyncError):
                        feed.wait()  # a corrupt anchor is named as such, rather than what it may have caused
                finally:
                    if feed:
                        feed.close()
                    for o in objects:
                        o.close()
                raise

    @property
    def header(self) -> StepHeader:
        return self.objects[-1].header

    def close(self) -> None:
        if self._feed:
            self._feed.close()
        for o in self.objects:
            o.close()

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def order(self) -> list[str]:
        """The tensors, largest first: the workers finish together instead of one rebuilding the last
        large tensor (an embedding, a head) alone."""
        return sorted(self.header.tensors, key=lambda n: -self.header.tensors[n].numel)

    def rebuild(
        self, names: Iterable[str] | None = None, *, check: Check = "result", keep: int | None = None,
        progress: ProgressFn | None = None,
    ) -> Iterator[Rebuilt]:
        """Each tensor rebuilt through the whole chain (by default in ``order()``), a few at a time on worker
        threads, yielded in order.

        ``check="result"`` computes the checksum of each tensor as it is at the chain's last step (and at
        link ``keep``, whose state is returned as a copy): enough to prove the result, at one pass over
        the bits. ``"each"`` follows the checksum through every link (an anchor's in full, then each
        delta's change), so that ``failure`` names the step that broke a tensor. Errors are returned in
        ``Rebuilt.error``, not raised, so that a caller can report them per step.
        """
        names = self.order() if names is None else list(names)
        # kernels run single-threaded inside each worker: one numba thread pool shared by two busy threads
        # stalls whenever another process holds a core; the workers split the tensors between the cores
        pool = ThreadPoolExecutor(
            max_workers=_WORKERS, thread_name_prefix="deltasync-replay", initializer=numba.set_num_threads,
            initargs=(1,)
        )
        # a fed anchor is in memory whole anyway: its tensors are rebuilt with no bound while it is hashed
        depth = len(names) if self._feed else 2 * _WORKERS + 2
        try:
            for k, rebuilt in enumerate(_ahead(pool, lambda n: self._rebuild(n, check, keep), names,
                                               depth=depth)):
                if self._feed and k == 0:
                    self._feed.wait()  # nothing leaves before the anchor's digest matched, errors included
                yield rebuilt
                if progress:
                    progress(f"replay step {self.steps[-1]}", k + 1, len(names))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _rebuild(self, name: str, check: Check, keep: int | None) -> Rebuilt:
        out = Rebuilt(name=name, tensor=torch.empty(0))
        last = len(self.objects) - 1
        link = 0
        try:
            if check == "result" and keep is None:  # the common case: patched in groups, checksummed once
                nbytes, group, got = self.header.tensors[name].nbytes, [], None
                for link, obj in enumerate(self.objects):
                    if link and obj.header.tensors[name].changed:
                        group.append(obj.change(name))
                        if _group_full(nbytes, group):
                            # the first patches are decoded before the anchor's tensor is taken (it may be landing)
                            got = out.tensor = got if got is not None else self._anchor_tensor(name)
                            xor_patches(got, group)
                            group = []
                link = 0
                t = out.tensor = got if got is not None else self._anchor_tensor(name)
                xor_patches(t, group)
                out.checksums[last] = tensor_checksum(t)
                return out
            t = out.tensor = self._anchor_tensor(name)
            checksum = tensor_checksum(t) if check == "each" else 0
            for link, obj in enumerate(self.objects):
                if link and obj.header.tensors[name].changed:
                    # "result" checksums the final bits once, in full: no per-link checksum change
                    change = xor_either(t, obj.change(name), checksum=check == "each")
                    if check == "each":
                        checksum = add(checksum, change)
                if link == keep:
                    out.kept = t.clone()
                    if check == "result" and link != last:
                        out.checksums[link] = tensor_checksum(out.kept)
                if check == "each":
                    out.checksums[link] = checksum
            if check == "result":
                out.checksums[last] = tensor_checksum(t)
        except DeltaSyncError as e:
            out.error = (link, e)
        return out

    def _anchor_tensor(self, name: str) -> torch.Tensor:
        return self._feed.take(name) if self._feed else self.objects[0].read_tensor(name)

    def failure(self, rebuilt: Rebuilt) -> tuple[int, DeltaSyncError] | None:
        """Where rebuilding a tensor first went wrong: (link, error), a checksum mismatch or a decoding error."""
        for link, checksum in sorted(rebuilt.checksums.items()):
            h = self.objects[link].header
            expected = h.tensors[rebuilt.name].checksum
            if checksum != parse_checksum(expected):
                return link, ChecksumMismatchError(
                    f"{self.objects[link].where}: tensor {rebuilt.name!r} does not match the trainer's checksum after "
                    f"step {h.step}: expected {expected}, got {format_checksum(checksum)}"
                    + ("" if len(rebuilt.checksums) == len(self.objects)
                       else " (`deltasync verify` names the step that broke it)")
                )
        return rebuilt.error

    def check(self, rebuilt: Rebuilt) -> None:
        """Raise the first error or checksum mismatch on the way to the chain's last step."""
        failed = self.failure(rebuilt)
        if failed:
            raise failed[1]

    def tensors(self, names: Iterable[str] | None = None, *,
                progress: ProgressFn | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor at the chain's last step, its checksum checked against that step's header."""
        for rebuilt in self.rebuild(names, progress=progress):
            self.check(rebuilt)
            yield rebuilt.name, rebuilt.tensor


@dataclass(kw_only=True)
class Rebuilt:
    """One tensor rebuilt through a chain: its state at the last link, and its checksum at checked links."""

    name: str
    tensor: torch.Tensor
    checksums: dict[int, int] = field(default_factory=dict)  # link -> checksum computed from the bits
    kept: torch.Tensor | None = None  # a copy at the link asked for
    error: tuple[int, DeltaSyncError] | None = None  # (link, error) when the chain could not be followed


def xor_patches(t: torch.Tensor, patches: Sequence[Patch | PackedPatch], *, block_bytes: int = BLOCK_BYTES) -> None:
    """Apply ``patches`` (changes of one tensor, each on the tensor as it stands) to ``t`` in place, without
    checksums: the caller checksums the result. A tensor of more than ``block_bytes`` is visited one block
    at a time, each block receiving its part of every patch: a packed patch's entries are decoded as far as
    the block's end (a cursor per patch, no positions array), a patch of positions is cut by binary search."""
    sparse = [p for p in patches if not p.dense and p.changed]
    whole = len(sparse) < 2 or t.numel() * t.element_size() <= block_bytes or t.device.type != "cpu"
    for p in patches:
        if p.dense or whole:
            xor_either(t, p, checksum=False)
    if whole:
        return
    # each patch checked once, in full
    packed = [(host_bits(t, p), p, np.array([0, -1, 0], np.int64)) for p in sparse if isinstance(p, PackedPatch)]
    plain = [p for p in sparse if isinstance(p, Patch)]
    arrays = [host_arrays(t, cast(np.ndarray, p.positions), p.xor) for p in plain]
    step = max(1, block_bytes // t.element_size())
    bounds = np.arange(0, t.numel() + step, step, dtype=np.int64)
    cuts = [np.searchsorted(cast(np.ndarray, p.positions), bounds) for p in plain]
    for b in range(len(bounds) - 1):
        stop = int(bounds[b + 1])
        for u, q, cursor in packed:
            assert q.entries is not None  # sparse
            _kernels.gap16_xor_until(u, q.entries, q.planes, cursor, stop)
        for (u, pos, xor), cut in zip(arrays, cuts, strict=True):
            i, j = int(cut[b]), int(cut[b + 1])
            if j > i:  # global positions into the whole tensor: no rebased copy
                _kernels.xor_plain_at(u, pos[i:j], xor[i:j])


def group_full(t: torch.Tensor, group: Sequence[Patch | PackedPatch]) -> bool:
    """Whether to apply the patches held for ``t`` now: at once for a tensor that fits ``BLOCK_BYTES`` (no
    block to share), else once they hold ``GROUP_BYTES``."""
    return _group_full(t.numel() * t.element_size(), group)


def _group_full(nbytes: int, group: Sequence[Patch | PackedPatch]) -> bool:
    if nbytes <= BLOCK_BYTES:
        return True
    return sum(_held_bytes(p) for p in group) >= GROUP_BYTES


def _held_bytes(p: Patch | PackedPatch) -> int:
    if isinstance(p, PackedPatch):
        return p.nbytes
    return p.xor.nbytes + (p.positions.nbytes if p.positions is not None else 0)


def check_layout(anchor: StepObject, obj: StepObject) -> None:
    """Raise ``TensorMismatchError`` unless ``obj`` holds the tensor names, shapes and dtypes of ``anchor``."""
    a, h = anchor.header.tensors, obj.header.tensors
    if h.keys() != a.keys() or any((t.dtype, t.shape) != (a[n].dtype, a[n].shape) for n, t in h.items()):
        raise TensorMismatchError(f"{obj.where}: tensor names, shapes or dtypes differ from those of its anchor, step "
                                  f"{anchor.header.step}")
    if obj.header.aliases != anchor.header.aliases:
        raise TensorMismatchError(f"{obj.where}: tied names {obj.header.aliases} differ from those of its anchor, step "
                                  f"{anchor.header.step}: {anchor.header.aliases}")


def open_checked(reader: StreamReader, step: int) -> StepObject:
    """``reader.open`` plus the state checksum: the header agrees with its manifest and with itself."""
    obj = reader.open(step)
    _check_state(reader, step, obj)
    return obj


def _check_state(reader: StreamReader, step: int, obj: StepObject) -> None:
    m, h = reader.manifest(step), obj.header
    if h.state_checksum != m.state_checksum or state_checksum(h.checksums()) != h.state_checksum:
        obj.close()
        raise FormatError(
            f"{reader.url} step {step}: the object header's state checksum {h.state_checksum[:16]}… disagrees with "
            f"its manifest's {m.state_checksum[:16]}… or with its own tensor checksums"
        )


def _feed(reader: StreamReader, step: int) -> AnchorFeed | None:
    """The anchor of ``step`` opened unhashed and fed from a thread, or None where it must be hashed first."""
    try:
        obj = reader.open_unhashed(step)
        if obj is not None:
            _check_state(reader, step, obj)
    except DeltaSyncError:
        reader.store.fetch_object(reader.manifest(step))  # hashes it: a corrupt object is named as such
        raise
    return None if obj is None else AnchorFeed(reader, reader.manifest(step), obj)


def _ahead(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], *, depth: int) -> Iterator[R]:
    """``map(fn, items)`` on ``pool``, in order, with at most ``depth`` results computed ahead (bounded memory)."""
    it = iter(items)
    pending: deque[Future[R]] = deque(pool.submit(fn, item) for item in itertools.islice(it, depth))
    while pending:
        result = pending.popleft().result()
        pending.extend(pool.submit(fn, item) for item in itertools.islice(it, 1))
        yield result
