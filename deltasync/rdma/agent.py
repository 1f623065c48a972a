"""A thin wrapper over one NIXL agent: register memory once, exchange metadata, post prepared READs, poll.

Everything the outbox ring and the inbox need from NIXL goes through here, so that NIXL's API (its names,
string states, handle lifetimes) stays in one module, and the rest of the fast path is plain Python. NIXL is
imported lazily: ``import deltasync`` never loads it, and a missing install says which extra to add.

Memory is registered once at start (registration changes an agent's metadata, so registering later would
make peers' cached metadata stale). CPU tensors register as ``DRAM``; CUDA tensors would register as ``VRAM``
through the same call (NIXL picks the type from the tensor), which is what a GPU cluster uses (docs/RDMA.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from typing_extensions import Self

from deltasync.errors import (
    MissingDependencyError,
    RdmaError,
    RdmaTimeoutError,
)
from deltasync.rdma.options import missing

log = logging.getLogger(__name__)

MemType = Literal["DRAM", "VRAM"]


def _nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as e:
        raise missing("NIXL", e) from None
    return _api


def nixl_available() -> bool:
    """Whether NIXL can be imported here (tests skip on False)."""
    try:
        _nixl()
    except MissingDependencyError:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class Region:
    """A registered buffer as peers address it: start address, size, device id and memory type."""

    addr: int
    nbytes: int
    device: int
    mem_type: MemType

    def chunks(self, chunk_bytes: int, *, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """An Nx3 descriptor array ``(addr, len, device)`` cutting ``offset:offset+nbytes`` into equal chunks."""
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        if nbytes % chunk_bytes or offset + nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes at {offset} do not cut into {chunk_bytes}-byte chunks of {self}")
        starts = self.addr + offset + np.arange(nbytes // chunk_bytes, dtype=np.uint64) * chunk_bytes
        descs = np.empty((len(starts), 3), dtype=np.uint64)
        descs[:, 0], descs[:, 1], descs[:, 2] = starts, chunk_bytes, self.device
        return descs


class PreparedSide:
    """A descriptor list prepared once (local, or on one remote agent); transfers pick descriptors by index."""

    def __init__(self, handle: Any, count: int) -> None:
        self.handle = handle
        self.count = count


class Agent:
    """One NIXL agent with the UCX backend. Close it (or use it as a context manager) to release NIXL state."""

    def __init__(self, name: str, *, backends: tuple[str, ...] = ("UCX",)) -> None:
        api = _nixl()
        self.name = name
        self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=list(backends)))
        self._registered: list[Any] = []
        self._prepared: list[PreparedSide] = []
        self._remotes: set[str] = set()

    # --- set-up, done once ---

    def register(self, buffer: torch.Tensor) -> Region:
        """Register a contiguous tensor (CPU: DRAM, CUDA: VRAM) for remote access; kept until ``close``."""
        if not buffer.is_contiguous():
            raise ValueError("only a contiguous buffer can be registered")
        self._registered.append(self._agent.register_memory(buffer))
        device = buffer.get_device()
        return Region(addr=buffer.data_ptr(), nbytes=buffer.numel() * buffer.element_size(),
                      device=max(device, 0), mem_type="VRAM" if buffer.is_cuda else "DRAM")

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered regions), for peers' ``add_remote``."""
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name (replacing what was loaded under that name)."""
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001 - a dead peer cannot be disconnected cleanly; nothing to undo
                log.debug("%s: removing remote agent %s: %s", self.name, name, e)

    def prepare(self, descs: np.ndarray, mem_type: MemType, *, remote: str | None = None) -> PreparedSide:
        """Prepare a descriptor list once, locally (``remote=None``) or on a loaded peer."""
        agent = remote if remote is not None else "NIXL_INIT_AGENT"
        side = PreparedSide(self._agent.prep_xfer_dlist(agent, descs, mem_type), len(descs))
        self._prepared.append(side)
        return side

    def release(self, side: PreparedSide) -> None:
        if side in self._prepared:
            self._prepared.remove(side)
            side.handle.release()

    # --- per transfer ---

    def read(self, local: PreparedSide, local_idx: list[int], remote: PreparedSide, remote_idx: list[int], *,
             notif: bytes, timeout_s: float, where: str) -> None:
        """READ the remote descriptors into the local ones and wait; ``notif`` reaches the peer once all landed.

        Raises :class:`RdmaTimeoutError` after ``timeout_s`` (the request is released, which cancels it) and
        :class:`RdmaError` when NIXL reports a failure (a dead peer, unknown memory).
        """
        handle = self.post_read(local, local_idx, remote, remote_idx, notif=notif, where=where)
        try:
            self.wait(handle, deadline=time.monotonic() + timeout_s, where=where)
        finally:
            self.drop(handle, where)

    def post_read(self, local: PreparedSide, local_idx: list[int], remote: PreparedSide, remote_idx: list[int], *,
                  notif: bytes = b"", where: str) -> Any:
        """Start a READ and return its request without waiting (``wait`` for it, then ``drop`` it).

        Several posted reads progress together (NIXL's progress thread), so a caller can work on the bytes of
        one while the next lands: the inbox hashes piece by piece that way."""
        try:
            handle = self._agent.make_prepped_xfer("READ", local.handle, local_idx, remote.handle, remote_idx, notif)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types (nixlNotFoundError, ...) for stale peers
            raise RdmaError(f"{where}: cannot prepare the read ({type(e).__name__}: {e})") from None
        try:
            state = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001
            self.drop(handle, where)
            raise RdmaError(f"{where}: cannot post the read ({type(e).__name__}: {e})") from None
        if state not in ("PROC", "DONE"):
            self.drop(handle, where)
            raise RdmaError(f"{where}: the read failed (NIXL state {state})")
        return handle

    def wait(self, handle: Any, *, deadline: float, where: str) -> None:
        """Poll a posted READ until it is done: :class:`RdmaTimeoutError` past ``deadline`` (monotonic),
        :class:`RdmaError` when NIXL reports a failure."""
        pause = 1e-5
        state = self._state(handle, where)
        while state == "PROC":
            if time.monotonic() > deadline:
                raise RdmaTimeoutError(f"{where}: read not complete by its deadline")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            state = self._state(handle, where)
        if state != "DONE":
            raise RdmaError(f"{where}: the read failed (NIXL state {state})")

    def _state(self, handle: Any, where: str) -> str:
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types (nixlRemoteDisconnectError, ...)
            raise RdmaError(f"{where}: the read failed ({type(e).__name__}: {e})") from None

    def drop(self, handle: Any, where: str) -> None:
        """Release a READ request (cancelling it if it is still in progress)."""
        try:
            handle.release()
        except Exception as e:  # noqa: BLE001 - an uncancellable request is leaked by NIXL, not by us
            log.warning("%s: could not release a transfer request: %s", where, e)

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent."""
        got = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in got.items()}

    def notify(self, peer: str, message: bytes) -> None:
        """A notification not bound to a transfer (no ordering with transfers: use only for credits)."""
        self._agent.send_notif(peer, message)

    # --- teardown ---

    def close(self) -> None:
        for side in list(self._prepared):
            self.release(side)
        for name in list(self._remotes):
            self.remove_remote(name)
        for reg in self._registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:  # noqa: BLE001
                log.debug("%s: deregistering memory: %s", self.name, e)
        self._registered.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
