"""Commands that run things: follow a stream into an engine, the demo."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from deltasync_cli.app import StorageOpt, _storage_options, app, err, out


@app.command()
def follow(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    server: Annotated[str, typer.Option(help="Base URL of a vLLM OpenAI server started with "
                                        "--worker-extension-cls rollout_loader.worker.DeltaWorkerExtension "
                                        "and VLLM_SERVER_DEV_MODE=1.")],
    until: Annotated[int | None, typer.Option(help="Exit once the engine holds this step (default: follow forever).")] = None,
    engine_step: Annotated[int | None, typer.Option(help="The step the engine already holds, if it was started from one.")] = None,
    verify: Annotated[Literal["incremental", "changed", "all"], typer.Option(
        help="Checksums after each delta: 'incremental' (from the patched elements), the 'changed' tensors, or 'all'.")] = "changed",
    mode: Annotated[Literal["auto", "live", "reload"], typer.Option(help="Worker mode: auto, live or reload.")] = "auto",
    poll_s: Annotated[float, typer.Option(min=0.0, help="Seconds between polls of the store.")] = 0.1,
    timeout_s: Annotated[float, typer.Option(min=0.0, help="With --until: give up after this long.")] = 600.0,
    storage_option: StorageOpt = None,
) -> None:
    """Keep a running vLLM server at the newest step of a stream (prints one line per step).

    Before anything is paused: the options are checked, the server is asked whether it is set up for deltasync
    (the flags above), and the URL must hold a stream. Needs no vLLM package here (only on the server).
    """
    import time

    from rich.markup import escape

    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget

    target = VllmTarget(server, step=engine_step, mode=mode, verify=verify)

    def report(step: int) -> None:
        out.print(f"step {step} live in {server} (generation paused {target.pauses_s[-1] * 1e3:.1f} ms, checksums match)")

    follower = Follower(url, target, poll_s=poll_s, on_step=report, storage_options=_storage_options(storage_option))
    try:  # close() stops the thread and removes the downloads, however the command ends (Ctrl-C too)
        follower.reader.store.require_stream()
        if until is not None:
            follower.wait_for(until, timeout_s=timeout_s)  # retries like the thread; raises what stopped it
            return
        follower.start()
        shown: str | None = None
        while follower.running:
            time.sleep(1.0)
            error = follower.last_error
            if error is not None and str(error) != shown:  # once per distinct error
                shown = str(error)
                err.print(f"[yellow]retrying:[/yellow] {escape(shown)}")
            elif error is None:
                shown = None
        if follower.stopped_by is not None:  # a permanent error stopped the thread: one line, exit 2
            raise follower.stopped_by
    except KeyboardInterrupt:
        pass
    finally:
        follower.close()


@app.command()
def demo(
    store: Annotated[str | None, typer.Option(help="Stream URL (default: a new local folder).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 30,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (RL-like).")] = 1e-6,
    hidden_size: Annotated[int, typer.Option(help="Model width (multiple of 64).")] = 256,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 4,
    engine: Annotated[Literal["vllm", "torch"], typer.Option(
        help="Who follows: 'vllm' (a real engine) or 'torch' (a state dict).")] = "vllm",
    storage_option: StorageOpt = None,
) -> None:
    """Train a small Qwen3-shaped model, publish every step, follow it, and prove the weights match."""
    from deltasync_cli.demo import DemoConfig, run_demo

    run_demo(
        store,
        DemoConfig(steps=steps, lr=lr, hidden_size=hidden_size, layers=layers, engine=engine),
        storage_options=_storage_options(storage_option),
        echo=out.print,
    )


