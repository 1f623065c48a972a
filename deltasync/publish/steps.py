"""One step's object and manifest, written from what the diff captured (docs/FORMAT.md sections 2 and 5).

Kept apart from the publisher's threading so that tools (the CLI's ``diff``, benchmarks, tests) write
objects the same way the publisher does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from deltasync.format import digest as digests
from deltasync.format._bits import dtype_name
from deltasync.format.checksum import format_checksum, state_checksum
from deltasync.format.codecs import EncodedTensor, encode_patch
from deltasync.format.documents import AnchorDelta, ManifestStats, Part, object_digest_fields
from deltasync.format.objects import (
    Destination,
    Kind,
    StepHeader,
    TensorHeader,
    WrittenObject,
    write_anchor,
    write_delta,
)
from deltasync.format.patch import Patch
from deltasync.stages.diff import Snapshot
from deltasync.store import Manifest
from deltasync.threads import parallel_map

__all__ = ["anchor_delta", "snapshot_headers", "step_manifest", "write_step", "write_step_object"]


def write_step(
    path: str | Path,
    *,
    kind: Kind,
    step: int,
    base_step: int | None,
    headers: dict[str, TensorHeader],
    changes: Sequence[Patch] = (),
    anchor_tensors: dict[str, torch.Tensor] | None = None,
    aliases: dict[str, str] | None = None,
    zstd_level: int = 1,
) -> StepHeader:
    """Encode and write one step's object to a local file; returns its header (see ``write_step_object``)."""
    header, _ = write_step_object(
        path, kind=kind, step=step, base_step=base_step, headers=headers, changes=changes,
        anchor_tensors=anchor_tensors, aliases=aliases, zstd_level=zstd_level,
    )
    return header


def write_step_object(
    dest: Destination,
    *,
    kind: Kind,
    step: int,
    base_step: int | None,
    headers: dict[str, TensorHeader],
    changes: Sequence[Patch] = (),
    anchor_tensors: dict[str, torch.Tensor] | None = None,
    aliases: dict[str, str] | None = None,
    zstd_level: int = 1,
) -> tuple[StepHeader, WrittenObject]:
    """Encode and write one step's object to ``dest`` (a path or a binary file, ``io.BytesIO`` to keep it
    in memory); returns its header and the size and digest of the bytes written (hashed as they went out).

    ``headers`` describe every tensor after the step (checksums included); ``changes`` are a delta's
    changed tensors, ``anchor_tensors`` an anchor's full tensors.
    """
    headers = dict(headers)
    encoded: dict[str, EncodedTensor] = {}
    encodings = parallel_map(lambda c: encode_patch(c, zstd_level=zstd_level), changes, cost=lambda c: c.changed)
    for c, enc in zip(changes, encodings, strict=True):
        encoded[c.name] = enc
        headers[c.name] = replace(headers[c.name], changed=c.changed, positions=enc.positions_chain,
                                  values=enc.values_chain)
    header = StepHeader(
        kind=kind,
        step=step,
        base_step=base_step,
        state_checksum=state_checksum({n: h.checksum for n, h in headers.items()}),
        tensors=headers,
        aliases=dict(aliases or {}),
    )
    if kind == "anchor":
        written = write_anchor(dest, header, anchor_tensors or {})
    else:
        written = write_delta(dest, header, encoded)
    return header, written


def step_manifest(
    source: str | Path | WrittenObject,
    header: StepHeader,
    *,
    coalesced: Sequence[int] = (),
    capture_s: float = 0.0,
    encode_s: float = 0.0,
    delta: AnchorDelta | None = None,
) -> Manifest:
    """The manifest that commits an object (docs/FORMAT.md section 5): ``source`` is what its writer
    reported (size and digest taken while writing), or a path, hashed here (with the writers' algorithm).
    ``delta``: an anchor's own delta object (:func:`anchor_delta`)."""
    if isinstance(source, WrittenObject):
        written = source
    else:
        written = WrittenObject(digest=digests.of_file(source, digests.write_algorithm()),
                                nbytes=Path(source).stat().st_size)
    algorithm = digests.algorithm_of(written.digest)
    if delta is not None and digests.algorithm_of(delta.part.digest) != algorithm:
        raise ValueError(f"step {header.step}: the anchor's own delta is digested with "
                         f"{digests.algorithm_of(delta.part.digest)}, the anchor with {algorithm}")
    return Manifest(
        step=header.step,
        base_step=header.base_step,
        kind=header.kind,
        # a name no other attempt at this step uses: an upload never touches another writer's object
        object=f"{header.kind}-{written.hex16}.safetensors",
        object_bytes=written.nbytes,
        **object_digest_fields(written.digest, sha256_version=1),
        state_checksum=header.state_checksum,
        created_unix_s=time.time(),
        stats=ManifestStats(
            numel=header.numel,
            changed=header.changed if header.kind == "delta" else header.numel,
            density=header.changed / header.numel if header.kind == "delta" and header.numel else 1.0,
            coalesced_steps=tuple(coalesced),
            capture_s=round(capture_s, 6),
            encode_s=round(encode_s, 6),
        ),
        delta=delta,
    )


def anchor_delta(written: WrittenObject, base_step: int) -> AnchorDelta:
    """The manifest entry of an anchor's own delta object, written as ``written`` (docs/FORMAT.md section 5)."""
    part = Part.of(object=f"delta-{written.hex16}.safetensors", object_bytes=written.nbytes, digest=written.digest)
    return AnchorDelta(base_step=base_step, object=part.object, object_bytes=part.object_bytes,
                       object_sha256=part.object_sha256, object_digest=part.object_digest)


def snapshot_headers(snapshot: Snapshot) -> dict[str, TensorHeader]:
    """Unchanged-tensor header entries for the snapshot's current state."""
    return {
        name: TensorHeader(
            dtype=dtype_name(t.dtype), shape=tuple(t.shape), changed=0,
            checksum=format_checksum(snapshot.checksums[name])
        )
        for name, t in snapshot.tensors.items()
    }
