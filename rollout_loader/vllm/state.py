"""One rank's deltasync state inside a vLLM worker: where each checkpoint tensor lives, and the apply.

Built once from the loaded model (:func:`rollout_loader.vllm.plan.build_state`) as a :class:`WorkerState`;
afterwards every step is: ``route_patches`` (validate a decoded patch against the engine and map it to this
rank's elements: before any pause), ``write`` (the in-place XOR, all or nothing, with the old bits kept for
``rollback``), and checksums of this rank's parts (``checksums``, or the running ones ``write`` keeps). The
weight-transfer engine (:mod:`rollout_loader.vllm.engine`) drives it; the status extension
(:mod:`rollout_loader.vllm.worker`) only reads it.

The engine also seals a staged step before the pause (``seal``: each patched tensor's checksum after the write,
computed from the bits held now and the patch), so that the pause holds only a plain XOR scatter
(``write_sealed``) and the comparison. Every write and rollback bumps ``WorkerState.version`` under
``WorkerState.lock``; a seal taken at another version is stale and the write falls back to ``write``.

Two ways a write reaches the kernels: "live" (the kernel reads the parameter: GPU, or CPU with live
weights, :mod:`rollout_loader.vllm.live_cpu`) and "reload" (the stock CPU path: layers whose weight was
repacked away keep a host copy of their checkpoint tensors, which is patched and re-loaded through vLLM;
layers with a packed copy next to their weight get their kernel rebuilt).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltasync.engine import (
    PartedObject,
    StepHeader,
    StepObject,
    checksum_change,
    checksum_elements,
    parallel_map,
    submit_all,
    xor_apply,
    xor_apply_all,
)
from deltasync.errors import TensorMismatchError
from rollout_loader.routing import RoutingTable, chunks

from .fp8 import Fp8Plan
from .layout import TensorHome, int_bits, localize

log = logging.getLogger(__name__)

Reload = Callable[[list[tuple[str, torch.Tensor]], set[str]], None]  # (checkpoint tensors, modules they feed)
RawPatch = tuple[str, "np.ndarray | torch.Tensor | None", "np.ndarray | torch.Tensor"]
MASK64 = (1 << 64) - 1
# vLLM logs these on every partial reload, for each layer it was not asked to reload
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.inplace",
                   "vllm.model_executor.model_loader.reload.layerwise")


class PatchError(TensorMismatchError):
    """A patch does not fit the engine (unknown tensor, other shape or dtype, bad positions); nothing changed."""


@dataclass(frozen=True)
class Staged:
    """A patch mapped onto this rank: write ``x`` at ``idx`` of the home's bits (checkpoint indices ``hf_idx``);
    ``owned``: these elements count in this rank's checksum part (a tensor may be staged as an owned and an
    unowned part)."""

    name: str
    idx: torch.Tensor
    x: torch.Tensor
    hf_idx: torch.Tensor
    owned: bool = True


@dataclass
class WorkerState:
    """One rank's deltasync state in a vLLM worker, and everything done to it: ``check_header`` and
    ``route_patches`` before the pause (nothing written), ``seal`` (checksums ahead), ``write``/``write_sealed``
    inside it (all or nothing, undoable), ``rollback`` of the last write, ``checksums`` of what the rank holds.
    Built by :func:`rollout_loader.vllm.plan.build_state`; one lock orders writes against seals."""

    model: torch.nn.Module
    reload: Reload
    table: RoutingTable
    mode: str
    homes: dict[str, TensorHome]
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # checkpoint tensors of reloaded modules
    feeds: dict[str, tuple[str, ...]] = field(default_factory=dict)  # reloaded module -> checkpoint names
    # checkpoint tensors the model ties to another one (a tied head the checkpoint also stores) -> that one: never
    # written (the engine holds one tensor), verified by its checksum, which must be the other one's
    aliases: dict[str, str] = field(default_factory=dict)
    # what the stream's tensors are: "checkpoint" (the engine's checkpoint tensors) or "fp8" (the engine's FP8
    # representation, docs/FORMAT.md section 7)
    representation: str = "checkpoint"
    plan: Fp8Plan | None = None  # with representation "fp8": how the engine quantizes (rollout_loader/vllm/fp8.py)
    undo: list[tuple[torch.Tensor, Staged]] = field(default_factory=list)  # (bits, what was XORed in)
    undo_modules: set[str] = field(default_factory=set)
    # this rank's part of each tensor's checksum, kept current by every write (incremental verification)
    sums: dict[str, int] = field(default_factory=dict)
    undo_sums: dict[str, int] = field(default_factory=dict)
    # bumped by every write and rollback (under ``lock``): a seal is good for the version it was taken at
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check_header(self, header: StepHeader, where: str) -> None:
        """The step's tensors are this engine's checkpoint tensors, same shapes and element widths."""
        names = set(header.tensors)
        self._adopt_tied(names)
        known = set(self.homes) | set(self.aliases)
        problems = [f"{n!r}: not a checkpoint tensor of this model" for n in sorted(names - known)[:5]]
        missing = sorted(set(self.homes) - names)  # a tied tensor the step leaves out is no loss: never held
        if missing:
            problems.append(f"the step has no {missing[:5]} "
                            f"(the engine's checkpoint has {len(missing)} more tensor(s))")
        for name in sorted(names & known):
            th, t = header.tensors[name], self.homes[self.aliases.get(name, name)]
            if tuple(th.shape) != t.hf_shape or th.itemsize != t.bits.element_size() or t.dtype not in (None, th.dtype):
                problems.append(f"{name!r}: the step has {th.dtype} {list(th.shape)}, the engine "
                                f"{t.dtype or f'{8 * t.bits.element_size()}-bit'} {list(t.hf_shape)}")
        if problems:
            raise PatchError(f"{where}: the step does not fit the engine, weights untouched "
                             f"({len(problems)} problem(s)): " + "; ".join(problems[:8]) + self._hint(header))

    def _hint(self, header: StepHeader) -> str:
        """What to do when a stream carries the other representation of an FP8 engine's weights."""
        fp8 = any(t.dtype == "F8_E4M3" for t in header.tensors.values())
        if self.representation == "fp8" and not fp8:
            return (". This engine follows its FP8 representation (representation='fp8', docs/FORMAT.md section 7) and "
                    "the stream carries a checkpoint's tensors: follow it with representation='checkpoint', or publish "
                    "the FP8 representation (rollout_loader.vllm.Fp8Quantizer)")
        if self.representation == "fp8":
            return (". The stream's FP8 tensors do not fit this engine's FP8 layers: quantize with the engine's own "
                    "plan (rollout_loader.vllm.fp8_plan with the engine's checkpoint and --quantization)")
        if fp8:
            return (". The stream carries FP8 tensors (an FP8 engine's representation, docs/FORMAT.md section 7): "
                    "follow it with representation='fp8' on an engine that quantizes as the stream's plan says")
        return ""

    def _adopt_tied(self, names: set[str]) -> None:
        """A stream that publishes a tied pair under the other name (a trainer whose state dict lists the head
        first): the engine holds the pair's one tensor under the name the stream carries, and checks the other."""
        with self.lock:
            for alias, target in list(self.aliases.items()):
                if alias in names and target not in names:
                    del self.aliases[alias]
                    self.homes[alias] = self.homes.pop(target)
                    self.aliases[target] = alias
                    if target in self.host:
                        self.host[alias] = self.host[target]  # re-loads still send it under the name vLLM knows
                    if target in self.sums:
                        self.sums[alias] = self.sums.pop(target)
                    log.info("deltasync: the stream carries %r for the tied pair (%r checked against it)", alias,
                             target)

    def route_patches(self, patches: Iterable[RawPatch]) -> list[Staged]:
        """Validate every patch against the engine and map it to this rank's elements; writes nothing.

        A patch is ``(name, positions, xor)`` (numpy or torch; positions int64 ascending or None for dense;
        xor as wide as the tensor's dtype), which is what ``StepObject.patches()`` yields.
        """
        items = list(patches)  # checked and routed in parallel across tensors, largest first; kept in order
        routed = parallel_map(self._route_one, items, cost=lambda r: int(r[2].size if isinstance(r[2], np.ndarray)
                                                                         else r[2].numel()))
        return _staged_or_raise(routed)

    def stage_object(self, obj: StepObject | PartedObject, *, seal: bool = False) -> tuple[list[Staged], Seal | None]:
        """``route_patches`` over a delta's changed tensors, each decoded, checked and routed in one pool task
        (largest first: no wait for every tensor's decoding before the routing starts); with ``seal``, each
        task also computes its tensors' change for a seal over the bits held now (what ``seal`` computes,
        in the same pass). A tensor that fails to decode raises its error (nothing is written either way)."""
        names = [n for n, t in obj.header.tensors.items() if t.changed]
        start = self._seal_start(n for n in names if n in self.homes) if seal else None

        # one object's gap16 positions are strictly ascending by construction (each entry advances at least 1) and
        # its decoder checked their count and range: the engine's own ascending pass (a tenth of staging's CPU)
        # is for patches from elsewhere (route_patches) and the merged parts of a multi-part step
        decoded_ascending = isinstance(obj, StepObject)

        def work(name: str) -> tuple[list[Staged] | str, list[int]]:
            p = obj.patch(name)
            routed = self._route_one((p.name, p.positions, p.xor), ascending=decoded_ascending)
            if isinstance(routed, str) or not seal:
                return routed, []
            return routed, [self._change(s) for s in routed]

        results = parallel_map(work, names, cost=lambda n: obj.header.tensors[n].changed)
        staged = _staged_or_raise([r for r, _ in results])
        if start is None:
            return staged, None
        return staged, _sealed(*start, [(s, c) for routed, changes in results if not isinstance(routed, str)
                                         for s, c in zip(routed, changes, strict=True)])  # (a problem raised above)

    def _route_one(self, patch: RawPatch, *, ascending: bool = False) -> list[Staged] | str:
        """One patch checked and mapped to this rank's elements, or what is wrong with it. ``ascending``: its
        positions are known to be strictly ascending (decoded from one object's gap16), so that pass is skipped."""
        name, pos, xor = patch
        p, x = _as_torch(pos, signed=False), _as_torch(xor, signed=True)
        assert x is not None
        problem = self._problem(name, p, x, ascending=ascending)
        if problem:
            return f"{name!r}: {problem}"
        if name in self.aliases:
            return []  # checked, never written: the engine holds the tensor it is tied to
        return [Staged(name=name, idx=idx, x=xs, hf_idx=hf, owned=owned)
                for idx, xs, hf, owned in localize(self.homes[name], p, x)]

    def write(self, staged: Sequence[Staged]) -> dict[str, int]:
        """XOR staged patches in place, all or nothing on this rank; returns this rank's checksum part of each
        patched tensor after the write (owned elements only; read back from what landed).

        If a write or a kernel sync fails, the old bits are put back before raising. The old bits of a
        successful write stay recorded until the next write, for ``rollback``.
        """
        with self.lock:
            self.version += 1
            return self._write(staged)

    def seal(self, staged: Sequence[Staged]) -> Seal:
        """This rank's checksum part of each patched tensor after ``staged`` is written over the bits held now
        (owned elements only): the old bits at the patched positions are read, the new ones are old ^ xor.

        O(change) plus, the first time a tensor is seen, one pass over it (its running part). Runs before the pause
        (the prefetcher's thread); ``write_sealed`` uses it only while no other write happened since.
        """
        start = self._seal_start(s.name for s in staged)
        # the patches' changes in parallel on deltasync's pool (largest first), then added up per tensor
        changes = parallel_map(self._change, staged, cost=lambda s: s.idx.numel())
        return _sealed(*start, list(zip(staged, changes, strict=True)))

    def _seal_start(self, names: Iterable[str]) -> tuple[int, dict[str, int]]:
        """The version a seal is for and the running parts of ``names`` (a first pass over a tensor), read under
        the lock. The changes are then computed without it, so that an update never waits for a seal: any write
        or rollback meanwhile bumps the version under the lock, and ``write_sealed`` refuses the stale seal."""
        with self.lock:
            return self.version, {n: self.part(n) for n in names}

    def _change(self, s: Staged) -> int:
        """The change of this rank's checksum part that writing ``s`` would make (0 for elements it does not own)."""
        if not (s.owned and s.idx.numel()):
            return 0
        bits = self.homes[s.name].bits
        return checksum_change(bits, *_host_args(bits, s))  # NumPy views on CPU: no torch call per patch

    def write_sealed(self, staged: Sequence[Staged], sealed: Seal) -> dict[str, int] | None:
        """``write`` for a sealed step: a plain XOR scatter (no hashing inside the pause), this rank's parts
        taken from the seal. None, with nothing written, when the bits changed since the seal (write it unsealed).

        The seal's parts are exact for the bits written: they were computed from the same old bits (no write
        happened since: same version, under the lock) and the same xor; a mismatch with the trainer's checksums
        still rolls the write back (:meth:`rollback`).
        """
        with self.lock:
            if self.version != sealed.version or any(s.name not in sealed.sums for s in staged):
                return None
            self.version += 1
            return self._undoable({s.name: sealed.sums[s.name] for s in staged},
                                  lambda landed: self._scatter_all(staged, landed=landed))

    def rollback(self) -> bool:
        """Put back the bits the last write changed; False when there is nothing to undo."""
        with self.lock:
            if not self.undo:
                return False
            self.version += 1
            self._restore(self.undo, self.undo_modules)
            self.sums.update(self.undo_sums)
            self.undo, self.undo_modules, self.undo_sums = [], set(), {}
            return True

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """``mix64-sum`` of each checkpoint tensor over the elements this rank owns, from the bits as they are.

        Each element is owned by one rank, so the ranks' values add up (mod 2**64) to the tensor's checksum.
        """
        asked = list(self.homes) if names is None else list(names)
        out: dict[str, int] = {}
        for name in dict.fromkeys(self.aliases.get(n, n) for n in asked):
            home = self.homes.get(name)
            if home is None:
                raise PatchError(f"{name!r} is not a checkpoint tensor of this model")
            total = 0
            if home.owned_whole:
                total = checksum_elements(home.bits, torch.arange(home.bits.numel(), dtype=torch.int64))
            for route in home.routes:
                if not route.owner:
                    continue
                for box in chunks(route):
                    hf_idx = box.hf_indices()
                    bits = home.bits[hf_idx] if home.host else home.bits[box.param_indices()]
                    total += checksum_elements(bits, hf_idx)
            out[name] = total & MASK64
        self.sums.update(out)  # exact for the bits as they are now: the base of incremental verification
        return {n: out[self.aliases.get(n, n)] for n in asked}

    def with_aliases(self, parts: dict[str, int], names: Iterable[str]) -> dict[str, int]:
        """``parts`` with the part of each tied tensor among ``names`` (the step's): its target's, which its
        checksum must equal (the engine holds one tensor for both)."""
        out = dict(parts)
        for n in names:
            target = self.aliases.get(n)
            if target is not None:
                out[n] = out[target] if target in out else self.part(target)
        return out

    def part(self, name: str) -> int:
        """This rank's running checksum part for ``name`` (computed from the bits the first time)."""
        name = self.aliases.get(name, name)
        if name not in self.sums:
            self.checksums([name])
        return self.sums[name]

    def anchor_patches(self, tensors: Mapping[str, torch.Tensor]) -> list[RawPatch]:
        """An anchor's tensors (already checked with :func:`check_header`) as dense XOR patches against the bits
        this rank holds now: each xor is the anchor's bits with this rank's held bits XORed in over the box it
        holds (elements of other ranks are dropped when staged). Writing them makes the engine hold the anchor;
        rolling back restores the previous step. Consumes ``tensors`` (their memory becomes the xor)."""
        out: list[RawPatch] = []
        for name, home in self.homes.items():
            x = int_bits(tensors[name].contiguous())
            if home.host:
                x ^= home.bits
            else:
                for route in home.routes:
                    for box in chunks(route):
                        hf = box.hf_indices()
                        x[hf] ^= home.bits[box.param_indices()].to(x.device)
            out.append((name, None, x))
        return out

    def rederive(self) -> list[str]:
        """Derive again, from the checkpoint-format weights this rank holds, every tensor vLLM derives from them
        after loading (shadowed modules re-loaded from their host copies, CPU kernels' packed copies rebuilt,
        converted copies converted again) and return the runtime tensors whose bits changed: those the engine
        computed with that were not derived from the weights it holds (a start from another checkpoint than the
        one it reads its host copies from, a reload that left a transformed weight wrong). Checksums of the
        checkpoint-format weights cannot see them. Afterwards every derived tensor is the derivation of the weights
        held. One reload of every shadowed module (an anchor's work) and two passes over the weights; nothing to
        do where every tensor is written in place."""
        from .fingerprint import runtime_checksums

        modules = set(self.feeds) | {m for h in self.homes.values() if not h.host for m in h.modules}
        mirrored = [Staged(name=n, idx=torch.arange(h.hf_numel, dtype=torch.int64), x=torch.empty(0),
                           hf_idx=torch.empty(0)) for n, h in self.homes.items() if h.mirror]
        if not modules and not mirrored:
            return []
        before = runtime_checksums(self.model)
        with self.lock:
            self.version += 1  # a seal taken before is stale
            with torch.inference_mode():
                self._mirror([(self.homes[s.name].bits, s) for s in mirrored])
            self.sync_kernels(modules)
        after = runtime_checksums(self.model)
        return sorted(n for n in after if before.get(n) != after[n])

    def sync_kernels(self, modules: set[str]) -> None:
        """Make the kernels of ``modules`` see the new bits: reload from host copies, or rebuild."""
        if not modules:
            return
        reload = sorted(m for m in modules if m in self.feeds)
        if reload:
            names = sorted({n for m in reload for n in self.feeds[m]})
            with _quiet(_RELOAD_LOGGERS):
                self.reload([(n, self.host[n]) for n in names], set(reload))
        with torch.inference_mode():
            for m in sorted(modules - set(reload)):
                module = self.model.get_submodule(m)
                module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr, operator]  # vLLM's

    def _problem(self, name: str, pos: torch.Tensor | None, xor: torch.Tensor, *,
                 ascending: bool = False) -> str | None:
        home = self.homes.get(self.aliases.get(name, name))
        if home is None:
            return "not a checkpoint tensor of this model"
        n, width = home.hf_numel, home.bits.element_size()
        if xor.is_floating_point() or xor.is_complex() or xor.dtype == torch.bool or xor.element_size() != width:
            return f"xor is {xor.dtype}, the engine holds {width}-byte elements (use int{8 * width})"
        if pos is None:
            return None if xor.numel() == n else f"a dense xor needs {n} elements, got {xor.numel()}"
        if pos.dtype != torch.int64 or pos.numel() != xor.numel():
            return f"positions must be int64 and as many as xor ({pos.dtype}, {pos.numel()} vs {xor.numel()})"
        if pos.numel() and (int(pos[0]) < 0 or int(pos[-1]) >= n):
            return f"positions run from {int(pos[0])} to {int(pos[-1])}, the tensor has {n} elements"
        if pos.numel() > 1 and not ascending and not _ascending(pos):
            return "positions are not strictly ascending"
        return None

    def _scatter_all(self, staged: Sequence[Staged], *, landed: list[tuple[torch.Tensor, Staged]]) -> None:
        """XOR every staged patch into its home (each checked before its write), appending each write that landed
        to ``landed`` (the caller undoes them if any failed); raises the first error once no write runs any more.

        Host tensors are written on a small pool, dynamically across tensors (the kernel is serial: a busy core
        delays one tensor, never a barrier), so the scatter uses the memory bandwidth of more than one core; tensors
        on one accelerator with one transfer for the step and no host sync per tensor (``xor_apply_all``).
        """
        bits = [self.homes[s.name].bits for s in staged]
        if bits and len({b.device for b in bits}) == 1 and bits[0].device.type != "cpu":
            done: list[int] = []
            try:
                xor_apply_all([(b, s.idx, s.x, None) for b, s in zip(bits, staged, strict=True)], checksum=False,
                              landed=done)
            finally:
                landed += [(bits[j], staged[j]) for j in done]
            return

        def one(s: Staged) -> None:
            home = self.homes[s.name]
            idx, x, _ = _host_args(home.bits, s)
            xor_apply(home.bits, idx, x, checksum=False)  # checks, then writes: a failed one wrote nothing

        if not (len(staged) > 1 and all(self.homes[s.name].bits.device.type == "cpu" for s in staged)):
            for s in staged:
                one(s)
                landed.append((self.homes[s.name].bits, s))
            return
        # largest first; each pool thread takes the next patch (one hand-over per thread, not per patch)
        futures = submit_all(one, staged, cost=lambda s: s.x.numel(), pool=_SCATTER_POOL)
        try:
            wait(futures)
        finally:  # also on an interrupt: what runs lands first, then everything that landed is known
            for f in futures:
                f.cancel()
            wait(futures)
            for s, f in zip(staged, futures, strict=True):
                if not f.cancelled() and f.exception() is None:
                    landed.append((self.homes[s.name].bits, s))
        errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
        if errors:
            raise errors[0]

    def _write(self, staged: Sequence[Staged]) -> dict[str, int]:
        sums = {s.name: self.part(s.name) for s in staged}

        def write_all(landed: list[tuple[torch.Tensor, Staged]]) -> None:
            for s in staged:
                home = self.homes[s.name]
                idx, x, hf_idx = _host_args(home.bits, s)
                delta = xor_apply(home.bits, idx, x, index=hf_idx, checksum=s.owned)  # checks, writes; read back
                landed.append((home.bits, s))
                if s.owned:
                    sums[s.name] = (sums[s.name] + delta) & MASK64

        return self._undoable(sums, write_all)

    def _undoable(self, sums: dict[str, int],
                  write_all: Callable[[list[tuple[torch.Tensor, Staged]]], None]) -> dict[str, int]:
        """Run ``write_all`` (it appends each patch that landed) and sync the kernels; on any failure put back what
        landed and raise; else keep what the next ``rollback`` undoes and take ``sums`` as this rank's parts.
        ``sums`` may be filled in by ``write_all``."""
        self.undo, self.undo_modules, self.undo_sums = [], set(), {}  # a failed write leaves nothing to undo
        undo: list[tuple[torch.Tensor, Staged]] = []
        try:
            with torch.inference_mode():
                write_all(undo)
                self._mirror(undo)
            self.sync_kernels(self._modules(undo))
        except BaseException:
            try:
                self._restore(undo, self._modules(undo))
            except Exception:
                log.exception("deltasync: restoring the old weights after a failed write failed too")
            raise
        self.undo, self.undo_modules = undo, self._modules(undo)
        self.undo_sums = {name: self.sums[name] for name in sums}
        self.sums.update(sums)
        return sums

    def _modules(self, written: list[tuple[torch.Tensor, Staged]]) -> set[str]:
        """The modules whose kernels read the written tensors."""
        return {m for _, s in written for m in self.homes[s.name].modules}

    def _restore(self, undo: list[tuple[torch.Tensor, Staged]], modules: set[str]) -> None:
        """XOR the same patches in again: XOR undoes itself, so the bits are exactly the previous ones."""
        with torch.inference_mode():
            for bits, s in reversed(undo):
                idx, x, _ = _host_args(bits, s)
                xor_apply(bits, idx, x, checksum=False)
            self._mirror(undo)
        self.sync_kernels(modules)

    def _mirror(self, written: list[tuple[torch.Tensor, Staged]]) -> None:
        """Write the new host bits of written tensors into the parameters their mirror routes feed, converted as
        the loader converted them (``Route.casts``): what the loader's copy would write there now."""
        params: dict[str, torch.Tensor] | None = None
        for _, s in written:
            home = self.homes[s.name]
            if not home.mirror or not s.idx.numel():
                continue
            params = params if params is not None else dict(self.model.named_parameters())
            values = self.host[s.name].reshape(-1)
            for route in home.mirror:
                keep, pidx = route.localize(s.idx)
                v = values[s.idx if keep is None else s.idx[keep]]
                for dtype in route.casts:
                    v = v.to(dtype)
                flat = params[route.param_name].data.view(-1)
                flat[pidx.to(flat.device)] = v.to(flat.device)


