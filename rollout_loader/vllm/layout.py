"""What a checkpoint holds (names, shapes, dtypes, host copies), which modules hold a parameter, and where each
checkpoint tensor's elements live on this rank (:class:`TensorHome`, :func:`localize`).

Routes themselves are learned from vLLM's loader (:mod:`rollout_loader.vllm.trace`). Importing this module
imports no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deltasync.engine import DTYPES  # safetensors dtype names (as in docs/FORMAT.md) -> torch dtypes
from rollout_loader.routing import Route, RoutingError, chunks

Shapes = dict[str, list[int]]
Dtypes = dict[str, torch.dtype]
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# (flat indices into a home's bits, xor values there, their checkpoint flat indices, owned)
Group = tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat signed-integer view of a contiguous tensor's bits (same storage)."""
    return t.reshape(-1).view(SIGNED[t.element_size()])


@dataclass
class TensorHome:
    """Where one checkpoint tensor's bits live on this rank: a parameter, or the host copy (reload mode)."""

    routes: tuple[Route, ...]  # its pieces on this rank (none: another rank holds it, as under expert parallelism)
    bits: torch.Tensor  # flat integer view of the parameter or of the host copy
    host: bool  # bits is the full checkpoint tensor (indexed by checkpoint flat index)
    modules: tuple[str, ...]  # modules to re-load (host) or whose kernel to rebuild after a write
    hf_shape: tuple[int, ...] = ()
    # host only: routes into parameters no re-load writes, written from the host copy after each write (converted
    # to the parameter's dtype as the loader did)
    mirror: tuple[Route, ...] = ()
    owned_whole: bool = False  # host only: this rank counts every element (it feeds only untraced parameters)
    # the stream's dtype (safetensors name) this home takes, where the width alone would not tell (an FP8 stream's
    # F8_E4M3 weights and F32 scales); None: any dtype of the home's width
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.routes:
            self.hf_shape = self.routes[0].hf_shape

    @property
    def hf_numel(self) -> int:
        return math.prod(self.hf_shape)


def safetensors_files(path: str | Path) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise RoutingError(f"no safetensors checkpoint at {str(path)!r} (names, shapes and host copies are read there)")
    return files


def checkpoint_layout(path: str | Path) -> tuple[Shapes, Dtypes]:
    """Names, shapes and dtypes of a safetensors checkpoint (a file or a folder of them), read from headers."""
    shapes: Shapes = {}
    dtypes: Dtypes = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = st.get_slice(k)
                shapes[k] = list(sl.get_shape())
                dtypes[k] = DTYPES[sl.get_dtype()]
    return shapes, dtypes


def read_checkpoint(path: str | Path, names: list[str], shapes: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
    """Host copies of checkpoint tensors ``names`` (reload mode: the values of repacked layers)."""
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for k in set(names) & set(st.keys()):
                out[k] = st.get_tensor(k).contiguous()
    missing = [n for n in names if n not in out]
    if missing:
        raise RoutingError(
            f"reload mode needs host copies of {missing[:5]} (and {max(0, len(missing) - 5)} more), not in "
            f"{str(path)!r}"
        )
    for n in names:
        if list(out[n].shape) != list(shapes[n]):
            raise RoutingError(f"{n!r}: checkpoint at {str(path)!r} has shape {list(out[n].shape)}, expected "
                               f"{shapes[n]}")
    return out


def param_owners(model: torch.nn.Module) -> dict[str, list[tuple[str, str]]]:
    """{parameter name: [(module name, attribute)] of every module holding it} (tied ones have several)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    owners: dict[str, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and id(p) in canonical:
                entry = (mod_name, attr)
                if entry not in owners.setdefault(canonical[id(p)], []):
                    owners[canonical[id(p)]].append(entry)
    return owners


def localize(home: TensorHome, pos: torch.Tensor | None, xor: torch.Tensor) -> list[Group]:
    """[(flat indices into the home's bits, xor values there, their checkpoint flat indices, owned)] for this
    rank: the owned elements and the others (held here, counted on another rank) apart; never empty."""
    xor = xor.reshape(-1).view(SIGNED[xor.element_size()])
    if home.host:  # the host copy is the whole checkpoint tensor: every element written, the owned ones counted
        idx = pos.reshape(-1) if pos is not None else torch.arange(xor.numel(), dtype=torch.int64)
        mine = [r for r in home.routes if r.owner]
        if home.owned_whole or (mine and len(mine) == len(home.routes) and all(r.whole for r in mine)):
            return [(idx, xor, idx, True)]
        if not mine:
            return [(idx, xor, idx, False)]
        mask = torch.zeros(idx.numel(), dtype=torch.bool)
        for r in mine:
            keep, _ = r.localize(idx)
            mask = torch.ones_like(mask) if keep is None else mask | keep
        return [g for g in ((idx[mask], xor[mask], idx[mask], True), (idx[~mask], xor[~mask], idx[~mask], False))
                if g[0].numel()] or [(idx[:0], xor[:0], idx[:0], False)]
    groups: dict[bool, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for route in home.routes:
        groups.setdefault(route.owner, []).append(piece(route, pos, xor))
    if not groups:
        empty = torch.zeros(0, dtype=torch.int64)
        return [(empty, xor[:0], empty, False)]
    out = []
    for owned, parts in groups.items():
        if len(parts) == 1:
            out.append((*parts[0], owned))
        else:
            out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                        torch.cat([p[2] for p in parts]), owned))
    return out


def piece(route: Route, pos: torch.Tensor | None,
           xor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(param indices, xor values, checkpoint indices) of the elements of one piece of a checkpoint tensor."""
    if pos is None:
        if route.identity:
            idx = torch.arange(xor.numel(), dtype=torch.int64)
            return idx, xor, idx
        parts = [(box.param_indices(), box.hf_indices()) for box in chunks(route)]
        hf = torch.cat([h for _, h in parts])
        return torch.cat([p for p, _ in parts]), xor[hf], hf
    keep, idx = route.localize(pos)
    if keep is None:
        return idx, xor, pos.reshape(-1)
    return idx, xor[keep], pos.reshape(-1)[keep]
