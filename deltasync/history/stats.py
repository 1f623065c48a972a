"""Stream statistics: density, bytes, compression and stage timings per step, and a picture of them.

``stream_stats`` reads only manifests. ``layer_density`` reads each delta's step header with two small
ranged reads (no object download) to tell how much of each layer changed at each step. ``plot_stats``
draws both with matplotlib (``pip install 'deltasync[plot]'``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deltasync.errors import CorruptObjectError, MissingDependencyError, StepNotFoundError
from deltasync.follow.reader import StreamReader
from deltasync.format.objects import StepHeader, parse_header
from deltasync.history.compare import layer_of
from deltasync.history.replay import ProgressFn, reader_of, require_steps
from deltasync.store import Manifest, Part, Store, step_dir


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """One step as its manifest describes it. ``full_bytes`` is the size of the nearest anchor at or below it."""

    step: int
    kind: str
    base_step: int | None
    object_bytes: int
    full_bytes: int | None
    numel: int
    changed: int
    density: float
    capture_s: float | None
    encode_s: float | None
    coalesced_steps: tuple[int, ...]
    created_unix_s: float

    @property
    def share_of_full(self) -> float | None:
        return self.object_bytes / self.full_bytes if self.full_bytes else None


@dataclass(frozen=True, kw_only=True)
class StreamStats:
    """Per-step figures of a stream and their summary."""

    url: str
    steps: tuple[StepStats, ...]

    def summary(self) -> dict[str, Any]:
        """Counts, bytes, compression and medians over the deltas (anchors are full copies)."""
        deltas = [s for s in self.steps if s.kind == "delta"]
        anchors = [s for s in self.steps if s.kind == "anchor"]
        total = sum(s.object_bytes for s in self.steps)
        full = [s.full_bytes for s in self.steps if s.full_bytes]
        return {
            "steps": len(self.steps),
            "anchors": len(anchors),
            "deltas": len(deltas),
            "first_step": self.steps[0].step if self.steps else None,
            "last_step": self.steps[-1].step if self.steps else None,
            "total_bytes": total,
            # what the same steps would take as full checkpoints, over what they take
            "compression_ratio": sum(full) / total if full and total else None,
            "delta": {
                "mean_bytes": statistics.fmean(s.object_bytes for s in deltas) if deltas else None,
                "mean_share_of_full": _mean(s.share_of_full for s in deltas),
                "density": _spread(s.density for s in deltas),
                "capture_s": _spread(s.capture_s for s in deltas),
                "encode_s": _spread(s.encode_s for s in deltas),
            },
            "anchor": {
                "mean_bytes": statistics.fmean(s.object_bytes for s in anchors) if anchors else None,
                "capture_s": _spread(s.capture_s for s in anchors),
                "encode_s": _spread(s.encode_s for s in anchors),
            },
        }

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "summary": self.summary(), "steps": [asdict(s) for s in self.steps]}


def _mean(values: Any) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _spread(values: Any) -> dict[str, float] | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    return {"min": vals[0], "median": statistics.median(vals), "mean": statistics.fmean(vals), "max": vals[-1]}


def stream_stats(
    url: str | StreamReader, *, first: int | None = None, last: int | None = None,
    storage_options: dict[str, Any] | None = None
) -> StreamStats:
    """Figures of every committed step in ``first..last``, from the manifests alone."""
    reader = reader_of(url, storage_options)
    committed = require_steps(reader)
    rows = []
    anchor_bytes: int | None = None
    for s in committed:
        if last is not None and s > last:
            break
        m = reader.manifest(s)
        if m.kind == "anchor":
            anchor_bytes = m.object_bytes
        if first is not None and s < first:
            continue
        st = m.stats
        rows.append(
            StepStats(
                step=s,
                kind=m.kind,
                base_step=m.base_step,
                object_bytes=m.object_bytes,
                full_bytes=anchor_bytes,
                numel=st.numel,
                changed=st.changed,
                density=st.density,
                capture_s=st.capture_s,
                encode_s=st.encode_s,
                coalesced_steps=st.coalesced_steps,
                created_unix_s=m.created_unix_s,
            )
        )
    if not rows:
        raise StepNotFoundError(f"{reader.url}: no committed steps in {first}..{last} (the stream holds "
                                f"{committed[0]}..{committed[-1]})")
    return StreamStats(url=reader.url, steps=tuple(rows))


@dataclass(frozen=True, kw_only=True)
class LayerDensity:
    """Share of each layer's elements changed at each delta step (``None`` for anchors: no change recorded)."""

    layers: tuple[str, ...]
    steps: tuple[int, ...]
    density: tuple[tuple[float | None, ...], ...]  # [layer][step]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_density(
    url: str | StreamReader, steps: Sequence[int] | None = None, *, storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> LayerDensity:
    """Per layer (``history.layer_of``) and step, the share of elements that changed, from step headers."""
    reader = reader_of(url, storage_options)
    steps = list(steps) if steps is not None else require_steps(reader)
    columns: list[dict[str, float] | None] = []
    layers: dict[str, None] = {}  # ordered set, in model order
    for k, s in enumerate(steps):
        m = reader.manifest(s)
        if m.kind == "anchor":
            columns.append(None)
        else:
            h = read_step_header(reader.store, m)
            changed: dict[str, int] = {}
            numel: dict[str, int] = {}
            for name, t in h.tensors.items():
                layer = layer_of(name)
                layers.setdefault(layer)
                changed[layer] = changed.get(layer, 0) + t.changed
                numel[layer] = numel.get(layer, 0) + t.numel
            columns.append({layer: changed[layer] / numel[layer] if numel[layer] else 0.0 for layer in changed})
        if progress:
            progress("read step headers", k + 1, len(steps))
    grid = tuple(tuple(None if col is None else col.get(layer) for col in columns) for layer in layers)
    return LayerDensity(layers=tuple(layers), steps=tuple(steps), density=grid)


