"""vLLM integration: keep a vLLM engine at a step of a deltasync stream.

* The weight-transfer engine (:mod:`.engine`): start vLLM with ``--weight-transfer-config
  '{"backend": "deltasync"}'`` and drive it with vLLM's own routes or ``LLM`` methods; the engine reads the
  store itself. ``deltasync follow URL --server HOST`` (:class:`HttpWeightTransfer`) sends step numbers.
* The worker extension (:mod:`.worker`, ``worker_extension_cls``) with :class:`VllmTarget` and a
  ``Follower``: the follower fetches, the engine applies.

Importing this package imports no vLLM; :func:`start_engine`, the worker and the engine do.
"""

from __future__ import annotations

from typing import Any

from .client import (
    WEIGHT_TRANSFER_CONFIG,
    WORKER_EXTENSION,
    EngineClient,
    HttpEngine,
    HttpWeightTransfer,
    LocalEngine,
    engine_client,
)
from .target import Mode, Verify, VllmTarget, start_engine

__all__ = [
    "WEIGHT_TRANSFER_CONFIG",
    "WORKER_EXTENSION",
    "EngineClient",
    "HttpEngine",
    "HttpWeightTransfer",
    "LocalEngine",
    "Mode",
    "Verify",
    "VllmTarget",
    "enable_live_cpu_weights",
    "engine_client",
    "start_engine",
]


def enable_live_cpu_weights() -> None:
    """Keep CPU linear weights live in engines created after this call (see :mod:`.live_cpu`; imports vLLM)."""
    from .live_cpu import enable_live_cpu_weights as enable

    enable()


def __getattr__(name: str) -> Any:
    if name in ("DeltasyncWeightTransferEngine", "DeltasyncInitInfo", "DeltasyncUpdateInfo"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
