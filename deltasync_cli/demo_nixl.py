"""``deltasync demo --transport nixl``: trainer, consumer and controller in separate processes (docs/RDMA.md).

The trainer process trains as the store demo does and publishes every step to the store and, once committed,
over NIXL from its ring (the publisher's ``rdma`` option); the consumer is a vLLM engine in multiprocess mode
(its deltasync weight-transfer engine reads the trainer's ring) or, with the torch engine, a state dict in its
own process; the controller runs in the CLI process. Each row checks the consumer's weights against the
trainer's own checksums.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from deltasync.format.checksum import format_checksum, state_checksum
from deltasync.publish.publisher import DeltaPublisher
from deltasync.store.location import StoreLocation
from deltasync.testing import save_model_dir, stdlib_corpus, tiny_qwen3
from deltasync_cli.demo_config import DemoConfig, bf16_checksums

log = logging.getLogger(__name__)

ENGINE_ID = "demo-engine"  # the controller counts this engine's acknowledgements under this name


def _train_batches(config: DemoConfig):
    """The model, its optimizer and a batch function, as the store demo trains them."""
    torch.manual_seed(config.seed)
    model = tiny_qwen3(hidden_size=config.hidden_size, layers=config.layers, seed=config.seed).float()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    data = stdlib_corpus(seed=config.seed) % model.config.vocab_size
    gen = torch.Generator().manual_seed(config.seed)

    def batch() -> torch.Tensor:
        starts = torch.randint(0, data.numel() - config.seq_len - 1, (config.batch_size,), generator=gen)
        return torch.stack([data[s : s + config.seq_len + 1] for s in starts])

    return model, opt, batch


def _nixl_trainer(address: str, store: dict, config: DemoConfig, out, go) -> None:
    """The trainer process: once the consumer is up (``go``), train and publish every step to the store (``store``:
    a StoreLocation's record, as data across the process hop) and, once committed, over NIXL; its own bf16 checksums
    of every step go to ``out``."""
    try:
        model, opt, batch = _train_batches(config)
        if not go.wait(600):
            raise TimeoutError("the consumer did not start within 600 s")
        rdma = {"controller": address, "slot_bytes": 64 << 20, "plan_wait_s": 60.0}
        with DeltaPublisher(StoreLocation.from_record(store), model, dtype=torch.bfloat16,
                            anchor_every=config.anchor_every, on_backlog="block", rdma=rdma) as pub:
            for step in range(config.steps):
                b = batch()
                model(input_ids=b[:, :-1], labels=b[:, 1:]).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                out.put(("sum", step, state_checksum(bf16_checksums(model))))
                pub.publish(step)
                out.put(("published", step, time.monotonic()))
            pub.flush()
            store_only = pub.rdma.stats.store_only  # the ring stays up until the publisher closes
        out.put(("metrics", [m.to_dict() for m in pub.metrics], store_only))
    except BaseException as e:
        out.put(("error", "trainer", f"{type(e).__name__}: {e}"))
        raise


def _nixl_consumer(address: str, store: dict, config: DemoConfig, out) -> None:
    """The torch engine's consumer process: a state dict that follows every announced step over NIXL (``store``: a
    StoreLocation's record)."""
    from deltasync.rdma.consumer import RdmaConsumer
    from rollout_loader import StateDictTarget

    try:
        target = StateDictTarget(verify="full")
        with RdmaConsumer(StoreLocation.from_record(store), rdma={"controller": address, "capacity_bytes": 64 << 20},
                          consumer_id=ENGINE_ID) as consumer:
            out.put(("ready",))
            reader = consumer.reader
            for step in range(config.steps):  # every step live in turn, as the vLLM engine takes them
                reader.wait_for(step, timeout_s=120.0, poll_s=0.01)
                for s in reader.chain(step, start=target.step):
                    with reader.open(s) as obj:  # over NIXL when announced, else from the store
                        target.apply(obj)
                consumer.applied(step)  # acknowledged: the controller advances the engine's version
                out.put(("live", step, time.monotonic(), consumer.arrived.get(step, "-")))
            assert target.replica is not None  # it applied step 0 (an anchor) at least
            final = state_checksum({n: format_checksum(c) for n, c in target.replica.checksums.items()})
            out.put(("final", target.step, final))
    except BaseException as e:
        out.put(("error", "consumer", f"{type(e).__name__}: {e}"))
        raise


class _VllmFollower:
    """A real vLLM engine in multiprocess mode (its engine core in its own process) following the stream over
    NIXL: the deltasync weight-transfer engine in its worker is the RDMA consumer (``init_info["rdma"]``); this
    process drives it with vLLM's own weight-transfer methods, one step at a time, as an RL loop would."""

    def __init__(self, model_dir: Path, where: StoreLocation, address: str) -> None:
        from deltasync.store import Store
        from rollout_loader.vllm import start_engine

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM leaves its IPC socket files (<base>/<uuid4>) in the temp folder: here they go into the demo's folder,
        # removed with it, where that path fits a Unix socket address (107 bytes)
        self._rpc_path = os.environ.get("VLLM_RPC_BASE_PATH")
        if len(os.fsencode(model_dir.parent)) + 37 <= 107:
            os.environ["VLLM_RPC_BASE_PATH"] = str(model_dir.parent)
        self.store = Store(where)  # only to see which steps are committed
        self.llm = None
        self.held = -1
        self.live_at: dict[int, float] = {}
        try:
            self.llm = start_engine(str(model_dir), dtype="bfloat16", enforce_eager=True,
                                    max_model_len=256, seed=0)
            self.llm.init_weight_transfer_engine({"init_info": {
                **where.to_record(), "verify": "all",  # the store crosses to the engine as its record
                "rdma": {"controller": address, "capacity_bytes": 64 << 20, "engine": ENGINE_ID}}})
        except BaseException:
            self.close()
            raise

    def advance(self) -> None:
        """Bring the engine to the latest committed step, each step its own update and weight version."""
        assert self.llm is not None  # started in __init__ (which raises otherwise)
        latest = self.store.latest_step()
        for step in range(self.held + 1, (latest if latest is not None else -1) + 1):
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"step": step}})  # read over NIXL, written, verified
            self.llm.finish_weight_update(weight_version=str(step))
            self.live_at[step] = time.monotonic()
            self.llm.reset_prefix_cache()  # prompts cached with older weights are stale
            self.held = step

    def status(self) -> dict:
        from rollout_loader.vllm.worker import transfer_status

        assert self.llm is not None
        return transfer_status(self.llm)

    def generate(self, prompt: str, max_tokens: int = 12) -> str:
        """Greedy tokens from the weights the engine holds now (a barely trained model: the point is that it serves)."""
        from vllm import SamplingParams

        assert self.llm is not None
        out = self.llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
        return f"token ids {list(out[0].outputs[0].token_ids)} ({out[0].outputs[0].text!r})"

    def close(self) -> None:
        """Stop the weight-transfer engine (its NIXL agent, its download cache) and the engine's processes."""
        self.store.close()
        if self._rpc_path is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = self._rpc_path
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        # from a thread, given 15 s: vLLM waits for a reply without a timeout, and an engine core that a Ctrl-C
        # ended never sends one (its worker then shut its weight-transfer engine down itself)
        stop = threading.Thread(target=_shutdown_weight_transfer, args=(llm,), name="demo-engine-stop", daemon=True)
        stop.start()
        stop.join(15)
        llm.llm_engine.engine_core.shutdown(timeout=60)


