"""An anchor read once, on a thread of its own: each tensor lands in its final buffer while the object's
digest (the manifest's algorithm) is computed over the same bytes (``StepObject.read_tensors_hashed``), so
that rebuilding the chain's tensors (decoding the deltas, patching) starts while the anchor is still being
hashed, and the object is read once instead of twice (hashed, then read). Used by
``replay.Chain.open(read_anchor_once=True)``.

Nothing taken from a feed is proven before ``wait`` returned: the chain waits for it before it hands out
anything, its errors included (a corrupt anchor is reported as a ``CorruptObjectError``, as when it was
hashed first).
"""

from __future__ import annotations

import threading

import torch

from deltasync.errors import DeltaSyncError, FormatError
from deltasync.follow.reader import StreamReader
from deltasync.format import digest as digests
from deltasync.format.documents import Manifest
from deltasync.format.objects import StepObject


class AnchorFeed:
    """The tensors of an opened, not yet hashed anchor, read and hashed in file order on a thread."""

    def __init__(self, reader: StreamReader, manifest: Manifest, obj: StepObject) -> None:
        self.obj = obj
        self._reader, self._manifest = reader, manifest
        self._tensors: dict[str, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._done = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltasync-anchor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            algorithm = digests.algorithm_of(self._manifest.objects[0].digest)
            digest = self.obj.read_tensors_hashed(self._landed, algorithm=algorithm, stop=self._stop)
            if digest is None:
                raise FormatError(f"{self.obj.where}: reading the anchor was stopped before its end")
            self._reader.store.check_digest(self._manifest, digest)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            error = e
        with self._cond:
            self._error, self._done = error, True
            self._cond.notify_all()

    def _landed(self, name: str, t: torch.Tensor) -> None:
        with self._cond:
            self._tensors[name] = t
            self._cond.notify_all()

    def take(self, name: str) -> torch.Tensor:
        """The anchor's tensor ``name`` (each is handed out once), waiting until it has landed; not proven
        before ``wait`` returns. Raises a ``DeltaSyncError`` where the read failed (``wait`` raises the cause)."""
        with self._cond:
            while name not in self._tensors and not self._done:
                self._cond.wait()
            t = self._tensors.pop(name, None)
            error = self._error
        if t is None:
            if isinstance(error, DeltaSyncError):
                raise error
            raise FormatError(f"{self.obj.where}: tensor {name!r} could not be read from the anchor ({error!r})")
        return t

    def wait(self) -> None:
        """Return once the whole anchor was read and its digest matched the manifest's; else raise why not
        (``CorruptObjectError`` for a digest that differs)."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop reading (at the next chunk) and drop the tensors not taken."""
        self._stop.set()
        self._thread.join()
        with self._cond:
            self._tensors.clear()
