"""A read-only window on the deltasync weight-transfer engine of every vLLM worker.

The weight-transfer engine (:mod:`rollout_loader.vllm.engine`) is the one way deltasync writes into vLLM.
This worker extension adds one method that only reads it, for callers that want to see what each rank
holds: in vLLM's multiprocess mode (and over a server's ``/collective_rpc``) a worker is reachable only
through a named method. Use with ``LLM(..., worker_extension_cls="rollout_loader.vllm.worker.DeltaWorkerExtension")``
(:func:`~rollout_loader.vllm.start_engine` sets it), then::

    transfer_status(llm)  # held step, how each step arrived, pauses, checksums of every tensor (ranks added up),
                          # the runtime fingerprint of what the ranks compute with (docs/FORMAT.md section 5f)

Importing this module imports vLLM.
"""

from __future__ import annotations

from typing import Any

from .client import LocalWeightTransfer
from .fingerprint import engine_config, fingerprint_model, rank_and_size
from .live_cpu import LIVE_ENV, install_dispatch_hook

__all__ = ["LIVE_ENV", "DeltaWorkerExtension", "transfer_status"]


def transfer_status(llm: Any, *, checksums: bool = True) -> dict[str, Any]:
    """What the deltasync weight-transfer engine holds, from every rank of an ``LLM`` in any mode.

    Returns ``{"held_step", "arrived": {step: "rdma" | "store: <why>"}, "pauses_s": [...], "checksums",
    "host_bytes"}``
    (see :func:`~rollout_loader.vllm.client.combine_status`; each tensor's checksum with the ranks' parts added
    up, none without ``checksums``). Raises ``EngineError`` when the ranks hold different steps or the engine
    has no initialised deltasync weight-transfer engine, ``EngineConfigError`` without this extension.
    """
    return LocalWeightTransfer(llm).status(checksums=checksums)


class DeltaWorkerExtension:
    """Mixed into every vLLM worker; call its method through ``collective_rpc``. Changes nothing."""

    def deltasync_transfer_status(self, checksums: bool = True) -> dict[str, Any]:
        """This rank's deltasync weight-transfer engine: held step, how each step's object arrived, pauses, and
        (with ``checksums``) the ``mix64-sum`` parts of every checkpoint tensor from the bits as they are.

        A worker without the engine, or one not yet initialised, answers ``{"error": ...}``: an expected
        answer, not a failure of the worker, so nothing is logged and later calls stay in step.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "held_step"):
            return {"error": "this engine has no deltasync weight-transfer engine: start vLLM with "
                             "--weight-transfer-config '{\"backend\": \"deltasync\"}'"}
        state = engine._state  # the routes the engine writes through: its checksums are the engine's bits
        if state is None:
            return {"error": "the deltasync weight-transfer engine is not initialised: call "
                             "init_weight_transfer_engine"}
        rdma = engine._rdma  # its RdmaConsumer (None without init_info rdma)
        return {
            "held_step": engine.held_step,
            "arrived": {str(s): how for s, how in (rdma.arrived if rdma is not None else {}).items()},
            "pauses_s": list(engine.pauses_s),
            "checksums": state.checksums() if checksums else {},
            "host_bytes": int(engine.init_summary.get("host_bytes", 0)),
            "fingerprint": {**engine.fingerprint_status(tensors=checksums), "rank": rank_and_size()[0]},
            "applied_unix_s": engine.applied_unix_s,
            "last_error": engine.last_error,
        }

    def deltasync_fingerprint(self) -> dict[str, Any]:
        """This rank's runtime fingerprint computed now, from the model as it is, with the engine's configuration
        and this rank's index (docs/FORMAT.md section 5f): what ``deltasync fingerprint`` stores as a reference
        from a fresh engine. Needs no deltasync weight-transfer engine; changes nothing."""
        import msgspec

        model = self.model_runner.model  # type: ignore[attr-defined]  # the vLLM worker's
        return {"rank": rank_and_size()[0], "config": engine_config(self.vllm_config),  # type: ignore[attr-defined]
                "fingerprint": msgspec.to_builtins(fingerprint_model(model))}


install_dispatch_hook()
