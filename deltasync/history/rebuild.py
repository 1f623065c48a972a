"""The exact weights of any step: in memory (``reconstruct_state_dict``, ``reconstruct_tensor``) or as a
checkpoint folder that transformers and vLLM load as it is (``replay_to_folder``), each tensor rebuilt through
the step's chain (``replay.Chain``) and checked against the step's checksums.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from deltasync.errors import (
    ChecksumMismatchError,
    ConfigError,
    FormatError,
    MissingDependencyError,
    OutputExistsError,
    TensorMismatchError,
)
from deltasync.follow.reader import StreamReader
from deltasync.format.checksum import format_checksum, parse_checksum, tensor_checksum
from deltasync.format.documents import check_file_name
from deltasync.format.objects import StepHeader
from deltasync.history.checkpoints import CheckpointWriter
from deltasync.history.replay import Chain, ProgressFn, reader_of, require_steps
from deltasync.store.model_files import read_model_files
from deltasync.transports import UMASK

WEIGHTS_FILE = "model.safetensors"



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
    reader = reader_of(url, storage_options)
    if step is None:
        step = require_steps(reader)[-1]
    with Chain.open(reader, step, progress=progress, read_anchor_once=True) as chain:
        rebuilt = dict(chain.tensors(progress=progress))
        out = {name: rebuilt[name] for name in chain.header.tensors}  # the trainer's order
        for alias, target in chain.header.aliases.items():
            out[alias] = out[target]
    return out


def reconstruct_tensor(
    url: str | StreamReader, step: int, name: str, *, storage_options: dict[str, Any] | None = None
) -> torch.Tensor:
    """One tensor of ``step`` (an alias names its target), checked against the step's checksum, without the rest."""
    reader = reader_of(url, storage_options)
    with Chain.open(reader, step) as chain:
        target = chain.header.aliases.get(name, name)
        if target not in chain.header.tensors:
            some = ", ".join(list(chain.header.tensors)[:3])
            raise TensorMismatchError(f"{reader.url} step {step}: no tensor {name!r} (it has "
                                      f"{len(chain.header.tensors)}: {some}, ...)")
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
    sign_with: str | Path | None = None,
    model_files: bool = True,
) -> ReplayResult:
    """Write the exact weights of ``step`` as a checkpoint folder that transformers and vLLM load as it is.

    The folder holds the stream's model files (config, tokenizer, ...) and ``model.safetensors`` (tied
    aliases left out, as ``save_pretrained`` does). It is written beside ``out_dir`` and renamed into place
    only once every tensor's checksum matched step ``step``'s header and manifest; ``reread`` also reads
    the written file back and checksums it. An existing non-empty ``out_dir`` is replaced only with
    ``overwrite``.

    With trusted keys (the reader's), the model files are written only when the step's signature names
    ``files.json`` as stored (docs/FORMAT.md section 5e); otherwise ``SignatureError``, and nothing is written.
    ``model_files=False`` writes the weights alone.

    ``sign_with`` (an ECDSA private key in PEM, ``deltasync keygen --ecdsa``) signs the folder with the OpenSSF
    ``model_signing`` library (``model.sig`` inside it, written before the folder is renamed into place), so
    that the exported weights carry provenance that tool verifies outside deltasync (extra ``sign``).
    """
    t0 = time.perf_counter()
    # absolute: "." or "out/.." name a folder too (written beside it, then renamed into place); a link is
    # followed: the link itself stays as the user made it
    out = Path(out_dir).resolve()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"{out}: already exists and is not empty (pass overwrite=True, CLI --overwrite)")
    if sign_with is not None:
        check_export_key(sign_with)  # before the replay's minutes, not after them
    reader = reader_of(url, storage_options)
    with Chain.open(reader, step, progress=progress) as chain:
        header = chain.header
        if not model_files:
            files = {}
        elif reader.trusted is not None:  # model files only as the step's signature names them
            signed = reader.signed(step)
            files = read_model_files(reader.store, files_sha256=None if signed is None else signed.files_sha256,
                                     where=f"step {step}")
        else:
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
            if sign_with is not None:
                sign_folder(tmp, sign_with)
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


MODEL_SIGNATURE = "model.sig"


def check_export_key(key: str | Path) -> None:
    """Check that ``key`` can sign an export: the ``sign`` extra is installed (``MissingDependencyError``) and
    the file is an unencrypted elliptic-curve private key in PEM (``ConfigError`` otherwise, naming what it is:
    an Ed25519 key from a plain ``deltasync keygen`` signs steps, not exports, which OpenSSF model_signing
    verifies with ECDSA keys only)."""
    try:
        import model_signing  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(f"signing an export needs OpenSSF model_signing ({e}): pip install "
                                     "'deltasync[sign]'", name="model_signing") from None
    from deltasync.signing import need_cryptography

    need_cryptography("signing an export")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        data = Path(key).read_bytes()
    except OSError as e:
        raise ConfigError(f"export signing key {key} (sign_with, CLI --sign): cannot read it "
                          f"({e.strerror or e})") from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"export signing key {key} (sign_with, CLI --sign): expected an ECDSA private key in PEM "
                          f"without a password (deltasync keygen --ecdsa), got something else ({e})") from None
    if not isinstance(private, ec.EllipticCurvePrivateKey):
        kind = type(private).__name__.removesuffix("PrivateKey").lstrip("_") or type(private).__name__
        raise ConfigError(f"export signing key {key} (sign_with, CLI --sign): expected an ECDSA private key (deltasync "
                          f"keygen --ecdsa), got an {kind} key"
                          + (" (a plain deltasync keygen key signs steps; OpenSSF model_signing verifies exports "
                             "signed with ECDSA keys only)" if "Ed25519" in kind else ""))


def sign_folder(folder: Path, key: str | Path) -> Path:
    """Sign every file of ``folder`` with OpenSSF ``model_signing`` (elliptic-curve key, PEM) into
    ``folder/model.sig``, which ``model_signing verify key --signature model.sig --public_key KEY.pub FOLDER``
    checks. Raises ``MissingDependencyError`` without the ``sign`` extra, ``ConfigError`` for a bad key
    (:func:`check_export_key`)."""
    check_export_key(key)
    from model_signing import signing

    signature = folder / MODEL_SIGNATURE
    try:
        signing.Config().use_elliptic_key_signer(private_key=key).sign(folder, signature)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"{key}: cannot sign with it ({type(e).__name__}: {e}); expected an ECDSA private key in PEM "
                          "(deltasync keygen --ecdsa)") from None
    return signature


def _check_written(path: Path, header: StepHeader, progress: ProgressFn | None) -> None:
    import safetensors

    with safetensors.safe_open(str(path), framework="pt") as f:
        for k, (name, th) in enumerate(header.tensors.items()):
            got = tensor_checksum(f.get_tensor(name))
            if got != parse_checksum(th.checksum):
                raise ChecksumMismatchError(
                    f"{path}: tensor {name!r} as written has checksum {format_checksum(got)}, step {header.step} says "
                    f"{th.checksum}"
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