@dataclass(frozen=True)
class Seal:
    """This rank's checksum part of each tensor a staged step patches, as it will be once the step is written
    over the bits held at ``version`` (computed before the pause: ``seal``)."""

    version: int
    sums: dict[str, int]


def _as_torch(a: np.ndarray | torch.Tensor | None, *, signed: bool) -> torch.Tensor | None:
    if a is None or isinstance(a, torch.Tensor):
        return a
    if signed and a.dtype.kind == "u":
        a = a.view(f"i{a.itemsize}")
    return torch.from_numpy(np.ascontiguousarray(a))


def _ascending(pos: torch.Tensor) -> bool:
    """Whether 1-D ``pos`` is strictly ascending. On CPU with NumPy on the calling thread: torch's comparison splits
    across its OpenMP threads, which the prefetcher's pool threads (one per core) then contend for, and it allocates
    the whole comparison at once; here a chunk at a time, each still in cache (measured on a 134M model's step:
    ~7 ms of the staging thread's CPU down to ~1.5)."""
    if pos.device.type != "cpu":
        return bool((pos[1:] > pos[:-1]).all())
    a = pos.numpy()
    for s in range(0, a.size - 1, _CHUNK):
        e = min(s + _CHUNK, a.size - 1)
        if not np.greater(a[s + 1 : e + 1], a[s:e]).all():
            return False
    return True


