"""A reference runtime fingerprint: a fresh engine loaded from a step's checkpoint, its fingerprint stored.

Followers of the same configuration compare theirs with it after each update (docs/FORMAT.md section 5f,
:mod:`rollout_loader.vllm.fingerprint`); ``deltasync fingerprint`` runs :func:`reference_for_step`. Imports vLLM
only when it starts the engine.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deltasync.engine import RankFingerprint

__all__ = ["reference_for_step"]


def reference_for_step(url: Any, step: int, *, storage_options: Mapping[str, Any] | None = None,
                       trusted_keys: Any = None, files_from: str | None = None, live_cpu_weights: bool = True,
                       engine_args: Mapping[str, Any] | None = None, signing_key: Any = None,
                       start: Callable[..., Any] | None = None) -> tuple[str, Any]:
    """Start a fresh engine from step ``step``'s replayed checkpoint and store its runtime fingerprint as the
    reference for its configuration and step (docs/FORMAT.md section 5f). Returns (the document's path in the
    stream, the reference).

    Args:
        url, storage_options, trusted_keys: the stream (a URL with its options, a ``StoreLocation``), as a
            reader takes them (with trusted keys, the replay is
            of signed steps only).
        files_from: a checkpoint folder whose non-weight files (config, tokenizer) the replayed folder takes when
            the stream stores none.
        live_cpu_weights, engine_args: the engine's settings (``vllm.LLM`` keyword arguments: dtype,
            quantization, tensor_parallel_size, ...): they must be the followers' for the reference to be theirs.
        signing_key: a :class:`deltasync.engine.SigningKey` (or a path): the reference is signed, as followers with
            trusted keys require. A signature vouches for the step's weights in one stream, so it needs
            ``trusted_keys`` (the replay then reads signed steps only) and signs for their pinned stream, never for
            the ``stream.json`` a bucket writer may have rewritten: ``ConfigError`` without them, ``SignatureError``
            where ``stream.json`` names another stream; both before any engine starts.
        start: how to start the engine (``start_engine``'s signature; tests).

    The engine generates one token before it is fingerprinted: some models convert caches at their first forward
    pass (a serving engine's buffers are those of an engine that generated). Raises what replay and vLLM raise.
    """
    import msgspec

    from deltasync import Store, StreamReader, replay_to_folder
    from deltasync.engine import SigningKey, StoreLocation, make_reference, write_reference
    from deltasync.errors import EngineError

    from .target import start_engine

    where = StoreLocation.of(url, storage_options)
    key = signing_key if signing_key is None or isinstance(signing_key, SigningKey) else SigningKey(signing_key)
    stream_id = None if key is None else _signed_stream(where, step, trusted_keys)
    folder = Path(tempfile.mkdtemp(prefix="deltasync-fingerprint-"))
    try:
        with StreamReader(where, trusted_keys=trusted_keys) as reader:
            replay_to_folder(reader, step, str(folder / "model"))
        if files_from is not None:  # the checkpoint's other files, where the stream stores none
            for f in Path(files_from).iterdir():
                if f.is_file() and not f.name.startswith(".") and f.suffix not in (".safetensors", ".bin", ".pt") \
                        and not f.name.endswith(".index.json") and not (folder / "model" / f.name).exists():
                    shutil.copy(f, folder / "model" / f.name)
        llm = (start or start_engine)(str(folder / "model"), live_cpu_weights=live_cpu_weights,
                                      **dict(engine_args or {}))
        try:
            from vllm import SamplingParams

            llm.generate(["fingerprint"], SamplingParams(max_tokens=1), use_tqdm=False)
            ranks = sorted(llm.collective_rpc("deltasync_fingerprint"), key=lambda r: r["rank"])
        finally:
            _close(llm)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    configs = {json.dumps(r["config"], sort_keys=True) for r in ranks}
    if len(configs) != 1:
        raise EngineError(f"the engine's ranks report different configurations: {sorted(configs)}")
    parsed = [msgspec.convert(r["fingerprint"], RankFingerprint) for r in ranks]
    made_by = f"deltasync fingerprint: a fresh engine from step {step}'s replayed checkpoint on {platform.node()}"
    reference = make_reference(step, ranks[0]["config"], parsed, made_by=made_by)
    with Store(where) as store:
        path = write_reference(store, reference, signing_key=key, stream_id=stream_id)
    return path, reference


def _signed_stream(where: Any, step: int, trusted_keys: Any) -> str:
    """The stream a signed reference of ``step`` is for: the trusted keys' pinned one (``ConfigError`` without trusted
    keys, ``SignatureError`` where ``stream.json`` names another)."""
    from deltasync import Store
    from deltasync.errors import ConfigError, SignatureError

    if trusted_keys is None:
        raise ConfigError(f"{where.url}: signing the reference of step {step} vouches for its weights, so they must "
                          "be read with trusted keys (--trusted-key, --stream-id; trusted_keys=): an unsigned or "
                          "forged step would be vouched for, and every honest follower would undo its step")
    url = where.url
    pinned: str = trusted_keys.stream_id
    with Store(where) as store:
        found = store.stream_id()
    if found is not None and found != pinned:
        raise SignatureError(f"{url}: stream.json names stream {found!r}, the trusted keys are pinned to {pinned!r}: "
                             "no reference is signed for a stream this one is not (a rewritten stream.json, or the "
                             "wrong --stream-id)", url=url, expected=pinned, found=found)
    return pinned


def _close(llm: Any) -> None:
    """Shut an in-process engine down now (vLLM's shutdown is a finalizer; a lingering one breaks the next)."""
    finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
    if finalizer is not None:
        finalizer()
