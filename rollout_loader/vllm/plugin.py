"""vLLM plugin entry point: registers the deltasync weight-transfer engines (receiving and trainer) in every vLLM
process.

Declared in pyproject.toml as ``[project.entry-points."vllm.general_plugins"] deltasync =
"rollout_loader.vllm.plugin:register"``; vLLM calls it in each process it starts (API server, engine core,
workers) before any model loads. Registration is by module path, so the engine module (which imports vLLM)
loads only when a server is started with ``--weight-transfer-config '{"backend": "deltasync"}'``. Calling
it again is harmless. Importing this module imports nothing from vLLM.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

BACKEND = "deltasync"


def register() -> None:
    """Register ``"deltasync"`` with ``WeightTransferEngineFactory`` (the receiving engine) and
    ``WeightTransferTrainerFactory`` (the trainer engine, :mod:`rollout_loader.vllm.trainer`), once per process,
    and hook vLLM's CPU GEMM dispatch so ``DELTASYNC_CPU_LIVE_WEIGHTS=1`` keeps CPU linear weights live."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from .live_cpu import install_dispatch_hook

    install_dispatch_hook()
    for factory, module, name in ((WeightTransferEngineFactory, "rollout_loader.vllm.engine",
                                   "DeltasyncWeightTransferEngine"),
                                  (WeightTransferTrainerFactory, "rollout_loader.vllm.trainer",
                                   "DeltasyncTrainerEngine")):
        if BACKEND in factory._registry:  # registered already (by this plugin or the user)
            continue
        try:
            factory.register_engine(BACKEND, module, name)
        except ValueError as e:  # another thread or plugin won the race: what is registered stays
            log.debug("deltasync %s already registered: %s", name, e)