def read_step_header(store: Store, manifest: Manifest) -> StepHeader:
    """A step's header from the first bytes of its object(s) (two ranged reads each; not verified).

    For a multi-part step (docs/FORMAT.md section 5b), the parts' headers combined: every tensor once, its
    ``changed`` the parts' total.
    """
    headers = [_read_part_header(store, manifest, part) for part in manifest.objects]
    if len(headers) == 1:
        return headers[0]
    from deltasync.format.parts import combine_headers

    return combine_headers(manifest, headers, where=f"{store.url} step {manifest.step}", check_checksums=False)


def _read_part_header(store: Store, manifest: Manifest, part: Part) -> StepHeader:
    rel = f"{step_dir(manifest.step)}/{part.object}"
    where = f"{store.url} step {manifest.step} object {part.object}"

    def read(offset: int, size: int) -> bytes:
        return store.read_range(rel, offset, offset + size)

    try:
        return parse_header(read, part.object_bytes, where=where)[2]
    except FileNotFoundError:
        raise CorruptObjectError(f"{where}: missing, though the step is committed") from None


def need_matplotlib() -> None:
    """Raise ``MissingDependencyError`` (an ``ImportError`` naming the ``plot`` extra) where matplotlib is missing:
    call it before the work whose result is to be plotted."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(f"plotting needs matplotlib ({e}): pip install 'deltasync[plot]'",
                                     name="matplotlib") from None


def plot_stats(stats: StreamStats, density: LayerDensity, path: str | Path) -> Path:
    """Draw a heat map of change density per layer over steps, and the bytes of each step, to ``path`` (PNG).
    Raises ``MissingDependencyError`` without matplotlib (:func:`need_matplotlib` checks ahead)."""
    need_matplotlib()
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator

    path = Path(path)
    n_layers, n_steps = len(density.layers), len(density.steps)
    grid = np.array([[np.nan if v is None else v for v in row] for row in density.density], dtype=float)
    grid = grid.reshape(n_layers, n_steps)
    positive = grid[np.isfinite(grid) & (grid > 0)]
    low = positive.min() if positive.size else 1e-6
    high = max(positive.max(), low * 1.01) if positive.size else 1.0
    cmap = colormaps["viridis"].with_extremes(bad="#d0d0d0", under="black")  # anchors: no change recorded; unchanged
    shown = np.where(grid == 0, low / 10, grid)  # below the colour scale, so drawn in the "under" colour
    percent = FuncFormatter(lambda v, _: f"{v * 100:.3g}%")

    fig = Figure(figsize=(max(6.0, min(18.0, 2.0 + 0.25 * n_steps)), 2.5 + max(2.0, 0.22 * n_layers)),
                 layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[max(2.0, 0.22 * n_layers), 1.6])
    image = top.imshow(
        np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap=cmap,
        norm=LogNorm(vmin=low, vmax=high)
    )
    top.set_yticks(range(n_layers), [layer.removeprefix("model.") for layer in density.layers], fontsize=7)
    top.set_title(f"{stats.url}: share of elements changed per layer (grey: anchor, black: unchanged)", fontsize=9)
    bar = fig.colorbar(image, ax=top, label="changed / elements", pad=0.01)
    bar.ax.yaxis.set_major_formatter(percent)
    bar.ax.yaxis.set_minor_formatter(percent)
    by_step = {s.step: s for s in stats.steps}
    sizes = [by_step[s].object_bytes / 1e6 if s in by_step else 0.0 for s in density.steps]
    colors = ["#c44e52" if s in by_step and by_step[s].kind == "anchor" else "#4c72b0" for s in density.steps]
    bottom.bar(range(n_steps), sizes, color=colors, width=0.85)
    bottom.set_yscale("log")
    bottom.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    bottom.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    bottom.set_ylabel("MB per step")
    bottom.set_xlabel("step (red: anchor, blue: delta)")
    ticks = list(range(0, n_steps, max(1, n_steps // 20)))
    bottom.set_xticks(ticks, [str(density.steps[i]) for i in ticks], fontsize=7)
    fig.savefig(path, dpi=120)
    return path
