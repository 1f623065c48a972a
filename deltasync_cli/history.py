"""History commands: replay, push, compare, stats, verify, gc."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from deltasync_cli.app import (
    JsonOpt,
    MaxAgeOpt,
    RevokedKeyOpt,
    StorageOpt,
    StreamIdOpt,
    TrustedKeyOpt,
    _dtype,
    _location,
    _mb,
    _num,
    _pct,
    _print_json,
    _progress,
    _reader,
    _trust,
    command,
    fit_names,
    inert,
    out,
    shown,
)


@command(summary="Write any step's exact weights as a checkpoint folder.",
         examples=["deltasync replay s3://bucket/run-7 --step 12 -o ./step12",
                   "deltasync replay ./stream --step 12 -o ./step12 --sign export.key"])
def replay(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    step: Annotated[int, typer.Option("--step", metavar="STEP", help="Step to replay.")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="DIR",
                                                           help="Checkpoint folder to write (absent or empty).")],
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
    reread: Annotated[bool, typer.Option("--reread", help="Also read the written file back and checksum it.")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
    trusted_key: TrustedKeyOpt = None,
    revoked_key: RevokedKeyOpt = None,
    stream_id: StreamIdOpt = None,
    max_age_s: MaxAgeOpt = None,
    sign: Annotated[Path | None, typer.Option("--sign", metavar="PATH",
                                         help="An ECDSA private key (deltasync keygen --ecdsa): sign "
                                              "the folder with OpenSSF model_signing (model.sig inside).")] = None,
    weights_only: Annotated[bool, typer.Option("--weights-only", help="Write the weights alone, not the stream's "
                                               "model files (config, tokenizer, code).")] = False,
) -> None:
    """Write the exact weights of a step as a checkpoint folder that transformers and vLLM load as it is.

    Written beside the folder and renamed into place only after every checksum matched the step's manifest
    (and, with --trusted-key, every step of its chain was signed by a trusted key, and the model files are the
    ones the step's signature names).
    """
    from deltasync.history.rebuild import replay_to_folder

    trust = _trust(trusted_key, revoked_key, stream_id, max_age_s)
    with _reader(url, storage_option, trust) as reader, _progress() as progress:
        reader.store.download_progress = progress
        r = replay_to_folder(reader, step, output, overwrite=overwrite, reread=reread, progress=progress,
                             sign_with=sign, model_files=not weights_only)
    if as_json:
        _print_json(r.to_dict())
        return
    out.print(f"{r.path}: step {r.step} from anchor {r.chain[0]} + {len(r.chain) - 1} delta(s), {r.tensors} tensors, "
              f"{_mb(r.weights_bytes)} of weights + {len(r.model_files)} model files in {r.seconds:.2f}s; "
              f"checksums match the manifest (state {r.state_checksum[:16]}…)", soft_wrap=True, markup=False)
    if not r.model_files and not weights_only:
        out.print("note: the stream holds no model files (config, tokenizer): publish with files=... or push a folder",
                  soft_wrap=True, markup=False)


@command(summary="Publish a safetensors checkpoint as the next step.",
         examples=["deltasync push ./stream ./finetuned --step 13",
                   "deltasync push ./stream model.safetensors --step 13 --dtype bfloat16"])
def push(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT",
                                               help="A .safetensors file or a checkpoint folder.", exists=True)],
    step: Annotated[int, typer.Option("--step", metavar="STEP",
                                                help="Step number to publish it as (after the latest).")],
    anchor: Annotated[bool, typer.Option(help="Publish a full anchor instead of a delta.")] = False,
    dtype: Annotated[str | None, typer.Option(metavar="DTYPE",
                                              help="Publish floating tensors in this dtype (e.g. bfloat16).")] = None,
    files: Annotated[Path | None, typer.Option(metavar="DIR",
                                               help="Folder of model files to store (default: the checkpoint "
                                                    "folder's).")] = None,
    take_over: Annotated[bool, typer.Option(help="Take the stream over from a publisher that holds it.")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
    signing_key: Annotated[Path | None, typer.Option("--signing-key", metavar="PATH",
                                                help="Sign the step with this private key "
                                                     "(deltasync keygen), as a signing publisher does.")] = None,
    stream_id: Annotated[str | None, typer.Option("--stream-id", metavar="ID",
                                             help="The stream's id (a new stream is made with it; "
                                                  "an existing one must have it).")] = None,
) -> None:
    """Publish a safetensors checkpoint as a step: a delta on the latest step (an anchor on an empty stream)."""
    from deltasync.history.push import push_checkpoint
    from deltasync.store import Store

    with Store(_location(url, storage_option)) as store:
        m = push_checkpoint(store, step, checkpoint, anchor=anchor, dtype=_dtype(dtype), files=files,
                            take_over=take_over, signing_key=signing_key, stream_id=stream_id)
    if as_json:
        _print_json(m.to_dict())
        return
    on = "" if m.base_step is None else f" on step {m.base_step}"
    out.print(f"{url}: pushed {checkpoint} as step {m.step} ({m.kind}{on}), {_mb(m.object_bytes)}, "
              f"{m.stats.changed:,} of {m.stats.numel:,} elements ({_pct(m.stats.density)})", soft_wrap=True,
              markup=False)


@command("catchup", summary="Write catch-up deltas for followers that fall behind.",
         examples=["deltasync catchup s3://bucket/run-7 --follow",
                   "deltasync catchup ./stream --distances 8,32,128 --no-consumers",
                   "deltasync catchup ./stream --signing-key trainer.key --stream-id run-7"])
def catchup(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    distances: Annotated[str, typer.Option(metavar="D,D,...", help="Aligned catch-ups of these step distances "
                                           "(each >= 2; empty: none).")] = "4,16,64",
    consumers: Annotated[bool, typer.Option(help="Also one from each lagging consumer's step (its heartbeat) to "
                                            "the newest step.")] = True,
    min_lag: Annotated[int, typer.Option(min=2, metavar="STEPS", help="A consumer this far behind gets "
                                         "one.")] = 4,
    follow_: Annotated[bool, typer.Option("--follow", help="Keep going: a pass after every new step (default: "
                                          "one pass).")] = False,
    poll_s: Annotated[float, typer.Option(min=0.05, metavar="SECONDS", help="With --follow: seconds between "
                                          "polls.")] = 5.0,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
    signing_key: Annotated[Path | None, typer.Option("--signing-key", metavar="PATH",
                                                help="A signed stream's private key (deltasync keygen): sign "
                                                     "catch-ups, read only steps it signed.")] = None,
    stream_id: StreamIdOpt = None,
) -> None:
    """Write catch-up deltas (docs/FORMAT.md section 5g): one object from a step A straight to a later step B, built
    from the stored deltas in between, so that a follower that fell behind reads a few times less. Runs anywhere
    the store is reachable (it costs the trainer nothing); followers use what exists, and streams without any
    read as before. On a signed stream give the signing key: followers with trusted keys refuse unsigned ones."""
    from deltasync.history import CatchupOptions, CatchupWriter

    try:
        dist = tuple(int(d) for d in distances.replace(" ", "").split(",") if d)
    except ValueError:
        raise typer.BadParameter(f"--distances: expected step counts separated by commas, got {distances!r}") from None
    options = CatchupOptions(distances=dist, consumers=consumers, min_lag=min_lag)
    with CatchupWriter(_location(url, storage_option), options=options, signing_key=signing_key,
                       stream_id=stream_id) as writer:
        if follow_:
            writer.follow(poll_s=poll_s)
            return
        report = writer.run_once()
    if as_json:
        _print_json(report.to_dict())
        return
    for (a, b, n), built in zip(report.written, report.replaced_bytes, strict=True):
        out.print(f"catch-up {a} -> {b}: {_mb(n)} (the steps' own objects: {_mb(built)})", markup=False)
    out.print(f"{len(report.written)} written, {len(report.skipped)} skipped (no deltas between), "
              f"{len(report.deleted)} deleted in {report.seconds:.2f}s", markup=False)


@command("compare", summary="What changed between two steps, per tensor and layer.",
         examples=["deltasync compare s3://bucket/run-7 10 12", "deltasync compare ./stream 0 12 --json"])
def compare_(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    a: Annotated[int, typer.Argument(metavar="STEP_A", help="First step.")],
    b: Annotated[int, typer.Argument(metavar="STEP_B", help="Second step.")],
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Per tensor and per layer: elements changed between two steps, relative L2 change, largest change."""
    from deltasync.history.compare import compare

    with _reader(url, storage_option) as reader, _progress() as progress:
        reader.store.download_progress = progress
        c = compare(reader, a, b, progress=progress)
    if as_json:
        _print_json(c.to_dict())
        return
    for title, diffs in ((f"step {a} -> {b}, per tensor", c.tensors), (f"step {a} -> {b}, per layer", c.layers)):
        table = Table(title=title)
        cols = ("name", "elements", "changed", "density", "rel L2", "max |change|")
        rows = [[f"{d.numel:,}", f"{d.changed:,}", _pct(d.density), _num(d.rel_l2), _num(d.max_abs_change)]
                for d in diffs]
        names = fit_names([d.name for d in diffs], [[c, *(r[i] for r in rows)] for i, c in enumerate(cols[1:])])
        for col in cols:  # names wrap between their parts, never inside one
            table.add_column(col, justify="left" if col == "name" else "right", overflow="fold", no_wrap=col != "name")
        for name, row in zip(names, rows, strict=True):
            table.add_row(name, *row)
        out.print(table)


@command(summary="Density, bytes and timings over a stream.",
         examples=["deltasync stats s3://bucket/run-7", "deltasync stats ./stream --from 100 --plot density.png"])
def stats(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    first: Annotated[int | None, typer.Option("--from", metavar="STEP", help="First step.")] = None,
    last: Annotated[int | None, typer.Option("--to", metavar="STEP", help="Last step.")] = None,
    plot: Annotated[Path | None, typer.Option(metavar="PNG",
                                              help="Draw change density per layer and bytes per step to this "
                                                   "PNG.")] = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Density, bytes, compression and stage timings over a stream (from manifests); --plot draws a heat map."""
    from deltasync.history.stats import layer_density, need_matplotlib, plot_stats, stream_stats

    if plot is not None:
        need_matplotlib()  # before reading the stream, not after
    with _reader(url, storage_option) as reader:
        s = stream_stats(reader, first=first, last=last)
        density = None
        if plot is not None:
            with _progress() as progress:
                density = layer_density(reader, [r.step for r in s.steps], progress=progress)
            plot_stats(s, density, plot)
    if as_json:
        _print_json({**s.to_dict(), **({"layer_density": density.to_dict()} if density else {})})
        return
    sm = s.summary()
    out.print(f"{url}: {sm['steps']} steps {sm['first_step']}..{sm['last_step']} ({sm['anchors']} anchors, "
              f"{sm['deltas']} deltas), "
              f"{_mb(sm['total_bytes'])} stored; as full checkpoints: {_num(sm['compression_ratio'])}x more",
              soft_wrap=True, markup=False)
    table = Table(title="over the stream")
    for col in ("", "min", "median", "mean", "max"):
        table.add_column(col, justify="left" if not col else "right")
    for kind in ("delta", "anchor"):
        for key, fmt in (("density", _pct), ("capture_s", _num), ("encode_s", _num)):
            spread = sm[kind].get(key)
            if spread:
                table.add_row(f"{kind} {key}", *(fmt(spread[k]) for k in ("min", "median", "mean", "max")))
    table.add_row("delta bytes", "", "", _mb(sm["delta"]["mean_bytes"]), "")
    table.add_row("delta share of full", "", "", _pct(sm["delta"]["mean_share_of_full"]), "")
    out.print(table)
    if plot is not None:
        out.print(f"wrote {plot}", soft_wrap=True, markup=False)


@command("verify", summary="Check every committed step by replaying it.",
         examples=["deltasync verify s3://bucket/run-7",
                   "deltasync verify ./stream --trusted-key trainer.key.pub --stream-id run-7"])
def verify_(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    first: Annotated[int | None, typer.Option("--from", metavar="STEP", help="First step.")] = None,
    last: Annotated[int | None, typer.Option("--to", metavar="STEP", help="Last step.")] = None,
    all_problems: Annotated[bool, typer.Option("--all", help="List every problem, not only the first.")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
    trusted_key: TrustedKeyOpt = None,
    revoked_key: RevokedKeyOpt = None,
    stream_id: StreamIdOpt = None,
    max_age_s: MaxAgeOpt = None,
) -> None:
    """Check every committed step by replaying it: objects, headers, chains and checksums, and with
    --trusted-key each step's signature and the stream's signed head. Exit 1 on a problem."""
    from deltasync.history.verify import verify

    trust = _trust(trusted_key, revoked_key, stream_id, max_age_s)
    with _reader(url, storage_option, trust) as reader, _progress() as progress:
        reader.store.download_progress = progress
        report = verify(reader, first=first, last=last, all_problems=all_problems, progress=progress)
    if as_json:
        _print_json(report.to_dict())
    elif report.ok:
        origin = ("every step signed by a trusted key for stream " + inert(trust.stream_id) if report.origin_checked
                  else "origin unchecked (no --trusted-key: anyone who can write the store could have written them)")
        out.print(f"{url}: steps {report.first}..{report.last} verified ({len(report.verified)} steps): objects, "
                  "headers, "
                  f"chains and checksums (by replaying every tensor) all match; {origin}{_head_words(report)}",
                  soft_wrap=True, markup=False)
    else:
        for p in report.problems:
            out.print(f"step {p.step}: {p.kind}: {inert(p.message)}", soft_wrap=True, markup=False)
    if not report.ok:
        raise typer.Exit(1)


def _head_words(report: Any) -> str:
    """What the report says of the stream's newest step: vouched for by a signed head, or not provable."""
    if not report.origin_checked:
        return ""
    head = report.head
    if head is None:
        return f"; no signed head: step {report.last} cannot be proved the newest (a deleted tail would look the same)"
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(head["signed_unix_s"]))
    closed = ", closed by its publisher" if head["closed"] else ""
    return f"; a head signed {when} names step {head['step']} the newest{closed}"


@command("gc", summary="Delete steps no kept step and no live consumer needs.",
         examples=["deltasync gc s3://bucket/run-7 --keep-last 20 --dry-run",
                   "deltasync gc s3://bucket/run-7 --keep-last 20 --keep-anchor-every 100 --yes"])
def gc_(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    keep_last: Annotated[int, typer.Option(metavar="N", help="Keep the last K steps (and what they need).")],
    keep_anchor_every: Annotated[int | None, typer.Option(metavar="M",
                                                          help="Also keep the first anchor of every M steps.")] = None,
    consumer_max_age_s: Annotated[float, typer.Option(metavar="SECONDS",
                                                      help="Respect consumer heartbeats at most this old.")] = 3600.0,
    dry_run: Annotated[bool, typer.Option(help="Show the plan, delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking (on a terminal, gc shows the "
                                      "plan and asks first; elsewhere it deletes only with --yes).")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Delete steps that no retained step, and no live consumer, needs (never an anchor a kept delta builds on).
    On a terminal it shows the plan and asks before deleting; elsewhere (a script, a pipe, --json) it deletes only
    with --yes."""
    from deltasync.history.gc import collect_garbage, run_gc
    from deltasync.store import Store

    ask = not (dry_run or yes or as_json) and _on_terminal()
    refuse = not (dry_run or yes or ask)  # a script, a pipe, --json: nobody to ask, and not told to delete
    with _progress() as progress:
        plan = collect_garbage(_location(url, storage_option), keep_last=keep_last,
                               keep_anchor_every=keep_anchor_every, consumer_max_age_s=consumer_max_age_s,
                               dry_run=dry_run or ask or refuse, progress=progress)
    if refuse and (plan.delete or plan.leftovers or plan.catchups):
        raise typer.BadParameter(
            f"gc would delete {len(plan.delete)} steps ({_mb(plan.freed_bytes)}) and {len(plan.leftovers)} uncommitted "
            "folders, and there is no terminal to ask: pass --yes to delete them, or --dry-run to see the plan")
    if as_json:
        _print_json({**plan.to_dict(), "dry_run": dry_run})
        return
    _show_plan(url, plan, planned=dry_run or ask)
    if ask:
        if not plan.delete and not plan.leftovers and not plan.catchups:
            out.print("nothing to delete", markup=False)
            return
        if not typer.confirm(f"delete {len(plan.delete)} steps ({_mb(plan.freed_bytes)}) and {len(plan.leftovers)} "
                             "uncommitted folders?", default=False):
            out.print("nothing deleted", markup=False)
            return
        with Store(_location(url, storage_option)) as store, _progress() as progress:
            run_gc(store, plan, progress=progress)
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} {len(plan.delete)} steps ({_mb(plan.freed_bytes)}) and {len(plan.leftovers)} uncommitted "
              "folders; "
              f"kept {len(plan.keep)} steps", soft_wrap=True, markup=False)


def _on_terminal() -> bool:
    """Whether a person is at the keyboard (stdin and stdout are terminals): then gc asks before deleting."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def _show_plan(url: str, plan: Any, *, planned: bool) -> None:
    rows = sorted([(s, "keep", why) for s, why in plan.keep.items()] + [(s, "delete", "") for s in plan.delete])
    table = Table(title=f"{url}: garbage collection{' (plan)' if planned else ''}")
    for col in ("steps", "action", "why"):
        table.add_column(col)
    for first, last, action, why in _runs(rows):
        table.add_row(str(first) if first == last else f"{first}..{last}", action, shown(why))
    out.print(table)
    for c in plan.live_consumers:
        out.print(f"live consumer {inert(c.consumer_id)} at step {c.step}", soft_wrap=True, markup=False)
    for file, error in plan.unreadable:
        out.print(f"{inert(file)}: unreadable heartbeat, not respected ({inert(error)})", soft_wrap=True, markup=False)


def _runs(rows: list[tuple[int, str, str]]) -> Iterator[tuple[int, int, str, str]]:
    """Consecutive rows with the same action and reason, as (first, last, action, reason)."""
    start = None
    for i, (s, action, why) in enumerate(rows):
        if start is None:
            start = i
        if i + 1 == len(rows) or rows[i + 1][1:] != (action, why):
            yield rows[start][0], s, action, why
            start = None


