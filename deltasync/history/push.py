"""Saved checkpoints into a stream: ``push_checkpoint`` publishes a safetensors file or folder as a step."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deltasync.errors import StepOrderError, TensorMismatchError
from deltasync.follow.reader import StreamReader
from deltasync.format._bits import int_view
from deltasync.format.documents import Kind, check_step
from deltasync.history.checkpoints import load_checkpoint
from deltasync.history.rebuild import reconstruct_state_dict
from deltasync.publish.names import named_tensors
from deltasync.publish.steps import snapshot_headers, step_manifest, write_step_object
from deltasync.signing import SigningKey
from deltasync.stages.diff import Snapshot
from deltasync.store import Manifest, open_store
from deltasync.store.location import Where
from deltasync.store.model_files import ModelFiles, collect_model_files, read_model_file_index, store_model_files
from deltasync.trust import own_trust, writer_signer


def push_checkpoint(
    url: Where,
    step: int,
    checkpoint: str | Path,
    *,
    anchor: bool = False,
    dtype: torch.dtype | None = None,
    files: str | Path | ModelFiles | None = None,
    storage_options: dict[str, Any] | None = None,
    take_over: bool = False,
    signing_key: str | Path | SigningKey | None = None,
    stream_id: str | None = None,
) -> Manifest:
    """Publish a safetensors file or a checkpoint folder as ``step`` of a stream; returns its manifest.

    A delta against the stream's latest step, or an anchor when the stream is empty or ``anchor`` is set.
    ``dtype`` publishes floating tensors in that dtype. Model files (``files``, else the folder's own) are
    stored when the stream has none yet. Holds the writer lease while it writes: a running publisher
    makes it fail with ``WriterConflictError`` (``take_over`` to override). ``signing_key`` signs the step
    (docs/FORMAT.md section 5e), as a signing publisher does: for ``stream_id`` (else the stream's own, checked
    against the newest step the key signed), after the newest step the key signed, diffed against that step's
    weights read through the key's own trust (a forged manifest does not exist for it).
    """
    key = signing_key if signing_key is None or isinstance(signing_key, SigningKey) else SigningKey(signing_key)
    store, _ = open_store(url, storage_options)
    check_step(step, what=f"{store.url}: step", error=StepOrderError)
    owner = f"push-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store.acquire_lease(owner, ttl_s=600.0, take_over=take_over, stream_id=stream_id)
    try:
        store.remove_uncommitted(older_than_s=600.0)
        signer, trust = None, None
        if key is not None:
            signer, latest = writer_signer(store, key, stream_id=stream_id)
            trust = own_trust(key, signer.stream_id)
        else:
            committed = store.steps()  # writers trust manifests, never the latest.json hint
            latest = committed[-1] if committed else None
        if latest is not None and step <= latest:
            raise StepOrderError(f"{store.url}: step {step} is not after the stream's latest step {latest}")
        t0 = time.perf_counter()
        tensors = load_checkpoint(checkpoint)
        delta = latest is not None and not anchor
        aliases: dict[str, str] = {}
        if delta:
            base, aliases = named_tensors(reconstruct_state_dict(StreamReader(store, trusted_keys=trust), latest))
            snapshot = Snapshot(base, dtype=dtype)
            del base  # the snapshot's copy is the one we need
            changes = [c for c in snapshot.diff(_without_aliases(tensors, aliases, checkpoint)) if c.changed]
        else:
            snapshot, changes = Snapshot(tensors, dtype=dtype), []
        capture_s = time.perf_counter() - t0
        source = files if files is not None else checkpoint if Path(checkpoint).is_dir() else None
        model_files = collect_model_files(source) if source is not None else {}
        if model_files and read_model_file_index(store) is None:
            _, files_sha256 = store_model_files(store, model_files)
            if signer is not None:
                signer.files_sha256 = files_sha256
        with tempfile.TemporaryDirectory(prefix="deltasync-push-") as tmp:
            kind: Kind = "delta" if delta else "anchor"
            local = Path(tmp) / f"{kind}.safetensors"
            t1 = time.perf_counter()
            header, written = write_step_object(
                local,
                kind=kind,
                step=step,
                base_step=latest if delta else None,
                headers=snapshot_headers(snapshot),
                changes=changes,
                anchor_tensors=None if delta else snapshot.tensors,
                aliases=aliases,
            )
            manifest = step_manifest(written, header, capture_s=capture_s, encode_s=time.perf_counter() - t1)
            store.commit(manifest, local, owner=owner, signer=signer)
            if signer is not None:
                store.refresh_head(signer, closed=True)  # a push is a writer that closes after its step
        return manifest
    finally:
        store.release_lease(owner)


def _without_aliases(tensors: dict[str, torch.Tensor], aliases: Mapping[str, str],
                     where: object) -> dict[str, torch.Tensor]:
    """Drop the stream's tied names from a loaded checkpoint (saved once, or twice with equal bits)."""
    out = dict(tensors)
    for alias, target in aliases.items():
        if alias in out:
            if target in out and not torch.equal(int_view(out[alias].contiguous()), int_view(out[target].contiguous())):
                raise TensorMismatchError(f"{where}: {alias!r} is tied to {target!r} in the stream, but differs from "
                                          "it here")
            del out[alias]
    return out


