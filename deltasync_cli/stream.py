"""Commands on single objects and streams: diff, patch, ls, show, status."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from deltasync_cli.app import (
    StorageOpt,
    _load_safetensors,
    _location,
    _mb,
    command,
    fit_names,
    inert,
    inert_line,
    out,
    shown,
)


@command(summary="Write the delta between two checkpoints (bit-exact).",
         examples=["deltasync diff base.safetensors new.safetensors -o step1.delta"])
def diff(
    base: Annotated[Path, typer.Argument(metavar="BASE",
                                         help="Base checkpoint (.safetensors).", exists=True, dir_okay=False)],
    target: Annotated[Path, typer.Argument(metavar="TARGET",
                                           help="Target checkpoint (.safetensors).", exists=True, dir_okay=False)],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="PATH", help="Delta file to write.")],
    base_step: Annotated[int, typer.Option(metavar="STEP", help="Step number recorded for the base.")] = 0,
    step: Annotated[int | None, typer.Option(metavar="STEP",
                                             help="Step number recorded for the target (default base+1).")] = None,
) -> None:
    """Write the delta that turns BASE into TARGET (like Unix diff, but bit-exact and compact)."""
    from deltasync.publish.steps import snapshot_headers, write_step
    from deltasync.stages.diff import Snapshot

    snap = Snapshot(_load_safetensors(base))
    changes = [c for c in snap.diff(_load_safetensors(target)) if c.changed]
    header = write_step(
        output,
        kind="delta",
        step=base_step + 1 if step is None else step,
        base_step=base_step,
        headers=snapshot_headers(snap),
        changes=changes,
    )
    size = output.stat().st_size
    out.print(
        f"{output}: {header.changed} of {header.numel} elements changed ({header.changed / max(header.numel, 1):.2%}) "
        f"in {sum(1 for c in changes)} tensors, {size} bytes"
    )


@command(summary="Apply a delta to a checkpoint, verified by checksums.",
         examples=["deltasync patch base.safetensors step1.delta -o new.safetensors"])
def patch(
    base: Annotated[Path, typer.Argument(metavar="BASE",
                                         help="Base checkpoint (.safetensors).", exists=True, dir_okay=False)],
    delta: Annotated[Path, typer.Argument(metavar="DELTA",
                                          help="Delta file made by `deltasync diff` or a stream.", exists=True)],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="PATH", help="Checkpoint to write.")],
) -> None:
    """Apply DELTA to BASE and write the result; fails (writing nothing) unless every checksum matches."""
    import safetensors.torch

    from deltasync.format.objects import StepObject
    from deltasync.stages.apply import Replica

    obj = StepObject(delta, where=str(delta))
    tensors = _load_safetensors(base)
    for alias, name in obj.header.aliases.items():
        if name in tensors:
            tensors.setdefault(alias, tensors[name])
    # an anchor is loaded whole: the base's step does not matter then
    base_step = obj.header.step if obj.header.base_step is None else obj.header.base_step
    rep = Replica.from_tensors(tensors, step=base_step)
    rep.apply(obj, verify="full")
    from deltasync.transports.local import share

    with tempfile.NamedTemporaryFile(dir=output.parent or ".", suffix=".tmp", delete=False) as tmp:
        pass
    try:
        safetensors.torch.save_file(
            {n: t for n, t in tensors.items() if n not in obj.header.aliases}, tmp.name, metadata={"format": "pt"}
        )
        share(tmp.name)  # the umask's mode, as any file the user writes (a temporary file is 0600)
        Path(tmp.name).replace(output)
    finally:
        Path(tmp.name).unlink(missing_ok=True)  # a failed save leaves no temporary file behind
    out.print(f"{output}: step {obj.header.step}, {obj.header.changed} elements patched, checksums verified")


@command("ls", summary="List the committed steps of a stream.",
         examples=["deltasync ls s3://bucket/run-7 -S endpoint_url=http://127.0.0.1:8333",
                   "deltasync ls ./stream --json"])
def ls_(
    url: Annotated[str, typer.Argument(help="Stream URL (local path, s3://, hf://buckets/..., memory://).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    storage_option: StorageOpt = None,
) -> None:
    """List the committed steps of a stream."""
    from deltasync.store import Store

    with Store(_location(url, storage_option)) as store:
        manifests = [store.manifest(s) for s in store.steps()]
        if not manifests:
            store.require_stream()  # "no stream at this URL" is an error; "a stream with no steps yet" is not
    if as_json:
        print(json.dumps([m.to_dict() for m in manifests], indent=1))
        return
    import time

    table = Table(title=shown(f"{url}: {len(manifests)} committed steps"))
    for col in ("step", "kind", "base", "size", "density", "committed", "coalesced"):
        table.add_column(col, justify="right", no_wrap=col in ("size", "committed"))
    for m in manifests:
        table.add_row(
            str(m.step),
            m.kind,
            "-" if m.base_step is None else str(m.base_step),
            _mb(m.object_bytes),  # as every other command shows sizes (--json: bytes)
            f"{m.stats.density:.2%}",
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix_s)),
            ",".join(map(str, m.stats.coalesced_steps)) or "-",
        )
    out.print(table)


@command(summary="Where every consumer of a stream stands.",
         examples=["deltasync status s3://bucket/run-7",
                   "deltasync status s3://bucket/run-7 --stale-after-s 600 --json",
                   "deltasync status s3://bucket/run-7 --prometheus > deltasync.prom"])
def status(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    stale_after_s: Annotated[float, typer.Option(min=1.0, metavar="SECONDS",
                                                          help="Flag consumers whose last heartbeat is older than "
                                                               "this.")] = 900.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    prometheus: Annotated[bool, typer.Option("--prometheus", help="Print Prometheus text exposition (for a textfile "
                                             "collector or a scrape script).")] = False,
    storage_option: StorageOpt = None,
) -> None:
    """Where every consumer of a stream stands, from the heartbeats followers started with a consumer id write:
    the step each holds, how many committed steps it is behind, when it last reported (stale ones flagged),
    its engine's weight version and error count, and its replica record: when its step was applied, the pause,
    its runtime fingerprint (of what the engine computes with) and configuration key, the comparison with a
    reference, its last error.

    Exit status 1 when replicas of one configuration at one step hold different fingerprints, or one differs from
    its reference (docs/FORMAT.md section 5f): the report names them."""

    if as_json and prometheus:
        raise typer.BadParameter("--json and --prometheus are two formats of the same report: choose one")
    from deltasync.history.fleet import fleet_status, prometheus_text
    from deltasync.store import Store

    with Store(_location(url, storage_option)) as store:
        store.require_stream()
        fleet = fleet_status(store, stale_after_s=stale_after_s)
    if as_json:
        print(json.dumps(fleet.to_dict(), indent=1))
    elif prometheus:
        print(prometheus_text(fleet), end="")
    else:
        _fleet_table(url, fleet, stale_after_s)
    if not fleet.healthy:
        raise typer.Exit(1)


def _fleet_table(url: str, fleet: Any, stale_after_s: float) -> None:
    """The fleet as a table that fits 80 columns (one short word per cell), then a line for each consumer with
    something to explain (a clock ahead, a disagreement, a mismatch, errors): long text goes there, not in a cell."""
    newest = "no committed step" if fleet.newest_step is None else f"newest committed step {fleet.newest_step}"
    table = Table(title=shown(f"{url}: {len(fleet.consumers)} consumer(s), {newest}"))
    # a replica record's columns only where some heartbeat has one (a state-dict follower's has none)
    records = any(c.record.fingerprint or c.record.pause_s is not None for c in fleet.consumers)
    cols = ("consumer", "step", "behind", "reported", "version", *(("pause", "fingerprint") if records else ()),
            "state")
    rows, notes = [], []
    for c in fleet.consumers:  # everything a heartbeat says is shown inert (docs/SECURITY.md)
        r = c.record  # what the replica says of itself
        flags = ["suspect" if c.suspect else "stale" if c.stale else "live"]
        why = []
        if c.suspect:
            why.append(f"its clock is {-c.age_s:.0f} s ahead of this one")
        if c.disagrees:
            flags.append("disagrees")
            why.append("its fingerprint differs from a sibling's of the same configuration and step")
        if r.fingerprint_check == "mismatch":
            flags.append("mismatch")
            why.append(f"its fingerprint of step {r.fingerprint_step} differs from the reference for config "
                       f"{inert(r.config_key)}")
        if c.errors:
            why.append(f"{c.errors} error(s)")
        if r.last_error:
            flags.append("error")
            why.append(f"last error: {inert_line(r.last_error[:300])}")
        if why:
            notes.append(f"{inert(c.consumer_id)}: {'; '.join(why)}")
        fingerprint = "-" if r.fingerprint is None else f"{r.fingerprint[:8]} {inert(r.fingerprint_check or '?')}"
        record = ["-" if r.pause_s is None else f"{1e3 * r.pause_s:.1f} ms", fingerprint] if records else []
        rows.append([str(c.step), "-" if c.lag_steps is None else str(c.lag_steps),
                     f"{c.age_s:.0f} s ago" if not c.suspect else "future", inert(c.weight_version or "-"), *record,
                     ", ".join(flags)])
    ids = fit_names([c.consumer_id for c in fleet.consumers], [[c, *(r[i] for r in rows)] for i, c in
                                                               enumerate(cols[1:])])
    # the ids keep the width their lines were fitted to; a weight version (any text, from outside) folds where the
    # terminal is too narrow for it: kept whole, a long one would squeeze the ids to nothing
    widest = max((len(line) for i in ids for line in i.split("\n")), default=len(cols[0]))
    for col in cols:
        table.add_column(col, justify="left" if col in ("consumer", "state", "fingerprint") else "right",
                         overflow="fold", no_wrap=col not in ("consumer", "version", "state"),
                         min_width=max(widest, len(col)) if col == "consumer" else None)
    for consumer_id, row in zip(ids, rows, strict=True):
        state = escape(row[-1]) if row[-1] == "live" else f"[red]{escape(row[-1])}[/red]"
        table.add_row(consumer_id, *row[:3], *(escape(v) for v in row[3:-1]), state)
    out.print(table)
    for note in notes:
        out.print(note, markup=False, soft_wrap=True)
    if fleet.stale:
        out.print(f"{len(fleet.stale)} stale: no heartbeat within {stale_after_s:g} s "
                  f"({', '.join(inert(c.consumer_id) for c in fleet.stale[:10])})", markup=False)
    for bad in fleet.unreadable:  # one line each; the fleet's other consumers are shown all the same
        out.print(f"{inert_line(bad.file)}: unreadable heartbeat ({inert_line(bad.error)}): that consumer's position "
                  "is unknown",
                  markup=False, soft_wrap=True)
    for d in fleet.disagreements:
        groups = "; ".join(f"{f[:12]}: {', '.join(inert(i) for i in ids)}" for f, ids in d.groups.items())
        out.print(f"replicas of configuration {inert(d.config_key)} disagree at step {d.step}: {groups} (a reference, "
                  f"deltasync fingerprint {inert(url)} --step {d.step}, says which computes with the right bytes)",
                  markup=False, soft_wrap=True)
    for c in fleet.mismatched:
        out.print(f"{inert(c.consumer_id)}: its runtime fingerprint at step {c.record.fingerprint_step} differs from "
                  "the reference", markup=False, soft_wrap=True)


@command(summary="One step: its manifest and per-tensor changes.",
         examples=["deltasync show s3://bucket/run-7 12", "deltasync show ./stream 12 --json"])
def show(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    step: Annotated[int, typer.Argument(metavar="STEP", help="Step number.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    storage_option: StorageOpt = None,
) -> None:
    """Show one step: its manifest and, per tensor, how many elements changed."""
    from deltasync.errors import StepNotFoundError
    from deltasync.follow.reader import StreamReader

    with StreamReader(_location(url, storage_option)) as reader:
        try:
            m = reader.manifest(step)
        except StepNotFoundError:
            reader.store.require_stream()
            raise
        with reader.open(step) as obj:
            h = obj.header
    tensors = {n: {"dtype": t.dtype, "shape": list(t.shape), "changed": t.changed, "checksum": t.checksum}
               for n, t in h.tensors.items()}
    if as_json:
        print(json.dumps({"manifest": m.to_dict(), "aliases": h.aliases, "tensors": tensors}, indent=1))
        return
    out.print(f"step {m.step} ({m.kind}{'' if m.base_step is None else f' on step {m.base_step}'}), "
              f"{_mb(m.object_bytes)}", markup=False)
    out.print(f"state checksum {m.state_checksum}")
    table = Table()
    cols = ("tensor", "dtype", "shape", "changed", "density", "checksum")
    rows = [[t.dtype, "x".join(map(str, t.shape)), f"{t.changed:,}", f"{t.changed / max(t.numel, 1):.2%}", t.checksum]
            for t in h.tensors.values()]
    # a name wraps between its parts rather than being cut; other cells keep their width
    names = fit_names(list(h.tensors), [[c, *(r[i] for r in rows)] for i, c in enumerate(cols[1:])])
    for col in cols:
        table.add_column(col, overflow="fold", no_wrap=col != "tensor")
    for name, row in zip(names, rows, strict=True):
        table.add_row(name, *row)
    out.print(table)


