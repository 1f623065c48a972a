"""Weight history: the exact weights of any step, compare two steps, push checkpoints into a stream.

``replay_to_folder`` writes a step as a checkpoint folder (weights plus the stream's model files) that
transformers and vLLM load as they are; ``reconstruct_state_dict`` and ``reconstruct_tensor`` give the
same weights in memory; ``compare`` says what changed between two steps, per tensor and per layer;
``push_checkpoint`` turns saved checkpoints into steps of a stream. All rebuild tensors one at a time
through a step's chain (``replay.Chain``), each checked against the step's checksums.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ._bits import int_view
from .checkpoints import CheckpointWriter, ModelFiles, collect_model_files, load_checkpoint, read_model_file_index
from .checkpoints import read_model_files, write_model_files
from .checksum import format_checksum, parse_checksum, tensor_checksum
from .diff import Snapshot
from .documents import check_file_name, check_step
from .errors import ChecksumMismatchError, FormatError, OutputExistsError, StepOrderError, TensorMismatchError
from .format import StepHeader
from .publisher import named_tensors, snapshot_headers, step_manifest, write_step
from .reader import StreamReader
from .replay import Chain, ProgressFn, chain_steps, open_reader, require_steps
from .store import Manifest, Store
from .transports import UMASK

WEIGHTS_FILE = "model.safetensors"


# --- replay ---


def reconstruct_state_dict(
    url: str | StreamReader,
    step: int | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, torch.Tensor]:
    """The exact weights of ``step`` (default: latest), every trainer name included (aliases share storage).

    Same result as ``StreamReader.state_dict``, built tensor by tensor: one model copy in memory.
    """
    reader = open_reader(url, storage_options)
    if step is None:
        step = require_steps(reader)[-1]
    with Chain.open(reader, step, progress=progress) as chain:
        rebuilt = dict(chain.tensors(progress=progress))
        out = {name: rebuilt[name] for name in chain.header.tensors}  # the trainer's order
        for alias, target in chain.header.aliases.items():
            out[alias] = out[target]
    return out


def reconstruct_tensor(
    url: str | StreamReader, step: int, name: str, *, storage_options: dict[str, Any] | None = None
) -> torch.Tensor:
    """One tensor of ``step`` (an alias names its target), checked against the step's checksum, without the rest."""
    reader = open_reader(url, storage_options)
    with Chain.open(reader, step) as chain:
        target = chain.header.aliases.get(name, name)
        if target not in chain.header.tensors:
            some = ", ".join(list(chain.header.tensors)[:3])
            raise TensorMismatchError(f"{reader.url} step {step}: no tensor {name!r} (it has {len(chain.header.tensors)}: {some}, ...)")
        return next(chain.tensors([target]))[1]


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """What ``replay_to_folder`` wrote."""

    step: int
    path: str
    chain: tuple[int, ...]
    tensors: int
    weights_bytes: int
    model_files: tuple[str, ...]
    state_checksum: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def replay_to_folder(
    url: str | StreamReader,
    step: int,
    out_dir: str | Path,
    *,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    reread: bool = False,
    progress: ProgressFn | None = None,
) -> ReplayResult:
    """Write the exact weights of ``step`` as a checkpoint folder that transformers and vLLM load as it is.

    The folder holds the stream's model files (config, tokenizer, ...) and ``model.safetensors`` (tied
    aliases left out, as ``save_pretrained`` does). It is written beside ``out_dir`` and renamed into place
    only once every tensor's checksum matched step ``step``'s header and manifest; ``reread`` also reads
    the written file back and checksums it. An existing non-empty ``out_dir`` is replaced only with
    ``overwrite``.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    if out.is_symlink():  # write where the link points: the link itself stays as the user made it
        out = out.resolve()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"{out}: already exists and is not empty (pass overwrite=True, CLI --overwrite)")
    reader = open_reader(url, storage_options)
    with Chain.open(reader, step, progress=progress) as chain:
        header = chain.header
        files = read_model_files(reader.store)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        try:
            tmp.chmod(0o777 & ~UMASK)  # mkdtemp makes 0700: the folder is for other users too (servers)
            for name, data in files.items():
                confined(tmp, name).write_bytes(data)
            weights = tmp / WEIGHTS_FILE
            meta = {"deltasync_step": str(step), "deltasync_state_checksum": header.state_checksum}
            order = chain.order()  # the file holds the tensors in the order they are rebuilt in
            with CheckpointWriter(weights, {n: header.tensors[n] for n in order}, metadata=meta) as writer:
                for name, t in chain.tensors(order, progress=progress):
                    writer.write(name, t)
            if reread:
                _check_written(weights, header, progress)
            _move_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ReplayResult(
        step=step,
        path=str(out),
        chain=tuple(chain.steps),
        tensors=len(header.tensors),
        weights_bytes=(out / WEIGHTS_FILE).stat().st_size,
        model_files=tuple(sorted(files)),
        state_checksum=header.state_checksum,
        seconds=time.perf_counter() - t0,
    )


def _check_written(path: Path, header: StepHeader, progress: ProgressFn | None) -> None:
    import safetensors

    with safetensors.safe_open(str(path), framework="pt") as f:
        for k, (name, th) in enumerate(header.tensors.items()):
            got = tensor_checksum(f.get_tensor(name))
            if got != parse_checksum(th.checksum):
                raise ChecksumMismatchError(
                    f"{path}: tensor {name!r} as written has checksum {format_checksum(got)}, step {header.step} says {th.checksum}"
                )
            if progress:
                progress("re-read and check", k + 1, len(header.tensors))


def confined(folder: Path, name: str) -> Path:
    """``folder / name`` for a plain file name from a store; anything that would leave ``folder`` is refused."""
    check_file_name(name, what=f"file name for {folder}")
    path = folder / name
    if path.parent != folder:
        raise FormatError(f"{name!r} would be written outside {folder}")
    return path


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder to ``out``; an existing ``out`` is moved aside first, then removed."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    tmp.rename(out)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


# --- import ---


def push_checkpoint(
    url: str | Store,
    step: int,
    checkpoint: str | Path,
    *,
    anchor: bool = False,
    dtype: torch.dtype | None = None,
    files: str | Path | ModelFiles | None = None,
    storage_options: dict[str, Any] | None = None,
    take_over: bool = False,
) -> Manifest:
    """Publish a safetensors file or a checkpoint folder as ``step`` of a stream; returns its manifest.

    A delta against the stream's latest step, or an anchor when the stream is empty or ``anchor`` is set.
    ``dtype`` publishes floating tensors in that dtype. Model files (``files``, else the folder's own) are
    stored when the stream has none yet. Holds the writer lease while it writes: a running publisher
    makes it fail with ``WriterConflictError`` (``take_over`` to override).
    """
    store = url if isinstance(url, Store) else Store(url, storage_options=storage_options)
    check_step(step, what=f"{store.url}: step", error=StepOrderError)
    owner = f"push-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store.acquire_lease(owner, ttl_s=600.0, take_over=take_over)
    try:
        store.remove_uncommitted(older_than_s=600.0)
        committed = store.steps()  # writers trust manifests, never the latest.json hint
        latest = committed[-1] if committed else None
        if latest is not None and step <= latest:
            raise StepOrderError(f"{store.url}: step {step} is not after the stream's latest step {latest}")
        t0 = time.perf_counter()
        tensors = load_checkpoint(checkpoint)
        delta = latest is not None and not anchor
        aliases: dict[str, str] = {}
        if delta:
            base, aliases = named_tensors(reconstruct_state_dict(StreamReader(store), latest))
            snapshot = Snapshot(base, dtype=dtype)
            del base  # the snapshot's copy is the one we need
            changes = [c for c in snapshot.diff(_without_aliases(tensors, aliases, checkpoint)) if c.changed]
        else:
            snapshot, changes = Snapshot(tensors, dtype=dtype), []
        capture_s = time.perf_counter() - t0
        source = files if files is not None else checkpoint if Path(checkpoint).is_dir() else None
        model_files = collect_model_files(source) if source is not None else {}
        if model_files and read_model_file_index(store) is None:
            write_model_files(store, model_files)
        with tempfile.TemporaryDirectory(prefix="deltasync-push-") as tmp:
            kind = "delta" if delta else "anchor"
            local = Path(tmp) / f"{kind}.safetensors"
            t1 = time.perf_counter()
            header = write_step(
                local,
                kind=kind,
                step=step,
                base_step=latest if delta else None,
                headers=snapshot_headers(snapshot),
                changes=changes,
                anchor_tensors=None if delta else snapshot.tensors,
                aliases=aliases,
            )
            manifest = step_manifest(local, header, capture_s=capture_s, encode_s=time.perf_counter() - t1)
            store.commit(manifest, local, owner=owner)
        return manifest
    finally:
        store.release_lease(owner)


def _without_aliases(tensors: dict[str, torch.Tensor], aliases: Mapping[str, str], where: object) -> dict[str, torch.Tensor]:
    """Drop the stream's tied names from a loaded checkpoint (saved once, or twice with equal bits)."""
    out = dict(tensors)
    for alias, target in aliases.items():
        if alias in out:
            if target in out and not torch.equal(int_view(out[alias].contiguous()), int_view(out[target].contiguous())):
                raise TensorMismatchError(f"{where}: {alias!r} is tied to {target!r} in the stream, but differs from it here")
            del out[alias]
    return out


# --- compare ---

_LAYER = re.compile(r"^(.*?\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``;
    names without a layer number lose their last part (``model.embed_tokens.weight`` -> ``model.embed_tokens``).
    """
    m = _LAYER.match(name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


@dataclass(frozen=True, kw_only=True)
class Difference:
    """How one tensor (or one layer's tensors together) changed between two steps."""

    name: str
    numel: int
    changed: int  # elements whose bits differ
    l2_base: float  # ||a||
    l2_change: float  # ||b - a||
    max_abs_change: float

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def rel_l2(self) -> float | None:
        """||b - a|| / ||a||; None when a is all zeros and something changed."""
        if self.l2_change == 0:
            return 0.0
        return self.l2_change / self.l2_base if self.l2_base else None

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "density": self.density, "rel_l2": self.rel_l2}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Per tensor and per layer (``layer_of``), what changed from step ``a`` to step ``b``."""

    url: str
    a: int
    b: int
    tensors: tuple[Difference, ...]
    layers: tuple[Difference, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "a": self.a,
            "b": self.b,
            "tensors": [t.to_dict() for t in self.tensors],
            "layers": [t.to_dict() for t in self.layers],
        }


def compare(
    url: str | StreamReader, a: int, b: int, *, storage_options: dict[str, Any] | None = None, progress: ProgressFn | None = None
) -> Comparison:
    """What changed from step ``a`` to step ``b`` (either order): elements, relative L2, largest change.

    Both states are rebuilt tensor by tensor (one chain walk when ``a`` lies on ``b``'s chain).
    """
    reader = open_reader(url, storage_options)
    diffs: dict[str, Difference] = {}
    if a in chain_steps(reader, b):
        with Chain.open(reader, b, progress=progress) as chain:
            names = list(chain.header.tensors)
            at = chain.steps.index(a)
            for rebuilt in chain.rebuild(keep=at, progress=progress):
                chain.check(rebuilt)
                diffs[rebuilt.name] = _difference(rebuilt.name, rebuilt.kept, rebuilt.tensor)
    else:
        with Chain.open(reader, a, progress=progress) as ca, Chain.open(reader, b, progress=progress) as cb:
            if ca.header.tensors.keys() != cb.header.tensors.keys():
                raise TensorMismatchError(f"{reader.url}: steps {a} and {b} hold different tensor names")
            names = list(cb.header.tensors)
            order = cb.order()
            for (name, ta), (_, tb) in zip(ca.tensors(order), cb.tensors(order, progress=progress)):
                if ta.shape != tb.shape or ta.dtype != tb.dtype:
                    raise TensorMismatchError(f"{reader.url}: tensor {name!r} is {ta.shape} {ta.dtype} at step {a}, {tb.shape} {tb.dtype} at step {b}")
                diffs[name] = _difference(name, ta, tb)
    ordered = [diffs[name] for name in names]  # the trainer's order
    return Comparison(url=reader.url, a=a, b=b, tensors=tuple(ordered), layers=tuple(_by_layer(ordered)))


def _difference(name: str, a: torch.Tensor, b: torch.Tensor) -> Difference:
    changed = int((int_view(a) != int_view(b)).sum()) if a.numel() else 0
    wide = torch.float32 if a.is_floating_point() and a.element_size() <= 4 else torch.float64
    fa = a.to(wide)
    l2_base = float(torch.linalg.vector_norm(fa)) if a.numel() else 0.0
    l2_change = max_abs = 0.0
    if changed:
        d = b.to(wide) - fa
        l2_change = float(torch.linalg.vector_norm(d))
        max_abs = float(d.abs().max())
    return Difference(name=name, numel=a.numel(), changed=changed, l2_base=l2_base, l2_change=l2_change, max_abs_change=max_abs)


def _by_layer(diffs: Iterable[Difference]) -> list[Difference]:
    groups: dict[str, list[Difference]] = {}
    for d in diffs:
        groups.setdefault(layer_of(d.name), []).append(d)
    return [
        Difference(
            name=layer,
            numel=sum(d.numel for d in ds),
            changed=sum(d.changed for d in ds),
            l2_base=math.sqrt(sum(d.l2_base**2 for d in ds)),
            l2_change=math.sqrt(sum(d.l2_change**2 for d in ds)),
            max_abs_change=max(d.max_abs_change for d in ds),
        )
        for layer, ds in groups.items()
    ]