def _shutdown_weight_transfer(llm) -> None:
    try:
        llm.shutdown_weight_transfer_engine()
    except Exception as e:  # noqa: BLE001 - an engine that died already: its processes are stopped anyway
        # vLLM's default grace (5 s) is short on a loaded machine
        log.warning("vLLM engine: shutting down the weight-transfer engine failed: %s", e)


@contextmanager
def _ctrl_c_reaches_main_thread() -> Iterator[threading.Event]:
    """Make Ctrl-C end the main thread's work even while it waits in C code or inside a library that swallows
    the ``KeyboardInterrupt``; yields an event the caller sets when its cleanup begins.

    The kernel hands SIGINT to any thread, and Python raises it in the main thread only once that thread runs
    Python code: vLLM's engine startup waits in ``zmq_poll`` for up to ``VLLM_ENGINE_READY_TIMEOUT_S`` on an
    engine core the same Ctrl-C has ended, and code it calls may catch the exception. A watcher learns of the
    signal through the wakeup fd and sends SIGINT to the main thread every second until the cleanup began (each
    ends a C wait with EINTR and raises again); from then on SIGINT is ignored, so the cleanup runs to its end.
    """
    cleaning = threading.Event()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield cleaning
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    done = threading.Event()

    def handler(signum, frame) -> None:
        if not cleaning.is_set():
            raise KeyboardInterrupt

    main = threading.main_thread().ident
    assert main is not None  # the main thread runs

    def watch() -> None:
        while not done.is_set():
            if select.select([r], [], [], 0.5)[0]:
                os.read(r, 64)
                break
        while not done.is_set() and not cleaning.wait(1.0):
            signal.pthread_kill(main, signal.SIGINT)

    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, handler)
    watcher = threading.Thread(target=watch, name="demo-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield cleaning
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)


