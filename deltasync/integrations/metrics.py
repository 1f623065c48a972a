"""Per-step publishing metrics as a flat dict of numbers: what W&B, TensorBoard or a Trainer's logs take."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deltasync.publish.publisher import StepMetrics

PREFIX = "deltasync/"


def metrics_for_logs(m: StepMetrics, *, prefix: str = PREFIX) -> dict[str, float]:
    """One committed step's metrics, every value a number (loggers drop or reject strings).

    ``step`` is the published step the numbers describe (uploads run behind training, so it may be older
    than the trainer's current step); ``anchor`` is 1 for a full snapshot, 0 for a delta; ``density`` and
    ``changed`` (elements whose bits changed) come with deltas only.
    """
    values: dict[str, float] = {
        "step": m.step,
        "anchor": 1 if m.kind == "anchor" else 0,
        "bytes": m.object_bytes,
        "share_of_full": m.object_bytes / m.full_bytes if m.full_bytes else 0.0,
        "coalesced_steps": len(m.coalesced_steps),
        "capture_s": m.capture_s,
        "encode_s": m.encode_s,
        "write_s": m.write_s,
        "upload_s": m.upload_s,
    }
    if m.kind == "delta":  # an anchor stores everything: its change is not measured, so it has no density
        values.update(density=m.density, changed=m.changed)
    return {prefix + key: value for key, value in values.items()}


def sharded_metrics_for_logs(record: Mapping[str, Any], *, prefix: str = PREFIX) -> dict[str, float]:
    """One committed step of a sharded (per-rank) publisher, from its writer's record, every value a number.

    ``bytes`` is the whole step (every rank's part), ``part_bytes`` this rank's part; the seconds are this
    rank's own. Sharded steps do not measure their change density here.
    """
    values: dict[str, float] = {
        "step": record["step"],
        "anchor": 1 if record["kind"] == "anchor" else 0,
        "bytes": record["step_bytes"],
        "part_bytes": record["part_bytes"],
        "capture_s": record["capture_s"],
        "encode_s": record["encode_s"],
    }
    return {prefix + key: value for key, value in values.items()}
