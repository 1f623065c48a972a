"""Plant damage in a stream (for the verify, replay and CLI tests): objects, headers, manifests."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import blake3
import safetensors
import safetensors.torch

from deltasync.format.checksum import state_checksum
from deltasync.store import MANIFEST, Store, step_dir


def object_path(store: Store, step: int) -> Path:
    return Path(store.path(step_dir(step), store.manifest(step).object))


def write_manifest(store: Store, step: int, **changes) -> None:
    m = replace(store.manifest(step), **changes)
    store.write_bytes(f"{step_dir(step)}/{MANIFEST}", m.to_json().encode())


def digest_fields(manifest_digest: str | None, data: bytes) -> dict[str, str]:
    """The manifest field that makes ``data`` agree with a manifest of digest ``manifest_digest`` (None: SHA-256,
    versions 1 and 2; ``"blake3"``: version 3), hashed here with hashlib and blake3 directly (FORMAT.md 1b)."""
    if manifest_digest is None:
        return {"object_sha256": hashlib.sha256(data).hexdigest()}
    assert manifest_digest == "blake3"
    return {"object_digest": "blake3:" + blake3.blake3(data).hexdigest()}


def write_manifest_agreeing(store: Store, step: int, data: bytes, **changes) -> None:
    """Rewrite step ``step``'s one-object manifest so that its size and digest are those of ``data``."""
    write_manifest(store, step, object_bytes=len(data), **digest_fields(store.manifest(step).digest, data), **changes)


def rewrite_header(store: Store, step: int, mutate: Callable[[dict], None], *,
                   keep_state_checksum: bool = False) -> None:
    """Rewrite a step's object with ``mutate(header)`` applied, and its manifest to match the new bytes.

    Unless ``keep_state_checksum``, the header's state checksum is recomputed from its tensor checksums, so
    that the header is self-consistent and agrees with the manifest (only replaying can find the damage).
    """
    path = object_path(store, step)
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    header = json.loads(metadata["deltasync"])
    mutate(header)
    if not keep_state_checksum:
        header["state_checksum"] = state_checksum({n: t["checksum"] for n, t in header["tensors"].items()})
    metadata["deltasync"] = json.dumps(header)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    data = path.read_bytes()
    write_manifest_agreeing(store, step, data, state_checksum=header["state_checksum"])


def wrong_checksum(header: dict) -> None:
    """Change the checksum of the first changed tensor (of any tensor in an anchor)."""
    name = next(n for n, t in header["tensors"].items() if t["changed"] or header["kind"] == "anchor")
    old = int(header["tensors"][name]["checksum"], 16)
    header["tensors"][name]["checksum"] = f"0x{(old + 1) % (1 << 64):016x}"


def damage_blob(store: Store, step: int) -> str:
    """Flip bytes inside a delta's first values blob, keeping the manifest consistent (the digest passes):
    only decoding finds it. Returns the tensor's name."""
    path = object_path(store, step)
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    key = sorted(k for k in tensors if k.endswith(":values"))[0]
    blob = tensors[key]
    blob[len(blob) // 2 : len(blob) // 2 + 8] ^= 0xFF
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    data = path.read_bytes()
    write_manifest_agreeing(store, step, data)
    return key.rsplit(":", 1)[0]