def _take(q, got: dict, echo, timeout_s: float) -> None:
    """File one message from the trainer or consumer process (or none within ``timeout_s``) into ``got``."""
    import queue

    try:
        msg = q.get(timeout=timeout_s)
    except queue.Empty:
        return
    kind = msg[0]
    if kind in ("sum", "published"):
        got[kind][msg[1]] = msg[2]
    elif kind == "live":
        got["live"][msg[1]] = (msg[2], msg[3])
        echo(f"step {msg[1]} live in the consumer (read {'over NIXL' if msg[3] == 'rdma' else 'from the store'})")
    elif kind == "error":
        echo(f"{msg[1]} failed: {msg[2]}")
        got["error"] = msg[1:]
    elif kind in ("metrics", "final", "ready"):
        got[kind] = msg[1:]


def run_demo_nixl(where: StoreLocation, config: DemoConfig, workdir: Path, *, temporary: bool,
                  echo) -> list[dict]:
    import multiprocessing as mp

    from deltasync.rdma.auth import cluster_secret_for_this_run
    from deltasync.rdma.controller import Controller

    vllm = config.engine == "vllm"
    echo("transport: NIXL (UCX loopback, CPU memory): trainer and consumer in separate processes, the controller in "
         "this one; every step is also committed to the store")
    echo("consumer: a vLLM engine in multiprocess mode (engine core in its own process), its deltasync weight-transfer "
         "engine reading over NIXL" if vllm else "consumer: a state dict in its own process (the torch engine)")
    echo(f"store: {where.shown}" + (" (temporary: removed at the end; --store DIR keeps it)" if temporary else ""))
    ctx = mp.get_context("spawn")
    got: dict = {"sum": {}, "published": {}, "live": {}}
    engine: _VllmFollower | None = None
    with _ctrl_c_reaches_main_thread() as cleaning, cluster_secret_for_this_run(), \
            Controller(trainers=1, consumers=1) as controller:
        q, go = ctx.Queue(), ctx.Event()
        record = where.to_record()  # the store as data across the process hop
        procs = [ctx.Process(target=_nixl_trainer, args=(controller.address, record, config, q, go), daemon=True)]
        if not vllm:
            procs.append(ctx.Process(target=_nixl_consumer, args=(controller.address, record, config, q), daemon=True))
        for p in procs:
            p.start()
        try:
            if vllm:
                echo("starting a vLLM engine on the initial weights (multiprocess, CPU)...")
                model = tiny_qwen3(hidden_size=config.hidden_size, layers=config.layers, seed=config.seed)
                engine = _VllmFollower(save_model_dir(model, workdir / "model-step0"), where,
                                       controller.address)  # step 0 is an anchor: these weights are only a start
            deadline = time.monotonic() + 600
            while not vllm and "ready" not in got:
                _check(procs, got, deadline)
                _take(q, got, echo, 0.5)
            go.set()  # the consumer listens: the trainer starts, so publish -> live times are what a run sees
            while "metrics" not in got or (engine.held if engine else got.get("final", (-1,))[0]) < config.steps - 1:
                _check(procs, got, deadline)
                if engine is not None:
                    held = engine.held
                    engine.advance()
                    for step in range(held + 1, engine.held + 1):  # as it happens: the table comes at the end
                        echo(f"step {step} live in the vLLM engine")
                _take(q, got, echo, 0.02 if vllm else 0.5)
            if engine is not None:
                status = engine.status()
                got["live"] = {s: (t, status["arrived"].get(s, "-")) for s, t in engine.live_at.items()}
                got["paused"] = dict(enumerate(status["pauses_s"])) if len(status["pauses_s"]) == config.steps else {}
                got["final"] = (status["held_step"], state_checksum(
                    {n: format_checksum(c) for n, c in status["checksums"].items()}))
                assert engine.llm is not None  # started: advance ran
                got["version"] = engine.llm.get_weight_version()
                got["text"] = engine.generate("def ")
        finally:
            cleaning.set()  # a Ctrl-C from here on is ignored: everything started is stopped and removed
            if engine is not None:
                engine.close()
            finished = "metrics" in got and "final" in got
            for p in procs:
                # interrupted or failed: they clean up on KeyboardInterrupt
                if not finished and p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGINT)
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
            q.close()
            q.join_thread()
        versions = dict(controller.versions)
    return _report(where, config, got, versions, echo=echo)


