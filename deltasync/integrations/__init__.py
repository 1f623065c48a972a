"""Integrations with training frameworks.

``canonical_names`` and ``metrics_for_logs`` need nothing beyond deltasync. ``DeltaSyncCallback`` (a
transformers ``TrainerCallback``) is imported from ``deltasync.integrations.transformers`` or, lazily, from
here: importing this package does not import transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltasync.integrations.metrics import metrics_for_logs
from deltasync.publish.names import canonical_name, canonical_names

if TYPE_CHECKING:
    from deltasync.integrations.transformers import DeltaSyncCallback

__all__ = ["DeltaSyncCallback", "canonical_name", "canonical_names", "metrics_for_logs"]


def __getattr__(name: str) -> Any:
    if name == "DeltaSyncCallback":
        from deltasync.integrations.transformers import DeltaSyncCallback

        return DeltaSyncCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
