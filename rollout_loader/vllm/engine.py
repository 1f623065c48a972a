"""A vLLM weight-transfer engine that follows a deltasync stream: the engine reads the store itself.

Registered with vLLM's ``WeightTransferEngineFactory`` as ``"deltasync"`` in every vLLM process by the
``vllm.general_plugins`` entry point (:mod:`rollout_loader.vllm.plugin`), so updates are driven with vLLM's
own routes and ``LLM`` methods::

    vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'      # VLLM_SERVER_DEV_MODE=1
    POST /init_weight_transfer_engine {"init_info": {"url": "s3://bucket/run1", "storage_options": {...}}}
    POST /start_weight_update; POST /update_weights {"update_info": {"step": 12}}
    POST /finish_weight_update {"weight_version": "12"}; POST /reset_prefix_cache
    GET /weight_info  ->  {"weight_version": "12"}

``init_info``: an :class:`~rollout_loader.vllm.settings.EngineSettings` as JSON (``url``, ``storage_options``,
``verify``, ``mode``, ``step``, ``prefetch``, ``rdma``, ``notify``, ``trusted_keys``, ``revoked_keys``, ``stream_id``,
``max_age_s``, ``representation``, ``max_host_bytes``: settings.py documents each); an unknown or bad setting is a
``ConfigError`` naming it. Initialising again with the same stream keeps the step the engine holds.

Errors leave the engine with their record leading their text (``deltasync.errors.to_text``): a client in another
process rebuilds the error's class and whether retrying can help from it (``deltasync.errors.in_text``).

``update_info``: ``{"step": N}`` (an int, or ``"latest"``). The engine applies the chain from the step it holds
to N, each step verified against the trainer's checksums on every rank (parts summed across tensor-parallel
ranks), and rolled back on any failure or mismatch, on every rank, before raising: the engine never holds
unverified weights. Steps are fetched, verified, decoded and sealed in the background beforehand (the
update finds them staged: each changed tensor's checksum after the write is already computed from the bits
held and the patch, so the pause holds a plain XOR scatter and the comparison; see ``pause_parts``); anchors
are written as a dense XOR against the held bits, so they roll back the same way.
The weight version is the caller's (``finish_weight_update(weight_version=str(N))``); prompts cached with
older weights must be dropped by the caller (``reset_prefix_cache``), as vLLM keeps that cache outside the
workers. Importing this module imports vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferUpdateInfo

from deltasync import DeltaSyncError, StreamReader
from deltasync.engine import (
    MAX_STEP,
    EventFeed,
    RankFingerprint,
    add_checksums,
    config_key,
    mismatch_note,
    read_reference,
    warm_kernels,
)
from deltasync.errors import (
    BaseStepMismatchError,
    ChecksumMismatchError,
    ConfigError,
    EngineError,
    FingerprintMismatchError,
    HeldStepError,
    StepNotFoundError,
    to_text,
)

from .fingerprint import engine_config, fingerprint_model, rank_and_size
from .layout import checkpoint_layout
from .plan import build_state
from .prefetch import PlanBoard, Prefetcher, Prepared, prepare
from .settings import EngineSettings
from .shadow import load_checkpoint, reload_as_loaded
from .state import Staged, WorkerState
from .trace import all_gather_tp as _all_gather
from .trace import refuse_moving_experts

log = logging.getLogger(__name__)

BACKEND = "deltasync"
# the parts of an update's time inside the pause: finding the steps to apply (the manifest), taking the staged
# step (or preparing it, when the prefetcher had not), the in-place write, the ranks' agreement, the checksum
# comparison (with any checksum computation it needs), the runtime fingerprint (with fingerprint="pause");
# "total" is the whole update_weights call
PAUSE_PARTS = ("resolve", "staging", "write", "all_gather", "compare", "fingerprint", "total")


@dataclass
class DeltasyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info``: the step to hold after the update (a step number, or ``"latest"``)."""

    step: int | str = "latest"

    def __post_init__(self) -> None:
        ok = self.step == "latest" or (isinstance(self.step, int) and not isinstance(self.step, bool)
                                       and 0 <= self.step <= MAX_STEP)
        if not ok:
            raise ConfigError(f"deltasync update_info: step must be a step number or 'latest', got {self.step!r}")


