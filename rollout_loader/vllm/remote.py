"""Keep a vLLM server running the deltasync weight-transfer engine at the newest step of a stream.

Only step numbers travel: this process reads the store's manifests to learn which steps exist, and the
server's engine fetches, verifies and applies each step itself (:mod:`rollout_loader.vllm.engine`). Steps
are sent one at a time along the chain from the step the server holds, so ``/weight_info`` always names a
verified step; a restarted follower asks the server which step it holds instead of replaying the chain.
Imports no vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from deltasync import StreamReader, WaitTimeoutError

from rollout_loader.follower import PERMANENT_ERRORS, retry_delay_s

from .client import HttpWeightTransfer

log = logging.getLogger(__name__)


class ServerFollower:
    """Drive ``server`` (a base URL or an :class:`HttpWeightTransfer`) along the stream at ``url``.

    ``engine_step``: the step the server's weights are at if it has never been updated (it was started from
    that step's replayed checkpoint); ignored when ``/weight_info`` names a step. ``verify``/``mode`` go to the
    server's engine in ``init_info``. ``on_step(step)`` after each step is live; ``on_error(error)`` once per
    distinct error while retrying. Use :meth:`connect` first, then :meth:`sync` or :meth:`follow`.
    """

    def __init__(self, url: str, server: str | HttpWeightTransfer, *, storage_options: dict[str, Any] | None = None,
                 verify: str = "incremental", mode: str = "auto", engine_step: int | None = None,
                 poll_s: float = 0.5, max_backoff_s: float = 30.0, on_step: Callable[[int], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.client = server if isinstance(server, HttpWeightTransfer) else HttpWeightTransfer(server)
        self.url = url
        self.storage_options = storage_options or {}
        self.reader = StreamReader(url, storage_options=storage_options)
        self.verify, self.mode, self.engine_step = verify, mode, engine_step
        self.poll_s, self.max_backoff_s = poll_s, max(max_backoff_s, poll_s)
        self.on_step, self.on_error = on_step, on_error
        self.step: int | None = None  # the step the server holds, as far as this follower knows
        self.last_error: BaseException | None = None
        self._connected = False

    def connect(self) -> int | None:
        """Ask the server which step it holds and point its engine at the stream; returns that step.

        Raises ``EngineConfigError`` (a flag missing), ``EngineUnreachableError``, ``StreamNotFoundError``.
        """
        held = self.client.held_step()
        self.reader.store.require_stream()
        self.step = held if held is not None else self.engine_step
        self.client.init(self.url, storage_options=self.storage_options, verify=self.verify, mode=self.mode, step=self.step)
        self._connected = True
        log.info("server %s holds step %s", self.client.base_url, self.step)
        return self.step

    def sync(self, step: int | None = None) -> list[int]:
        """Bring the server to ``step`` (default: the newest committed), one verified step at a time."""
        if not self._connected:
            self.connect()
        if step is None:
            step = self.reader.latest_step()
            if step is None or step == self.step:
                return []
        applied = []
        for s in self.reader.chain(step, start=self.step):
            self.client.update(s)
            self.step = s
            applied.append(s)
            if self.on_step:
                self.on_step(s)
        return applied

    def follow(self, *, until: int | None = None, timeout_s: float | None = None) -> int | None:
        """Follow until the server holds ``until`` (forever without it), retrying failures with backoff; a
        permanent error (a flag missing, the stream does not fit the model) is raised, and so is the last
        error when ``timeout_s`` runs out (``WaitTimeoutError``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failures, shown = 0, None
        while until is None or self.step is None or self.step < until:
            try:
                self.sync()
                failures, shown, self.last_error = 0, None, None
                delay = self.poll_s
            except PERMANENT_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - retried: the store or the server may come back
                failures += 1
                self.last_error = e
                self._connected = False  # ask the server again which step it holds
                if str(e) != shown:
                    shown = str(e)
                    log.warning("following %s into %s: %s: %s (retrying)", self.url, self.client.base_url, type(e).__name__, e)
                    if self.on_error:
                        self.on_error(e)
                delay = retry_delay_s(failures, poll_s=self.poll_s, max_s=self.max_backoff_s)
            if until is not None and self.step is not None and self.step >= until:
                break
            if deadline is not None and time.monotonic() + delay > deadline:
                e = self.last_error
                raise WaitTimeoutError(
                    f"{self.url}: the server at {self.client.base_url} holds step {self.step}, step {until} not live "
                    f"within {timeout_s}s" + ("" if e is None else f" (last error: {type(e).__name__}: {e})")
                ) from e
            time.sleep(delay)
        return self.step

    def close(self) -> None:
        """Remove the reader's downloads (manifests only; objects are fetched by the server)."""
        self.reader.close()

    def __enter__(self) -> ServerFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
