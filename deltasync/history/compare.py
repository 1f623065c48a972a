"""What changed between two steps, per tensor and per layer (``compare``)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from deltasync.errors import TensorMismatchError
from deltasync.follow.reader import StreamReader
from deltasync.format._bits import int_view
from deltasync.history.replay import Chain, ProgressFn, chain_steps, reader_of

_LAYER = re.compile(r"^(.*?\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``;
    names without a layer number lose their last part (``model.embed_tokens.weight`` -> ``model.embed_tokens``).
    """
    m = _LAYER.match(name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


@dataclass(frozen=True, kw_only=True)
class Difference:
    """How one tensor (or one layer's tensors together) changed between two steps."""

    name: str
    numel: int
    changed: int  # elements whose bits differ
    l2_base: float  # ||a||
    l2_change: float  # ||b - a||
    max_abs_change: float

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def rel_l2(self) -> float | None:
        """||b - a|| / ||a||; None when a is all zeros and something changed."""
        if self.l2_change == 0:
            return 0.0
        return self.l2_change / self.l2_base if self.l2_base else None

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "density": self.density, "rel_l2": self.rel_l2}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Per tensor and per layer (``layer_of``), what changed from step ``a`` to step ``b``."""

    url: str
    a: int
    b: int
    tensors: tuple[Difference, ...]
    layers: tuple[Difference, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "a": self.a,
            "b": self.b,
            "tensors": [t.to_dict() for t in self.tensors],
            "layers": [t.to_dict() for t in self.layers],
        }


def compare(
    url: str | StreamReader, a: int, b: int, *, storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None
) -> Comparison:
    """What changed from step ``a`` to step ``b`` (either order): elements, relative L2, largest change.

    Both states are rebuilt tensor by tensor (one chain walk when ``a`` lies on ``b``'s chain).
    """
    reader = reader_of(url, storage_options)
    diffs: dict[str, Difference] = {}
    if a in chain_steps(reader, b):
        with Chain.open(reader, b, progress=progress) as chain:
            names = list(chain.header.tensors)
            at = chain.steps.index(a)
            for rebuilt in chain.rebuild(keep=at, progress=progress):
                chain.check(rebuilt)
                assert rebuilt.kept is not None  # keep=at: the tensor at step a
                diffs[rebuilt.name] = _difference(rebuilt.name, rebuilt.kept, rebuilt.tensor)
    else:
        with Chain.open(reader, a, progress=progress) as ca, Chain.open(reader, b, progress=progress) as cb:
            if ca.header.tensors.keys() != cb.header.tensors.keys():
                raise TensorMismatchError(f"{reader.url}: steps {a} and {b} hold different tensor names")
            names = list(cb.header.tensors)
            order = cb.order()
            for (name, ta), (_, tb) in zip(ca.tensors(order), cb.tensors(order, progress=progress), strict=True):
                if ta.shape != tb.shape or ta.dtype != tb.dtype:
                    raise TensorMismatchError(f"{reader.url}: tensor {name!r} is {ta.shape} {ta.dtype} at step {a}, "
                                              f"{tb.shape} {tb.dtype} at step {b}")
                diffs[name] = _difference(name, ta, tb)
    ordered = [diffs[name] for name in names]  # the trainer's order
    return Comparison(url=reader.url, a=a, b=b, tensors=tuple(ordered), layers=tuple(_by_layer(ordered)))


def _difference(name: str, a: torch.Tensor, b: torch.Tensor) -> Difference:
    changed = int((int_view(a) != int_view(b)).sum()) if a.numel() else 0
    wide = torch.float32 if a.is_floating_point() and a.element_size() <= 4 else torch.float64
    fa = a.to(wide)
    l2_base = float(torch.linalg.vector_norm(fa)) if a.numel() else 0.0
    l2_change = max_abs = 0.0
    if changed:
        d = b.to(wide) - fa
        l2_change = float(torch.linalg.vector_norm(d))
        max_abs = float(d.abs().max())
    return Difference(name=name, numel=a.numel(), changed=changed, l2_base=l2_base, l2_change=l2_change,
                      max_abs_change=max_abs)


def _by_layer(diffs: Iterable[Difference]) -> list[Difference]:
    groups: dict[str, list[Difference]] = {}
    for d in diffs:
        groups.setdefault(layer_of(d.name), []).append(d)
    return [
        Difference(
            name=layer,
            numel=sum(d.numel for d in ds),
            changed=sum(d.changed for d in ds),
            l2_base=math.sqrt(sum(d.l2_base**2 for d in ds)),
            l2_change=math.sqrt(sum(d.l2_change**2 for d in ds)),
            max_abs_change=max(d.max_abs_change for d in ds),
        )
        for layer, ds in groups.items()
    ]