def _check(procs, got: dict, deadline: float) -> None:
    """Stop the demo when a process failed or time ran out (its error is in ``got`` when it said why)."""
    if "error" in got or time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
        raise SystemExit(f"NIXL demo failed: {got.get('error') or [p.exitcode for p in procs]}")


def _report(where: StoreLocation, config: DemoConfig, got: dict, versions: dict, *, echo) -> list[dict]:
    """The table (one row per step: how it arrived, publish -> live) and the bit-exactness line."""
    from rich.console import Console
    from rich.table import Table

    from deltasync.store import Store

    vllm = "version" in got
    metrics, store_only = got["metrics"]
    final_step, final = got["final"]
    paused = got.get("paused", {})
    rows = []
    who = "vLLM engine (multiprocess)" if vllm else "follower"
    table = Table(title=f"deltasync demo: trainer -> NIXL (store as history) -> {who}, separate processes")
    cols = ["step", "kind", "density", "bytes", "vs full", "B/changed", "diff ms", "encode ms", "commit ms", "via",
            "live +ms"] + (["engine paused ms"] if vllm else []) + ["exact"]
    for col in cols:
        table.add_column(col, justify="right")
    with Store(where) as store:
        for m in metrics:
            s = m["step"]
            exact = s in got["live"] and store.manifest(s).state_checksum == got["sum"][s]
            live_at, via = got["live"].get(s, (float("nan"), "-"))
            lag = (live_at - got["published"][s]) * 1e3
            row = {**m, "via": via, "live_after_publish_ms": lag, "exact": bool(exact)}
            if vllm:
                row["engine_paused_ms"] = paused[s] * 1e3 if s in paused else None
            rows.append(row)
            table.add_row(str(s), m["kind"], f"{m['density']:.2%}" if m["kind"] == "delta" else "full",
                          f"{m['object_bytes'] / 1e6:.2f} MB", f"{m['object_bytes'] / m['full_bytes']:.1%}",
                          f"{m['object_bytes'] / m['changed']:.2f}" if m["kind"] == "delta" and m["changed"] else "-",
                          f"{m['capture_s'] * 1e3:.1f}", f"{m['encode_s'] * 1e3:.1f}",
                          f"{(m['write_s'] + m['upload_s']) * 1e3:.1f}", via, f"{lag:.0f}",
                          *([f"{paused[s] * 1e3:.1f}" if s in paused else "-"] if vllm else []),
                          "yes" if exact else "NO")
    Console(width=max(Console().width, 120)).print(table)
    rdma = sum(r["via"] == "rdma" for r in rows)
    echo(f"{rdma} of {len(rows)} steps read over NIXL, the others from the store"
         + (f" ({'; '.join(f'step {s}: {why}' for s, why in store_only[:3])})" if store_only else ""))
    if vllm:
        echo(f"generated with step {final_step}'s weights: {got['text']}")
    echo(f"controller: engine version {versions.get(ENGINE_ID)} (advanced only after the consumer applied and verified)"
         + (f"; vLLM weight version {got['version']}" if vllm else ""))
    last = config.steps - 1
    ok = all(r["exact"] for r in rows) and final_step == last and final == got["sum"][last]
    echo(f"{who.split(' (')[0]} weights at step {final_step}: {final[:16]}…  trainer: {got['sum'][last][:16]}…")
    echo("BIT-EXACT: every step verified" if ok else "MISMATCH: see the table")
    if not ok:
        raise SystemExit(1)
    return rows
