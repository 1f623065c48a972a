"""Commands that run things: follow a stream into an engine, mirror a stream into another store, the demo."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from deltasync_cli.app import (
    MaxAgeOpt,
    RevokedKeyOpt,
    StorageOpt,
    StreamIdOpt,
    TrustedKeyOpt,
    _location,
    _option_pairs,
    _progress,
    _trust,
    command,
    err,
    out,
    shown,
)

if TYPE_CHECKING:  # imported inside the command: --help imports neither torch nor deltasync
    from rollout_loader.metrics import FollowerStatus


@command(summary="Keep a running vLLM server at a stream's newest step.",
         examples=["deltasync follow s3://bucket/run-7 --server http://127.0.0.1:8000",
                   "deltasync follow ./stream --server http://gpu-7:8000 --consumer-id gpu-7",
                   "deltasync follow ./stream --server http://127.0.0.1:8000 --until 10"])
def follow(
    url: Annotated[str, typer.Argument(help="Stream URL (a local path is sent to the server as an absolute path).")],
    server: Annotated[str, typer.Option(metavar="URL",
                                   help="Base URL of a vLLM OpenAI server started with VLLM_SERVER_DEV_MODE=1 and "
                                        "--weight-transfer-config '{\"backend\": \"deltasync\"}' (it fetches each step "
                                        "from the store itself).")],
    until: Annotated[int | None, typer.Option(metavar="STEP",
                                              help="Exit once the engine holds this step (default: follow "
                                                   "forever).")] = None,
    engine_step: Annotated[int | None, typer.Option(min=0, metavar="STEP",
                                               help="The step the engine's weights are at if it was never "
                                                    "updated (started from that step's checkpoint).")] = None,
    verify: Annotated[Literal["incremental", "changed", "all"], typer.Option(
        help="Checksums after each delta: 'incremental' (from the patched elements: the library's default too), "
             "the 'changed' tensors recomputed, or 'all'.")] = "incremental",
    mode: Annotated[Literal["auto", "live", "reload"], typer.Option(help="Worker mode: auto, live or "
                                                                         "reload.")] = "auto",
    representation: Annotated[Literal["checkpoint", "fp8"], typer.Option(
        help="What the stream's tensors are: the engine's checkpoint tensors, or an FP8 engine's own FP8 "
             "representation (docs/FORMAT.md section 7: written in place, no host copy).")] = "checkpoint",
    max_host_bytes: Annotated[int | None, typer.Option(
        min=0, metavar="BYTES", help="Refuse at init when the engine would keep more host memory than this (bytes) "
                                     "as host copies of checkpoint tensors (an FP8 engine fed a bf16 stream keeps its "
                                     "quantized layers' inputs).")] = None,
    fingerprint: Annotated[Literal["after", "pause", "off"], typer.Option(
        help="When the engine fingerprints what it computes with after an update (docs/FORMAT.md section 5f): "
             "'after' (off the pause; a mismatch with the reference marks it unhealthy, the next update undoes the "
             "step), 'pause' (inside it: a mismatch undoes the update) or 'off'.")] = "after",
    poll_s: Annotated[float, typer.Option(min=0.05, metavar="SECONDS",
                                     help="Seconds between polls of the store around the moment the "
                                          "next step is due (one small read each).")] = 0.25,
    max_poll_s: Annotated[float, typer.Option(min=0.05, metavar="SECONDS",
                                                        help="Longest time between polls while the stream is "
                                                             "quiet.")] = 10.0,
    timeout_s: Annotated[float, typer.Option(min=0.0, metavar="SECONDS",
                                                      help="With --until: give up after this long.")] = 600.0,
    metrics_port: Annotated[int | None,
                            typer.Option(min=0, max=65535, metavar="PORT",
                                                help="Serve Prometheus metrics (held step, newest "
                                                     "committed step, lag, apply/pause seconds, bytes, errors) on "
                                                     "this port of 127.0.0.1 (0: any free port). Needs "
                                                     "deltasync[metrics].")] = None,
    notify: Annotated[str | None, typer.Option(metavar="URL",
                                          help="A mirror's event feed (http://HOST:PORT/events, from deltasync "
                                               "mirror --events): steps are fetched as soon as they are announced, "
                                               "and the store is polled only as a safety net.")] = None,
    prefetch: Annotated[bool, typer.Option(help="The server's engine stages the next committed step (fetch, verify, "
                                           "decode) before it is asked for it.")] = True,
    rdma: Annotated[str | None, typer.Option(metavar="ADDRESS|JSON",
                                        help="Read steps over NIXL first: the RDMA controller's address "
                                             "(tcp://HOST:PORT), or a JSON object of RDMA options (docs/RDMA.md); "
                                             "the store stays the fallback.")] = None,
    consumer_id: Annotated[str | None, typer.Option(
        metavar="ID", envvar="DELTASYNC_CONSUMER_ID",
        help="Report the server's step to the store under this name (consumers/ID.json: after a step, at most "
             "every 30 s, and every 5 minutes while idle), so that deltasync status shows it and deltasync gc keeps "
             "the steps it needs (also $DELTASYNC_CONSUMER_ID).")] = None,
    storage_option: StorageOpt = None,
    trusted_key: TrustedKeyOpt = None,
    revoked_key: RevokedKeyOpt = None,
    stream_id: StreamIdOpt = None,
    max_age_s: MaxAgeOpt = None,
) -> None:
    """Keep a running vLLM server at the newest step of a stream (prints one line per step, with how many steps it
    runs behind the newest committed step).

    Before anything is paused: the options are checked, the server is asked which step it holds (GET
    /weight_info) and pointed at the stream, and the URL must hold a stream. Only step numbers are sent: needs
    no vLLM package here, and no access to the server's filesystem.
    """
    import time

    from deltasync.notify import EventFeed
    from rollout_loader import Follower, PollPolicy
    from rollout_loader.vllm import EngineSettings, VllmTarget

    # the store, its options, the trusted keys (every step's signature is checked by the follower and by the
    # server's engine) and the event feed (the engine's first rank hears of a step before the update asks for it,
    # and tells the others what to stage) reach the engine from the follower; the rest of its settings are these
    settings = EngineSettings(step=engine_step, mode=mode, verify=verify, prefetch=prefetch, rdma=_rdma_option(rdma),
                              representation=representation, max_host_bytes=max_host_bytes, fingerprint=fingerprint)
    target = VllmTarget(server, settings)
    keys = _trust(trusted_key, revoked_key, stream_id, max_age_s)
    feed = EventFeed(notify) if notify is not None else None  # a bad URL: one line, exit 2

    def report(step: int) -> None:
        out.print(f"step {step} live in {server} (generation paused {target.pauses_s[-1] * 1e3:.1f} ms, checksums "
                  "match)"
                  f"{_lag_words(follower.status())}")

    try:
        policy = PollPolicy(fast_s=poll_s, idle_max_s=max(max_poll_s, poll_s))
        follower = Follower(_location(url, storage_option), target, policy=policy, on_step=report,
                            metrics_port=metrics_port, notifier=feed,
                            trusted_keys=keys, consumer_id=consumer_id)
    except BaseException:
        if feed is not None:
            feed.close()
        raise
    try:  # close() stops the thread and removes the reader's downloads, however the command ends (Ctrl-C too)
        if follower.metrics_server is not None:
            out.print(f"metrics at {follower.metrics_server.url}")
        follower.reader.store.require_stream()  # a wrong URL: one line, exit 2, before the server is touched
        held = follower.connect()  # a missing flag or an unreachable server: one line, exit 2
        follower.heartbeat(force=True)  # with --consumer-id: in `deltasync status` from the start
        goal = f"until it holds step {until}" if until is not None else "at every new step (Ctrl-C stops)"
        out.print(f"following {url} into {server}: it holds "
                  f"{'no step yet (its own checkpoint)' if held is None else f'step {held}'}; updating it {goal}"
                  + (f"; reporting as consumer {consumer_id}" if consumer_id else ""), markup=False, soft_wrap=True)
        if until is not None:
            follower.wait_for(until, timeout_s=timeout_s)  # retries like the thread; raises what stopped it
            follower.heartbeat(force=True)  # the step it reached, whenever the last report was
            return
        follower.start()
        said: str | None = None
        while follower.running:
            time.sleep(0.2)
            error = follower.last_error
            if error is not None and str(error) != said:  # once per distinct error
                said = str(error)
                err.print(f"[yellow]retrying:[/yellow] {shown(f'{type(error).__name__}: {error}')}")
            elif error is None:
                said = None
        if follower.stopped_by is not None:  # a permanent error stopped the thread: one line, exit 2
            raise follower.stopped_by
    finally:  # Ctrl-C or SIGTERM goes on up: exit 130 or 143, never 0 (--until was not reached)
        follower.close()
        if feed is not None:
            feed.close()


def _rdma_option(rdma: str | None) -> Any:
    """``--rdma``: a controller address, or a JSON object of RDMA options; a bad one is a ``ConfigError``."""
    import json

    from deltasync.errors import ConfigError

    if rdma is None or not rdma.lstrip().startswith("{"):
        return rdma
    try:
        return json.loads(rdma)
    except ValueError as e:
        raise ConfigError(f"--rdma: expected a controller address (tcp://HOST:PORT) or a JSON object, got "
                          f"{rdma[:100]!r} ({e})") from None


def _lag_words(status: FollowerStatus) -> str:
    """``", 2 steps behind step 7"`` or ``", the newest committed step"``: provenance for the rollouts that follow."""
    lag = status.lag_steps
    if lag is None:
        return ""
    if lag == 0:
        return ", the newest committed step"
    return f", {lag} step{'s' if lag != 1 else ''} behind step {status.newest_step}"


@command(summary="Replicate a stream into another store, verified.",
         examples=["deltasync mirror s3://trainer/run-7 gs://region-b/run-7 -D token=TOKEN",
                   "deltasync mirror s3://trainer/run-7 /data/run-7 --once",
                   "deltasync mirror s3://trainer/run-7 /data/run-7 --events 0.0.0.0:8901"])
def mirror(
    src: Annotated[str, typer.Argument(metavar="SRC", help="The stream to copy (URL).")],
    dst: Annotated[str, typer.Argument(metavar="DST",
                                       help="Where to keep the copy (URL; an empty location or an earlier copy).")],
    once: Annotated[bool, typer.Option("--once", help="Copy what is committed now and exit (default: keep "
                                                      "following).")] = False,
    until: Annotated[int | None, typer.Option(min=0, metavar="STEP", help="Exit once this step is copied.")] = None,
    poll_s: Annotated[float, typer.Option(min=0.05, metavar="SECONDS",
                                                    help="Seconds between polls of the source when a step is "
                                                         "due.")] = 0.25,
    max_poll_s: Annotated[float, typer.Option(min=0.05, metavar="SECONDS",
                                                        help="Longest time between polls while the source is "
                                                             "quiet.")] = 10.0,
    events: Annotated[str | None, typer.Option(metavar="HOST:PORT",
                                          help="Serve the copy's new steps as server-sent events on HOST:PORT "
                                               "(GET /events), for this region's followers (deltasync follow "
                                               "--notify, Follower(notifier=EventFeed(url))): they stop "
                                               "polling.")] = None,
    notify: Annotated[str | None, typer.Option(metavar="URL", help="The source's event feed (an upstream mirror's "
                                               "http://HOST:PORT/events): copy each step as it is announced.")] = None,
    storage_option: StorageOpt = None,
    dst_option: Annotated[list[str] | None, typer.Option("--dst-option", "-D", metavar="KEY=VALUE",
                                                    help="Storage option KEY=VALUE of the "
                                                         "destination (-S: of the source); repeatable.")] = None,
    trusted_key: TrustedKeyOpt = None,
    revoked_key: RevokedKeyOpt = None,
    stream_id: StreamIdOpt = None,
    max_age_s: MaxAgeOpt = None,
) -> None:
    """Replicate a stream into another store (a bucket in another cloud, a region's disk), verified and in commit
    order: followers there read the copy, so egress from the source is paid once. Safe to kill at any point and to
    run several at once; the copy keeps its own retention (deltasync gc on it). Steps' signatures are copied with
    them and manifests byte for byte; with --trusted-key only steps (and model files) a trusted signature covers are
    copied."""
    import threading

    from deltasync.follow.watch import PollPolicy
    from deltasync.history.mirror import mirror as mirror_once
    from deltasync.history.mirror import mirror_follow
    from deltasync.notify import EventFeed, EventServer, host_port
    from deltasync.store import Store

    src_at, dst_at = _location(src, storage_option), _location(dst, dst_option)
    trust = _trust(trusted_key, revoked_key, stream_id, max_age_s)

    def report(step: int, nbytes: int) -> None:
        out.print(f"step {step} copied ({nbytes / 1e6:,.2f} MB)", markup=False)

    with Store(src_at) as source:
        source.require_stream()  # a wrong URL: one line, exit 2, before anything is written
        if once:
            with _progress() as progress:
                source.download_progress = progress  # large objects: a bar of bytes on a terminal
                r = mirror_once(source, dst_at, on_step=report, trusted_keys=trust)
    if once:
        refused = f", {len(r.refused)} not covered by a trusted signature" if r.refused else ""
        out.print(f"{dst}: {len(r.copied)} step(s) copied ({r.bytes_copied / 1e6:,.2f} MB), {r.present} already there"
                  f"{', model files copied' if r.files_copied else ''}{refused} in {r.seconds:.1f}s",
                  markup=False, soft_wrap=True)
        return

    def warn(error: BaseException) -> None:
        err.print(f"[yellow]retrying:[/yellow] {shown(f'{type(error).__name__}: {error}')}")

    stop = threading.Event()
    server = feed = None
    try:
        if events is not None:
            server = EventServer(*host_port(events))
            out.print(f"events at {server.url}", markup=False)
        feed = EventFeed(notify) if notify is not None else None
        mirror_follow(src_at, dst_at, until=until, stop=stop,
                      policy=PollPolicy(fast_s=poll_s, idle_max_s=max(max_poll_s, poll_s), retry_max_s=60.0),
                      on_step=report,
                      on_error=warn, notifier=feed, events=server, trusted_keys=trust)
    except KeyboardInterrupt:
        stop.set()
        raise  # exit 130 (143 for SIGTERM), never 0: --until was not reached
    finally:
        for thing in (feed, server):
            if thing is not None:
                thing.close()


@command(summary="Train, publish, follow and verify a small model.",
         examples=["deltasync demo --steps 8", "deltasync demo --engine torch --store ./stream"])
def demo(
    store: Annotated[str | None, typer.Option(metavar="URL", help="Stream URL (default: a new local folder).")] = None,
    steps: Annotated[int, typer.Option(metavar="N", help="Training steps.")] = 30,
    lr: Annotated[float, typer.Option(metavar="LR", help="AdamW learning rate (RL-like).")] = 1e-6,
    hidden_size: Annotated[int, typer.Option(metavar="N", help="Model width (multiple of 64).")] = 256,
    layers: Annotated[int, typer.Option(metavar="N", help="Transformer layers.")] = 4,
    engine: Annotated[Literal["vllm", "torch"], typer.Option(
        help="Who follows: 'vllm' (a real engine) or 'torch' (a state dict).")] = "vllm",
    transport: Annotated[Literal["store", "nixl"], typer.Option(
        help="'store': the follower reads the store; 'nixl': trainer and follower in separate processes, step objects "
             "over NIXL (RDMA; UCX loopback here) with the store as history and fallback (follower: the engine chosen "
             "with --engine).")] = "store",
    storage_option: StorageOpt = None,
) -> None:
    """Train a small Qwen3-shaped model, publish every step, follow it, and prove the weights match."""
    from deltasync_cli.demo import DemoConfig, run_demo

    run_demo(
        store,
        DemoConfig(steps=steps, lr=lr, hidden_size=hidden_size, layers=layers, engine=engine, transport=transport),
        storage_options=_option_pairs(storage_option),  # the demo may make its own (temporary) store
        echo=lambda line: out.print(line, markup=False, soft_wrap=True),  # rows as they happen, never re-wrapped
    )


