"""What a checkpoint holds (names, shapes, dtypes, host copies) and which modules hold a parameter.

Routes themselves are learned from vLLM's loader (:mod:`rollout_loader.vllm.trace`). Importing this module
imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from deltasync.engine import DTYPES  # safetensors dtype names (as in docs/FORMAT.md) -> torch dtypes
from rollout_loader.routing import RoutingError

Shapes = dict[str, list[int]]
Dtypes = dict[str, torch.dtype]



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