def _crossing(e: DeltaSyncError) -> DeltaSyncError:
    """The same error with its record leading its text (``deltasync.errors.to_text``): vLLM relays only ``str(e)``
    to a client in another process, which rebuilds the error, and whether retrying can help, from that record
    (``deltasync.errors.in_text``)."""
    text = to_text(e)
    if str(e) == text:
        return e
    try:
        crossing = type(e)(text, **e.context())  # the attributes a program in this process reads stay on it
    except TypeError:  # an error class with other constructor arguments: the record still names the class
        crossing = EngineError(text)
    return crossing


class DeltasyncWeightTransferEngine(WeightTransferEngine[Any, DeltasyncUpdateInfo]):
    """Keeps this worker's model at a step of a deltasync stream (see the module docstring)."""

    init_info_cls = EngineSettings  # the one settings record (settings.py): what every client sends
    update_info_cls = DeltasyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._info: EngineSettings | None = None
        self._reader: StreamReader | None = None
        self._state: WorkerState | None = None
        self._held: int | None = None
        self._checkpoint_loaded = False  # a load_format="dummy" engine, once deltasync loaded its checkpoint
        self._prefetcher: Prefetcher | None = None
        self._rdma: Any = None  # deltasync.RdmaConsumer when init_info names a controller
        self._feed: EventFeed | None = None  # init_info.notify's event feed
        self.pauses_s: list[float] = []  # write + verify time of each applied step
        # where the time of each update_weights call that moved the engine went (seconds, see PAUSE_PARTS)
        self.pause_parts: list[dict[str, float]] = []
        self.sealed_steps: list[int] = []  # steps written from a seal (a plain scatter inside the pause)
        # what init planned: tensors in place, host copies and their bytes, FP8 layers (plan.build_state's summary)
        self.init_summary: dict[str, Any] = {}
        # the runtime fingerprint of the step held (docs/FORMAT.md section 5f): see fingerprint_status
        self.config: dict[str, Any] = {}
        self.config_key: str | None = None
        # the last fingerprint: {"step", "rank": this rank's RankFingerprint (None while pending), "check", "note",
        # "seconds"}
        self._print: dict[str, Any] | None = None
        self._print_thread: threading.Thread | None = None
        self._fault: str | None = None  # a mismatch found after an update returned: undone at the next update
        self._last_update: tuple[int | None, list[tuple[int, list[Staged]]]] | None = None  # (start, done)
        self.applied_unix_s: float | None = None  # when the step held was applied (this host's clock)
        self.last_error: str | None = None  # the last update's error (None: it succeeded)

    @property
    def held_step(self) -> int | None:
        """The verified step this worker's weights are at (None: the weights it started with, step unknown)."""
        return self._held

    def is_staged(self, step: int) -> bool:
        """Whether the prefetcher holds ``step`` ready, so an update to it only writes and compares."""
        return self._prefetcher is not None and self._prefetcher.has(step)

    # --- vLLM's interface ---

    def parse_init_info(self, init_dict: dict[str, Any]) -> EngineSettings:
        """``init_info`` as :class:`EngineSettings`; a bad or unknown setting is a ``ConfigError`` naming it."""
        try:
            settings = EngineSettings.parse(init_dict)
            settings.location()  # a URL is set
            return settings
        except DeltaSyncError as e:
            raise _crossing(e) from e

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltasyncUpdateInfo:
        try:
            return super().parse_update_info(update_dict)
        except DeltaSyncError as e:
            raise _crossing(e) from e

    def init_transfer_engine(self, init_info: EngineSettings) -> None:
        try:
            self._init(init_info)
        except DeltaSyncError as e:
            raise _crossing(e) from e

    def _init(self, init_info: EngineSettings) -> None:
        old = self._info
        if self._state is None or old is None or (old.mode, old.representation, old.max_host_bytes) != (
                init_info.mode, init_info.representation, init_info.max_host_bytes):
            # routes and shadows depend on the model only: learned once, from the engine as it loaded its
            # checkpoint, and kept when the engine is pointed at another stream (its weights may have moved since)
            self.shutdown()
            refuse_moving_experts(self.vllm_config)
            if self.vllm_config.load_config.load_format == "dummy" and not self._checkpoint_loaded:
                # random weights vLLM never read from the checkpoint: nothing to learn the layouts from until it
                # holds one; loaded once (later inits find the weights this engine's updates wrote)
                log.info("deltasync: the engine started with load_format='dummy': loading %s through vLLM first",
                         self.model_config.model)
                load_checkpoint(self.vllm_config, self.model, self.model_config.model)
                self._checkpoint_loaded = True
            layout = checkpoint_layout(self.model_config.model)
            self._state, summary = build_state(
                self.model, layout=layout, checkpoint=self.model_config.model, mode=init_info.mode,
                reload=self._reload, representation=init_info.representation,
                max_host_bytes=init_info.max_host_bytes,
            )
            self.init_summary = summary
            log.info("deltasync engine routes: %s", summary)
            self.config = engine_config(self.vllm_config)
            self.config_key = config_key(self.config)
            old = None
        summed: set[str] = set()  # tensors whose checksums were just computed from the bits held (state.sums)
        if init_info.same_stream(old):
            if init_info.step is not None and self._held is not None and init_info.step != self._held:
                log.warning("deltasync: init_info says step %d, this engine holds step %d (kept)", init_info.step,
                            self._held)
            self._stop_prefetch()
        else:
            self._close_stream()
            trusted = init_info.trusted()  # the trusted keys less the revoked ones: the follower's own set
            self._reader = StreamReader(init_info.location(), trusted_keys=trusted)
            self._held = None
            if init_info.step is not None:  # asserted, not reached through verified steps: proved before believed
                summed = self._prove_held(init_info.step)
            log.info("deltasync engine following %s from step %s", init_info.url, self._held)
        self._info = init_info
        # every kernel its parameters' widths need, compiled or loaded now: nothing compiles inside a pause
        warm_kernels({h.bits.element_size() for h in self._state.homes.values()})
        if init_info.verify == "incremental" and self._held is not None and not summed.issuperset(self._state.homes):
            self._state.checksums()  # the base of incremental verification: computed now, not inside a pause
        if init_info.rdma is not None and self._rdma is None:
            self._rdma = self._rdma_consumer(init_info)
        if init_info.prefetch:
            # one watcher per engine: the first rank watches the stream and tells the others what to stage
            board, plans = self._plan_board()
            reader = self._rdma.reader if self._rdma is not None else StreamReader(init_info.location())
            assert self._reader is not None  # opened above, or by the init this one continues (same stream)
            reader.trusted = self._reader.trusted  # the prefetcher's reader checks with the engine's own key set
            # over NIXL the trainer announces each step, or a mirror does: the watching rank hears of it at once (a
            # hint it checks); otherwise the store's own feed where it has one, else polls by the stream's cadence
            if plans is None and init_info.notify is not None and self._rdma is None:
                self._feed = EventFeed(init_info.notify)
            self._prefetcher = Prefetcher(reader, self._state, lambda: self._held,
                                          notifier=None if plans is not None else self._rdma or self._feed,
                                          anchor_deltas=self._rdma is None, board=board, plans=plans)
        if self._held is not None and init_info.fingerprint != "off" and (
                self._print is None or self._print["step"] != self._held):
            self._start_fingerprint(self._held)  # the step it starts at, proved by checksums: now by its runtime bytes

    def start_weight_update(self) -> None:
        try:
            self._require()
        except DeltaSyncError as e:
            raise _crossing(e) from e

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        try:
            self._receive(update_info)
            self.last_error = None
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"[:2000]
            if isinstance(e, DeltaSyncError):
                raise _crossing(e) from e
            raise

    def _receive(self, update_info: DeltasyncUpdateInfo) -> None:
        reader, _ = self._require()
        self._settle_fingerprint()
        parts = dict.fromkeys(PAUSE_PARTS, 0.0)
        t0 = time.perf_counter()
        want = update_info.step
        if want == "latest":
            latest = reader.latest_step()
            want = _all_gather(latest)[0]  # every rank goes where rank 0 saw the stream
            if want is None:
                raise StepNotFoundError(f"{reader.url}: the stream has no committed step yet")
        assert isinstance(want, int)
        if want == self._held:
            return
        # over NIXL a step is read as itself (no base): no catch-up deltas (docs/FORMAT.md section 5g) then
        chain = self._staged_chain(want) or reader.chain(want, start=self._held, catchup=self._rdma is None)
        parts["resolve"] = time.perf_counter() - t0
        start, done = self._held, []  # the steps written so far, with their patches: undone if a later one fails
        try:
            for step in chain:
                done.append((step, self._advance(step, parts)))
            if self._info is not None and self._info.fingerprint == "pause":
                t_print = time.perf_counter()
                outcome = _all_gather(self._fingerprint(want))  # every rank learns of any rank's mismatch
                failed = [text for text in outcome if text is not None]
                if failed:
                    more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
                    raise FingerprintMismatchError(failed[0] + more)
                parts["fingerprint"] = time.perf_counter() - t_print
        except Exception as e:
            if done:  # all or nothing: back to the step held before the update (the failed step undid itself)
                e.args = (f"{e}; {self._undo(done, start, want)}",)
            raise
        finally:
            if self._prefetcher is not None:  # seal the next step against the bits held now, not at the next poll
                self._prefetcher.wake()  # (once the whole chain is written: a seal holds the state's lock)
        parts["total"] = time.perf_counter() - t0
        self.pause_parts.append(parts)
        self.applied_unix_s = time.time()
        self._last_update = (start, done)  # kept until the next update: undone if its fingerprint turns out wrong
        if self._info is not None and self._info.fingerprint == "after":
            self._start_fingerprint(want)

    def _undo(self, done: list[tuple[int, list[Staged]]], start: int | None, want: int) -> str:
        """Undo the steps of a failed update, newest first, and say where the engine is.

        Every step was written as XOR patches against the bits held before it (an anchor too: its dense XOR), so
        writing the same patches again restores those bits exactly; every rank undoes its own, since every rank
        learned of the failure before any raised. Should an undo write fail, the engine's weights are no longer
        known: it holds no step, and the next update starts from an anchor."""
        _, state = self._require()
        try:
            for _, staged in reversed(done):
                state.write(staged)
        except Exception as e:  # noqa: BLE001 - reported in the error being raised
            self._held = None
            return (f"undoing steps {[s for s, _ in done]} failed too ({type(e).__name__}: {e}): the engine's weights "
                    f"are unknown, the next update starts from an anchor")
        self._held = start
        return (f"the update to step {want} was undone whole (steps {[s for s, _ in done]} written before it): the "
                f"engine holds step {start} again, bit for bit")

    # --- the runtime fingerprint (docs/FORMAT.md section 5f) ---

    def _fingerprint(self, step: int) -> str | None:
        """Fingerprint what this rank computes with at ``step`` and compare it with the reference stored for this
        engine's configuration and step, if any; returns the mismatch's description (None: no mismatch)."""
        t0 = time.perf_counter()
        reader, _ = self._require()
        mine = fingerprint_model(self.model)
        check, note, error = "no reference", "", None
        assert self.config_key is not None
        path = f"{reader.url}/fingerprints/{self.config_key}/{step:012d}.json"
        try:
            ref = read_reference(reader.store, self.config_key, step, trusted=reader.trusted)
        except DeltaSyncError as e:  # unsigned where keys are trusted, badly signed, not a reference, unreachable
            ref, check, note = None, "refused", f"{path}: not compared: {type(e).__name__}: {e}"
            log.warning("deltasync: %s", note)
        if ref is not None:
            rank, size = rank_and_size()
            if len(ref.ranks) != size:
                check, note = "refused", f"{path}: not compared: it holds {len(ref.ranks)} rank(s), this engine {size}"
                log.warning("deltasync: %s", note)
            else:
                error = mismatch_note(path, rank, step, ref, mine.tensors, signed=reader.trusted is not None)
                check, note = ("mismatch", error) if error is not None else ("match", "")
        self._print = {"step": step, "rank": mine, "check": check, "note": note,
                       "seconds": time.perf_counter() - t0}
        return error

    def _start_fingerprint(self, step: int) -> None:
        """Fingerprint ``step`` on a thread of its own (off the pause; the next update waits for it first)."""
        self._print = {"step": step, "rank": None, "check": "pending", "note": "", "seconds": None}

        def run() -> None:
            try:
                error = self._fingerprint(step)
            except Exception as e:  # noqa: BLE001 - reported in the status, never a crash of the worker
                self._print = {"step": step, "rank": None, "check": "refused", "seconds": None,
                               "note": f"the fingerprint failed: {type(e).__name__}: {e}"}
                log.exception("deltasync: fingerprint of step %d failed", step)
                return
            if error is not None:
                self._fault = error
                log.error("deltasync: %s. The engine is unhealthy: the next update undoes step %d first", error, step)

        self._print_thread = threading.Thread(target=run, name="deltasync-fingerprint", daemon=True)
        self._print_thread.start()

    def _settle_fingerprint(self) -> None:
        """Wait for a fingerprint still running (no bits change under it); if any rank found a mismatch after the
        last update returned, undo that update on every rank and raise ``FingerprintMismatchError``."""
        thread, self._print_thread = self._print_thread, None
        if thread is not None:
            thread.join()
        fault = next((f for f in _all_gather(self._fault) if f is not None), None)
        self._fault = None
        if fault is None:
            return
        last, self._last_update = self._last_update, None
        held = self._held
        if last is None or not last[1]:  # the step the engine started at: nothing to undo, its weights unknown
            self._held = None
            raise FingerprintMismatchError(f"{fault}; the engine started at step {held} with these weights: they are "
                                           "unknown now, and the next update writes an anchor")
        start, done = last
        assert held is not None
        raise FingerprintMismatchError(f"{fault} (found after the update to step {held} returned); "
                                       f"{self._undo(done, start, held)}")

    def fingerprint_status(self, *, tensors: bool = False) -> dict[str, Any]:
        """This rank's runtime fingerprint record: configuration key (and configuration), the step fingerprinted,
        its digest, the comparison with a reference (``check``, ``note``), its seconds, how many modules' kernels
        are opaque to it, and ``unhealthy`` (a mismatch found after the update, undone at the next); with
        ``tensors``, every tensor's fingerprint."""
        p = self._print or {}
        mine: RankFingerprint | None = p.get("rank")
        when = self._info.fingerprint if self._info is not None else None
        out: dict[str, Any] = {
            "config_key": self.config_key, "config": self.config, "when": when, "step": p.get("step"),
            "digest": mine.digest if mine is not None else None,
            "check": p.get("check", "off" if when == "off" else None), "note": str(p.get("note", ""))[:2000],
            "seconds": p.get("seconds"), "opaque": len(mine.opaque) if mine is not None else 0,
            "unhealthy": self._fault,
        }
        if tensors and mine is not None:
            out["tensors"] = {n: [t.checksum, t.dtype, t.shape] for n, t in mine.tensors.items()}
        return out

    def finish_weight_update(self) -> None:
        pass  # the weights were written in place, verified, by receive_weights

    def shutdown(self) -> None:
        self._close_stream()
        self._state = self._info = None

    def _close_stream(self) -> None:
        """Stop reading the stream followed now (prefetcher, NIXL consumer, reader, a fingerprint running); the
        routes stay."""
        thread, self._print_thread = self._print_thread, None
        if thread is not None:
            thread.join()
        self._fault, self._last_update, self._print = None, None, None
        self._stop_prefetch()
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None
        if self._reader is not None:
            self._reader.close()
        self._reader = None

    # --- one step ---

    def _advance(self, step: int, parts: dict[str, float]) -> list[Staged]:
        """Write and verify one step (all or nothing on every rank); returns the patches written (XOR: writing
        them again undoes the step)."""
        reader, state = self._require()
        t_stage = time.perf_counter()
        ready = self._prefetcher.take(step) if self._prefetcher is not None else None
        if ready is not None and ready.header.kind == "delta" and ready.header.base_step != self._held:
            ready = None  # staged by another way (a catch-up delta, docs/FORMAT.md 5g, or not): read it now
        # not staged yet: read it now, over NIXL first when the engine has a ring (self._reader has none)
        # over NIXL the ring carries anchors whole: there an anchor is read as itself, elsewhere by its own delta
        prepared = ready or (prepare(self._rdma.reader, state, step) if self._rdma is not None
                             else prepare(reader, state, step, base=self._held))
        h = prepared.header
        if h.kind == "delta" and h.base_step != self._held:
            raise BaseStepMismatchError(
                f"{prepared.where}: delta to step {step} is based on step {h.base_step}, the engine holds step "
                f"{self._held}", step=step, expected=h.base_step, found=self._held,
            )
        staged = (prepared.staged if prepared.anchor is None
                  else state.route_patches(state.anchor_patches(prepared.anchor)))
        assert staged is not None
        t0 = time.perf_counter()
        parts["staging"] += t0 - t_stage
        error: BaseException | None = None
        try:
            sealed = state.write_sealed(staged, prepared.seal) if prepared.seal is not None else None
            sums = sealed if sealed is not None else state.write(staged)
            if sealed is not None:
                self.sealed_steps.append(step)
        except Exception as e:  # every rank must learn of it before any raises
            error, sums = e, {}
        t1 = time.perf_counter()
        parts["write"] += t1 - t0
        outcome = _all_gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, text) for rank, text in enumerate(outcome) if text is not None]
        if failed:
            if error is None:
                state.rollback()
            rank, text = failed[0]
            msg = (f"{prepared.where}: writing step {step} failed on {len(failed)} of {len(outcome)} rank(s), "
                   f"rank {rank}: {text}; every rank holds step {self._held} again")
            if error is not None:
                raise error
            raise EngineError(msg)
        parts["all_gather"] += time.perf_counter() - t1
        self._verify(state, prepared, sums, parts)
        self.pauses_s.append(time.perf_counter() - t0)
        self._held = step
        if self._rdma is not None:
            self._rdma.applied(step)  # the controller advances this engine's version once every rank did
        log.info("deltasync: engine at step %d (%s, written and verified in %.1f ms)", step, h.kind,
                 1e3 * self.pauses_s[-1])
        return list(staged)

    def _prove_held(self, step: int) -> set[str]:
        """Hold ``step`` only if every tensor's checksum, summed over the ranks, is that step's: an engine started
        from another step's checkpoint (an off-by-one ``--engine-step``) would otherwise be wrong for ever in
        every tensor no later step changes, while each update reported a match. ``HeldStepError`` names the
        first tensor that differs; the engine then holds no step (and is not pointed at the stream). Returns the
        tensors checksummed: ``checksums`` also made them the base of incremental verification."""
        reader, state = self._require()
        try:
            try:
                reader.manifest(step, nearby=False)
            except StepNotFoundError:
                raise HeldStepError(f"{reader.url}: init_info says the engine holds step {step}, which this stream has "
                                    "not committed: start the engine from one of its steps, or name no step (the "
                                    "first "
                                    f"update then writes an anchor)") from None
            with reader.open(step) as obj:
                state.check_header(obj.header, obj.where)
                want, where = {n: int(t.checksum, 16) for n, t in obj.header.tensors.items()}, obj.where
            parts = state.checksums(list(want))
            gathered = _all_gather(parts)
            bad = [n for n in want if add_checksums(*(g[n] for g in gathered)) != want[n]]
            # what vLLM derived after loading (prepacked experts, FP8 weights, widened copies) is not covered by
            # those checksums (shadowed modules are checked by their host copies): derived again from the weights
            # just proved, and compared with what the engine computed with
            derived = [] if bad else [(rank, names) for rank, names in enumerate(_all_gather(state.rederive()))
                                      if names]
        except BaseException:
            self._close_stream()
            raise
        if bad:
            self._close_stream()
            n = bad[0]
            raise HeldStepError(
                f"{where}: init_info says the engine holds step {step}, but its weights are not that step's: "
                f"{len(bad)} of {len(want)} tensor(s) differ, first {n!r} (step {step} has 0x{want[n]:016x}, the "
                f"engine 0x{add_checksums(*(g[n] for g in gathered)):016x}); start it from step {step}'s checkpoint "
                f"(deltasync replay), or name no step: the first update then writes an anchor", step=step, tensor=n,
                expected=f"0x{want[n]:016x}", found=f"0x{add_checksums(*(g[n] for g in gathered)):016x}")
        if derived:
            self._close_stream()
            rank, names = derived[0]
            count = sum(len(names) for _, names in derived)
            raise HeldStepError(
                f"{where}: init_info says the engine holds step {step}; its checkpoint-format weights are that step's, "
                f"but {count} tensor(s) vLLM derives from them after loading were not what vLLM derives from them, "
                f"first {names[0]!r} on rank {rank}: the engine computed with other weights than the ones it holds "
                f"(it loaded another checkpoint than {self.model_config.model!r} holds now, or a reload left a "
                f"transformed weight wrong). They are derived again now, but the claim is not believed: start the "
                f"engine from step {step}'s checkpoint (deltasync replay), or name no step: the first update then "
                f"writes an anchor", step=step, tensor=names[0])
        self._held = step
        return set(want)

    def _staged_chain(self, want: int) -> list[int] | None:
        """``[want]`` when the prefetcher holds it and it applies to the step held (a delta based on it, or an
        anchor): the manifest was read when it was staged, so the pause does not read it again."""
        prepared = self._prefetcher.peek(want) if self._prefetcher is not None else None
        if prepared is None or (prepared.header.kind == "delta" and prepared.header.base_step != self._held):
            return None
        return [want]

    def _verify(self, state: WorkerState, prepared: Prepared, sums: dict[str, int], timing: dict[str, float]) -> None:
        """Compare every rank's parts, summed, with the trainer's checksums; roll back every rank on a mismatch."""
        h = prepared.header
        assert self._info is not None
        t0 = time.perf_counter()
        if prepared.anchor is not None or self._info.verify == "all":
            parts = state.checksums(list(h.tensors))
        elif self._info.verify == "changed":
            parts = state.checksums([n for n, t in h.tensors.items() if t.changed])
        else:
            parts = sums
        parts = state.with_aliases(parts, h.tensors)  # a tied tensor the step holds: checked as the one it is tied to
        t1 = time.perf_counter()
        gathered = _all_gather(parts)
        t2 = time.perf_counter()
        bad = [n for n in parts if add_checksums(*(g[n] for g in gathered)) != int(h.tensors[n].checksum, 16)]
        timing["compare"] += (t1 - t0) + (time.perf_counter() - t2)
        timing["all_gather"] += t2 - t1
        if bad:
            state.rollback()
            n = bad[0]
            got = add_checksums(*(g[n] for g in gathered))
            raise ChecksumMismatchError(
                f"{prepared.where}: the engine's weights do not match the trainer's after step {prepared.step} "
                f"({len(bad)} tensor(s), first {n!r}: expected {h.tensors[n].checksum}, engine has 0x{got:016x}); "
                f"rolled back to step {self._held}", step=prepared.step, tensor=n, expected=h.tensors[n].checksum,
                found=f"0x{got:016x}",
            )

    # --- internals ---

    def _require(self) -> tuple[StreamReader, WorkerState]:
        if self._reader is None or self._state is None:
            raise EngineError(
                "the deltasync weight-transfer engine is not initialised: call init_weight_transfer_engine with "
                "init_info {'url': ...} first"
            )
        return self._reader, self._state

    def _reload(self, weights: list[tuple[str, torch.Tensor]], modules: set[str]) -> None:
        """Re-load checkpoint tensors into their (shadowed) layers through vLLM, processed as at first load."""
        reload_as_loaded(self.vllm_config, self.model, weights, modules)

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
            if self._rdma is None or self._prefetcher.reader is not self._rdma.reader:
                self._prefetcher.reader.close()
            self._prefetcher = None
        feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()

    def _plan_board(self) -> tuple[PlanBoard | None, PlanBoard | None]:
        """(the board this rank serves, the board it joined): with tensor parallelism only the first rank watches
        the stream and resolves the chain; it posts what to stage to the others (prefetch.py). A collective: every
        rank calls it in init. A rank that cannot join watches the stream itself (logged), as does every rank when
        the first cannot serve."""
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return None, None
        ips = _all_gather(_host_ip())
        local = all(ip == ips[0] for ip in ips)  # one machine: the board listens on loopback only
        board = address = None
        if group.rank_in_group == 0:
            try:
                board = PlanBoard.serve(group.world_size - 1, host="127.0.0.1" if local else "0.0.0.0")
                address = board.address
            except OSError as e:
                log.warning("deltasync: cannot serve stage plans to the other ranks (%s): each watches the stream", e)
        address = _all_gather(address)[0]
        if board is not None or address is None:
            return board, None
        try:
            return None, PlanBoard.join("127.0.0.1" if local else ips[0], *address)
        except OSError as e:
            log.warning("deltasync: cannot reach the first rank's stage plans at %s (%s): this rank watches the "
                        "stream itself", ips[0], e)
            return None, None

    def _rdma_consumer(self, info: EngineSettings) -> Any:
        """This rank's NIXL consumer: step objects read from the trainer's ring when announced, from the store
        otherwise (the prefetcher reads through it); one consumer per tensor-parallel rank, grouped by engine."""
        from vllm.distributed import get_tp_group

        from deltasync import RdmaConsumer

        options = dict(info.rdma or {})
        engine = str(options.pop("engine", "vllm"))
        plan_wait_s = float(options.pop("plan_wait_s", 0.0))
        rank = get_tp_group().rank_in_group
        return RdmaConsumer(info.location(), rdma=options, consumer_id=f"{engine}-tp{rank}", engine=engine,
                            plan_wait_s=plan_wait_s)


def _host_ip() -> str:
    """This machine's address as vLLM names it (``VLLM_HOST_IP`` or the outbound interface's)."""
    from vllm.utils.network_utils import get_ip

    return str(get_ip())
