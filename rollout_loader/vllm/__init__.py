"""vLLM integration: keep a vLLM engine at a step of a deltasync stream.

The weight-transfer engine (:mod:`.engine`) is how deltasync enters vLLM: start vLLM with
``--weight-transfer-config '{"backend": "deltasync"}'`` (or :func:`start_engine`) and drive it with vLLM's own
routes or ``LLM`` methods, or with a ``Follower`` and :class:`VllmTarget` (an ``LLM`` or a server URL); the
engine reads the store itself, only step numbers travel. ``deltasync follow URL --server HOST`` does the latter.

An FP8 engine follows its own FP8 representation in place (docs/FORMAT.md section 7): a trainer gets the engine's
:class:`Fp8Plan` with :func:`fp8_plan`, quantizes with :class:`Fp8Quantizer` and the engine is initialised with
``representation="fp8"``.

Each engine fingerprints what it computes with after every update (docs/FORMAT.md section 5f) and compares it with
the reference :func:`reference_for_step` stores (``deltasync fingerprint``).

Importing this package imports no vLLM; :func:`start_engine`, :func:`fp8_plan`, the quantizer's arithmetic, the
worker extension and the engine do.
"""

from __future__ import annotations

from typing import Any

from .client import (
    WEIGHT_TRANSFER_CONFIG,
    WORKER_EXTENSION,
    HttpWeightTransfer,
    LocalWeightTransfer,
    SyncClientTransfer,
    WeightTransfer,
)
from .fp8 import Fp8Plan, Fp8Quantizer, fp8_plan
from .ray_client import RayWeightTransfer
from .reference import reference_for_step
from .settings import EngineSettings, EngineVerify, Mode, Representation
from .target import VllmTarget, start_engine

__all__ = [
    "WEIGHT_TRANSFER_CONFIG",
    "WORKER_EXTENSION",
    "EngineSettings",
    "EngineVerify",
    "Fp8Plan",
    "Fp8Quantizer",
    "HttpWeightTransfer",
    "LocalWeightTransfer",
    "Mode",
    "RayWeightTransfer",
    "Representation",
    "SyncClientTransfer",
    "VllmTarget",
    "WeightTransfer",
    "enable_live_cpu_weights",
    "fp8_plan",
    "reference_for_step",
    "start_engine",
]


def enable_live_cpu_weights() -> None:
    """Keep CPU linear weights live in engines created after this call (see :mod:`.live_cpu`; imports vLLM)."""
    from .live_cpu import enable_live_cpu_weights as enable

    enable()


def __getattr__(name: str) -> Any:
    if name in ("DeltasyncWeightTransferEngine", "DeltasyncUpdateInfo"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