_CHUNK = 1 << 16  # positions compared at a time (_ascending): 64K bools, in the L2 cache


def _sealed(version: int, parts: Mapping[str, int], changes: Sequence[tuple[Staged, int]]) -> Seal:
    """A seal at ``version``: each tensor's running part plus the changes of its staged patches."""
    sums: dict[str, int] = {}
    for s, c in changes:
        sums[s.name] = ((sums[s.name] if s.name in sums else parts[s.name]) + c) & MASK64
    return Seal(version=version, sums=sums)


def _staged_or_raise(routed: Sequence[list[Staged] | str]) -> list[Staged]:
    """The routed patches in order, or one ``PatchError`` listing every problem (nothing was written)."""
    problems = [r for r in routed if isinstance(r, str)]
    if problems:
        raise PatchError(f"patch rejected, weights untouched ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))
    return [s for r in routed if not isinstance(r, str) for s in r]


# not deltasync's work pool (deltasync/threads.py): the prefetcher decodes the next step there, and a pause must
# not queue behind that work
_SCATTER_POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                   thread_name_prefix="deltasync-write")


def _host_args(bits: torch.Tensor, s: Staged) -> tuple[Any, Any, Any]:
    """A staged patch's positions, xor and checksum indices as NumPy views for CPU bits: the checks before a write
    then run on the calling thread (torch's own reductions split across its thread pool, which stalls when
    another process holds a core, as in a paused engine next to a trainer)."""
    if bits.device.type != "cpu":
        return s.idx, s.x, s.hf_idx
    return s.idx.numpy(), s.x.numpy(), s.hf_idx.numpy()


@contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels, strict=True):
            lg.setLevel(lvl)
