"""The reference runtime fingerprint of a step: ``deltasync fingerprint``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from deltasync_cli.app import (
    JsonOpt,
    MaxAgeOpt,
    RevokedKeyOpt,
    StorageOpt,
    StreamIdOpt,
    TrustedKeyOpt,
    _location,
    _print_json,
    _trust,
    command,
    inert,
    out,
)


def _engine_args(pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as ``vllm.LLM`` keyword arguments, each value JSON where it parses (``2``, ``true``,
    ``{"backend": ...}``), else the text itself (``bfloat16``)."""
    args: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise typer.BadParameter(f"expected KEY=VALUE with KEY a vLLM engine argument, got {pair!r}",
                                     param_hint="--engine-arg")
        try:
            args[key] = json.loads(value)
        except ValueError:
            args[key] = value
    return args


@command(summary="Store a fresh engine's runtime fingerprint of a step.",
         examples=["deltasync fingerprint s3://bucket/run-7 --step 12",
                   "deltasync fingerprint ./stream --step 12 -E dtype=bfloat16",
                   "deltasync fingerprint ./stream --step 12 --signing-key t.key"])
def fingerprint(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    step: Annotated[int, typer.Option("--step", metavar="STEP", min=0, help="The step to fingerprint.")],
    engine_arg: Annotated[list[str] | None, typer.Option(
        "--engine-arg", "-E", metavar="KEY=VALUE",
        help="A vllm.LLM argument (JSON value, else text), as the followers' engines are started: dtype, "
             "quantization, tensor_parallel_size, ... (in_process=true: in this process); repeatable.")] = None,
    files_from: Annotated[Path | None, typer.Option(
        "--files-from", metavar="DIR", help="A checkpoint folder whose config and tokenizer the replayed step takes, "
                                            "where the stream stores no model files.")] = None,
    stock_cpu_kernels: Annotated[bool, typer.Option(
        "--stock-cpu-kernels", help="On CPU, vLLM's own repacked linears (as followers started without live CPU "
                                    "weights); the default keeps them live, as start_engine does.")] = False,
    signing_key: Annotated[Path | None, typer.Option(
        "--signing-key", metavar="PATH", help="Sign the reference (followers with trusted keys use only signed "
                                              "ones); needs --trusted-key and --stream-id: it is signed for that "
                                              "stream, from signed steps only.")] = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
    trusted_key: TrustedKeyOpt = None,
    revoked_key: RevokedKeyOpt = None,
    stream_id: StreamIdOpt = None,
    max_age_s: MaxAgeOpt = None,
) -> None:
    """Start a fresh vLLM engine from the step's replayed checkpoint, with the engine arguments the followers use,
    and store its runtime fingerprint (every parameter and buffer it computes with, in its own layout) as the
    reference for its configuration and step (docs/FORMAT.md section 5f). Followers of the same configuration
    compare theirs with it after each update; a mismatch undoes the update or marks the engine unhealthy.
    Needs vLLM here. With --signing-key the reference is signed (a stream followed with trusted keys needs it)."""
    from rollout_loader.vllm import reference_for_step

    trust = _trust(trusted_key, revoked_key, stream_id, max_age_s)
    path, ref = reference_for_step(_location(url, storage_option), step, trusted_keys=trust,
                                   files_from=None if files_from is None else str(files_from),
                                   live_cpu_weights=not stock_cpu_kernels, engine_args=_engine_args(engine_arg),
                                   signing_key=signing_key)
    summary = {"path": path, "step": ref.step, "config_key": ref.config_key, "config": ref.config,
               "fingerprint": ref.fingerprint, "ranks": len(ref.ranks),
               "tensors": sum(len(r.tensors) for r in ref.ranks), "opaque": sum(len(r.opaque) for r in ref.ranks),
               "signed": signing_key is not None}
    if as_json:
        _print_json(summary)
        return
    opaque = (f"; {summary['opaque']} module(s) whose kernel copy is opaque to it (oneDNN: not covered)"
              if summary["opaque"] else "")
    out.print(f"{inert(path)}: step {ref.step}, configuration {ref.config_key}, fingerprint {ref.fingerprint[:16]}… "
              f"over {summary['tensors']} tensor(s) on {len(ref.ranks)} rank(s){opaque}"
              f"{', signed' if signing_key else ''}", markup=False, soft_wrap=True)
