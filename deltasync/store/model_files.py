"""The model's non-weight files a stream stores beside its steps (config, tokenizer, generation config).

They are stored once, under ``URL/files/``, with ``URL/files.json`` (names, sizes, SHA-256) written last as their
commit marker (docs/FORMAT.md section 5); a signed step names the SHA-256 of that index (section 5e). The publisher
stores them, replay and the mirror read them: they sit with the store, below both.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from deltasync.errors import CorruptObjectError, FormatError, SignatureError
from deltasync.format.documents import MAX_DOCUMENT_BYTES, FileEntry, FilesIndex, check_file_name, decode, encode
from deltasync.signing import sha256_hex
from deltasync.store.stream import Store

__all__ = ["FILES_DIR", "FILES_INDEX", "ModelFiles", "collect_model_files", "read_model_file_index", "read_model_files",
           "store_model_files", "write_model_files"]

log = logging.getLogger(__name__)

FILES_DIR = "files"
FILES_INDEX = "files.json"
ModelFiles = Mapping[str, bytes]

# weights (replay writes its own), their shard indexes (they would name the wrong files), training state
_NOT_MODEL_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.index\.json$|^\..*")


def collect_model_files(source: str | Path | ModelFiles) -> dict[str, bytes]:
    """The non-weight files of a checkpoint folder (config, tokenizer, ...), or a name -> bytes mapping.

    Top-level files only; weights (``*.safetensors``, ``*.bin``, ``*.pt``, ...), shard indexes and hidden
    files are skipped.
    """
    if isinstance(source, Mapping):
        files = {str(name): bytes(data) for name, data in source.items()}
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: not a folder of model files")
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()
                 and not _NOT_MODEL_FILES.match(p.name)}
    for name in files:
        check_file_name(name, what="model file name")
    return files


def write_model_files(store: Store, files: ModelFiles) -> bool:
    """Upload ``files`` under ``URL/files/``, then the index; skipped (returns False) when identical ones are there."""
    return store_model_files(store, files)[0]


def store_model_files(store: Store, files: ModelFiles) -> tuple[bool, str]:
    """``write_model_files``, and the SHA-256 of ``files.json`` as it now stands for ``files``: of the bytes this
    call wrote, or of identical ones it found (what a signing writer's steps name, docs/FORMAT.md section 5e)."""
    index = FilesIndex(files={check_file_name(name, what="model file name"): FileEntry(
        bytes=len(data), sha256=hashlib.sha256(data).hexdigest()) for name, data in files.items()})
    try:
        raw: bytes | None = store.read_bytes(FILES_INDEX, max_bytes=MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        raw = None
    if raw is not None:
        try:
            if decode(raw, FilesIndex, where=f"{store.url}/{FILES_INDEX}") == index:
                return False, sha256_hex(raw)
        except FormatError:
            pass  # replaced below
    data = encode(index, indent=1)
    store.write_many([(content, f"{FILES_DIR}/{name}") for name, content in files.items()])
    store.write_bytes(FILES_INDEX, data)
    log.info("%s: stored model files %s", store.url, sorted(files))
    return True, sha256_hex(data)


def read_model_file_index(store: Store) -> FilesIndex | None:
    """The stream's model files (validated names, sizes, SHA-256), or None when it holds none."""
    try:
        return store.read_document(FILES_INDEX, FilesIndex)
    except FileNotFoundError:
        return None


def read_model_files(store: Store, *, files_sha256: str | None | bool = False,
                     where: str = "") -> dict[str, bytes]:
    """The stream's model files, each checked against the index (empty when the stream has none).

    ``files_sha256`` (a trusted reader: what the signed step they go with names, docs/FORMAT.md section 5e): the
    index must be exactly those bytes; None (the step vouches for no model files) refuses any. Either refusal is a
    ``SignatureError`` naming ``where`` (the step). Left False: no signature is asked for.
    """
    out = {}
    try:
        raw: bytes | None = store.read_bytes(FILES_INDEX, max_bytes=MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        raw = None
    if files_sha256 is not False and raw is not None:
        if files_sha256 is None:
            raise SignatureError(f"{store.url}: the stream holds model files ({FILES_INDEX}), and {where} vouches for "
                                 "none (its signature names no files, or predates signatures that do): they are "
                                 "refused; export the weights alone (replay model_files=False, CLI --weights-only)")
        if sha256_hex(raw) != files_sha256:
            raise SignatureError(f"{store.url}: {FILES_INDEX} is not the one {where} was signed with (SHA-256 "
                                 f"{sha256_hex(raw)[:16]}…, signed {str(files_sha256)[:16]}…): the model files were "
                                 "changed after that step was signed; refused")
    index = None if raw is None else decode(raw, FilesIndex, where=f"{store.url}/{FILES_INDEX}")
    for name, entry in (index.files if index else {}).items():
        try:
            data = store.read_bytes(f"{FILES_DIR}/{name}", max_bytes=entry.bytes)
        except FileNotFoundError:
            raise CorruptObjectError(f"{store.url}: model file {name} is listed in {FILES_INDEX} but missing") from None
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CorruptObjectError(f"{store.url}: model file {name} differs from {FILES_INDEX} (size or SHA-256)")
        out[name] = data
    return out
