"""Checkpoint folders in and out of a stream: loading checkpoints, writing one tensor at a time.

Replay writes the weights here and copies the stream's model files (:mod:`deltasync.store.model_files`) beside them, so
that the folder loads in transformers and vLLM as it is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from deltasync.errors import FormatError
from deltasync.format.documents import (
    TensorHeader,
)

log = logging.getLogger(__name__)

def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file, or of every ``*.safetensors`` shard in a checkpoint folder."""
    import safetensors.torch

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FormatError(f"{path}: no *.safetensors weights in the folder (convert .bin/.pt checkpoints first)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = safetensors.torch.load_file(str(f))
        except Exception as e:  # safetensors raises several types for unreadable files
            raise FormatError(f"{f}: not a readable safetensors file ({e})") from None
        for name in part.keys() & tensors.keys():
            raise FormatError(f"{path}: tensor {name!r} is in more than one shard")
        tensors.update(part)
    return tensors


class CheckpointWriter:
    """Write a safetensors file tensor by tensor, in the order of ``layout``, without holding them all.

    The header is written first (every name, dtype and shape is known from a step header), then each
    tensor's bytes as it arrives; the file is an ordinary safetensors checkpoint.
    """

    def __init__(self, path: str | Path, layout: Mapping[str, TensorHeader], *,
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self._order = list(layout)
        self._next = 0
        entries: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for name, h in layout.items():
            size = h.numel * h.torch_dtype.itemsize
            entries[name] = {"dtype": h.dtype, "shape": list(h.shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data buffer starts 8-byte aligned
        self._file: BinaryIO = open(self.path, "wb")
        self._file.write(len(text).to_bytes(8, "little") + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or name != self._order[self._next]:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing more"
            raise ValueError(f"{self.path}: expected tensor {expected!r} next, got {name!r}")
        if tensor.numel():
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._file.write(memoryview(raw))  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on Python >= 3.12 only
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} tensor(s) were never written")

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
