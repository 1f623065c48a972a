"""Replay stage: rebuild tensors through a chain of objects (an anchor, then deltas), one tensor at a time.

Each tensor is read from the anchor into fresh memory, then patched by each delta in turn; its checksum
is computed from the resulting bits and compared with the last step's header (``verify`` instead follows
it through every link, to name the step that broke a tensor). What a replay proves: every object's size
and SHA-256 against its manifest, each header's state checksum against its manifest and its own tensor
checksums (``open_checked``), and each tensor's final bits against the last step's checksum, computed in
one full pass over them; the intermediate steps' checksums are not computed (no step in between is
returned). A few tensors are rebuilt at once on worker threads, in order, so that memory stays near one
tensor per worker (one model copy when the caller keeps them all); nothing is memory-mapped, so nothing
counts twice.

A tensor larger than a core's share of the cache is patched a block at a time: several deltas' patches
of it are decoded first (at most ``GROUP_BYTES`` of them), then each block of the tensor receives all of
them while it sits in the cache, instead of every delta streaming the whole tensor through memory once
(XOR patches commute: the order does not change the bits). Used by ``history`` (replay, compare, push)
and ``maintenance`` (verify)."""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
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
from deltasync.format import _kernels
from deltasync.format.checksum import (
    add,
    format_checksum,
    parse_checksum,
    state_checksum,
    tensor_checksum,
)
from deltasync.format.objects import StepHeader, StepObject
from deltasync.format.patch import Patch
from deltasync.reader import StreamReader
from deltasync.stages.apply import host_arrays, xor_apply

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


def open_reader(url: str | StreamReader, storage_options: dict[str, Any] | None = None) -> StreamReader:
    return url if isinstance(url, StreamReader) else StreamReader(url, storage_options=storage_options)


def require_steps(reader: StreamReader) -> list[int]:
    """The stream's committed steps, at least one: ``StreamNotFoundError`` where there is no stream at all,
    ``StepNotFoundError`` for a stream with no steps yet."""
    steps = reader.steps()
    if not steps:
        reader.store.require_stream()
        raise StepNotFoundError(f"{reader.store.url}: the stream has no committed steps yet")
    return steps


def chain_steps(reader: StreamReader, step: int) -> list[int]:
    """``reader.chain(step)``, with clearer errors for a step that is not committed and a URL without a stream."""
    try:
        reader.manifest(step)  # a step that is not committed is named as such, with its neighbours
        return reader.chain(step)
    except StepNotFoundError:
        require_steps(reader)
        raise


class Chain:
    """The opened objects of one step's chain, anchor first; rebuilds its tensors one at a time."""

    def __init__(self, objects: list[StepObject]) -> None:
        self.objects = objects
        self.steps = [o.header.step for o in objects]
        for obj in objects[1:]:
            check_layout(objects[0], obj)

    @classmethod
    def open(cls, reader: StreamReader, step: int, *, progress: ProgressFn | None = None) -> Chain:
        """Fetch and verify every object of ``step``'s chain (size, SHA-256, header against manifest)."""
        steps = chain_steps(reader, step)
        objects: list[StepObject] = []
        # downloads and SHA-256 checks on a few threads: the anchor's hash overlaps the deltas'
        with ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="deltasync-fetch") as pool:
            futures = [pool.submit(open_checked, reader, s) for s in steps]
            try:
                for i, future in enumerate(futures):
                    objects.append(future.result())
                    if progress:
                        progress(f"fetch step {step}'s chain", i + 1, len(steps))
                return cls(objects)
            except BaseException:
                for future in futures:
                    future.cancel()
                for future in futures:
                    if not future.cancelled() and future.exception() is None and future.result() not in objects:
                        future.result().close()
                for o in objects:
                    o.close()
                raise

    @property
    def header(self) -> StepHeader:
        return self.objects[-1].header

    def close(self) -> None:
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
        try:
            for k, rebuilt in enumerate(_ahead(pool, lambda n: self._rebuild(n, check, keep), names,
                                               depth=2 * _WORKERS + 2)):
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
            t = out.tensor = self.objects[0].read_tensor(name)
            if check == "result" and keep is None:  # the common case: patched in groups, checksummed once
                group: list[Patch] = []
                for link, obj in enumerate(self.objects):
                    if link and obj.header.tensors[name].changed:
                        group.append(obj.patch(name))
                        if group_full(t, group):
                            xor_patches(t, group)
                            group = []
                xor_patches(t, group)
                out.checksums[last] = tensor_checksum(t)
                return out
            checksum = tensor_checksum(t) if check == "each" else 0
            for link, obj in enumerate(self.objects):
                if link and obj.header.tensors[name].changed:
                    p = obj.patch(name)
                    # "result" checksums the final bits once, in full: no per-link checksum change
                    change = xor_apply(t, p.positions, p.xor, checksum=check == "each")
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


def xor_patches(t: torch.Tensor, patches: list[Patch], *, block_bytes: int = BLOCK_BYTES) -> None:
    """Apply ``patches`` (changes of one tensor, each on the tensor as it stands) to ``t`` in place, without
    checksums: the caller checksums the result. A tensor of more than ``block_bytes`` is visited one block
    at a time, each block receiving its part of every patch (found by binary search in the sorted positions)."""
    sparse = [p for p in patches if p.positions is not None and p.positions.size]
    whole = len(sparse) < 2 or t.numel() * t.element_size() <= block_bytes or t.device.type != "cpu"
    for p in patches:
        if p.positions is None or whole:
            xor_apply(t, p.positions, p.xor, checksum=False)
    if whole:
        return
    # each patch checked once, in full (``sparse``: positions set)
    arrays = [host_arrays(t, cast(np.ndarray, p.positions), p.xor) for p in sparse]
    step = max(1, block_bytes // t.element_size())
    bounds = np.arange(0, t.numel() + step, step, dtype=np.int64)
    cuts = [np.searchsorted(cast(np.ndarray, p.positions), bounds) for p in sparse]
    for b in range(len(bounds) - 1):
        for (u, pos, xor), cut in zip(arrays, cuts, strict=True):
            i, j = int(cut[b]), int(cut[b + 1])
            if j > i:  # global positions into the whole tensor: no rebased copy
                _kernels.xor_plain_at(u, pos[i:j], xor[i:j])


def group_full(t: torch.Tensor, group: list[Patch]) -> bool:
    """Whether to apply the patches held for ``t`` now: at once for a tensor that fits ``BLOCK_BYTES`` (no
    block to share), else once they hold ``GROUP_BYTES``."""
    if t.numel() * t.element_size() <= BLOCK_BYTES:
        return True
    return sum(p.xor.nbytes + (p.positions.nbytes if p.positions is not None else 0) for p in group) >= GROUP_BYTES


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
    m, h = reader.manifest(step), obj.header
    if h.state_checksum != m.state_checksum or state_checksum(h.checksums()) != h.state_checksum:
        obj.close()
        raise FormatError(
            f"{reader.url} step {step}: the object header's state checksum {h.state_checksum[:16]}… disagrees with "
            f"its manifest's {m.state_checksum[:16]}… or with its own tensor checksums"
        )
    return obj


def _ahead(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], *, depth: int) -> Iterator[R]:
    """``map(fn, items)`` on ``pool``, in order, with at most ``depth`` results computed ahead (bounded memory)."""
    it = iter(items)
    pending: deque[Future[R]] = deque(pool.submit(fn, item) for item in itertools.islice(it, depth))
    while pending:
        result = pending.popleft().result()
        pending.extend(pool.submit(fn, item) for item in itertools.islice(it, 1))
        yield result
