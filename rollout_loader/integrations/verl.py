"""deltasync inside verl: a checkpoint engine in verl's registry, and a manager that updates vLLM in place.

verl moves weights from its actor ranks to its rollout replicas through a *checkpoint engine* chosen by name
(``actor_rollout_ref.rollout.checkpoint_engine.backend``). This module registers ``"deltasync"``; the
``verl.plugins`` entry point deltasync installs loads it on every ``import verl``, so a run names the backend and
its stream, nothing else::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltasync
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.url=s3://bucket/run-7

Each step reaches vLLM one of two ways:

- **The registry path** (:class:`DeltasyncCheckpointEngine`; every verl trainer that syncs a separate rollout
  through a checkpoint engine): actor rank 0 publishes the step, the other actor ranks drain their generator in
  step with it (producing each full tensor is collective over the actor group); every rollout worker reads the
  step from the store into a verified host copy and yields to verl's stock vLLM adapter the tensors that changed
  (all of them the first time). Sparse across the network; locally the adapter reloads the changed tensors.
- **The manager path** (:class:`DeltasyncCheckpointManager`; trainers that honour
  ``rollout.checkpoint_manager_class``): the actors publish the same way, then every vLLM server applies the step
  in place through deltasync's vLLM weight-transfer engine: verified on every rank against the trainer's
  checksums, undone whole on any failure, no reload and no host copy.

Options come from ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync`` (:class:`VerlSettings`);
a bad one is a ``ConfigError`` naming that setting. Importing this module imports verl, Ray and torch;
``import rollout_loader`` does not import it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await

from deltasync import DeltaPublisher, StreamReader
from deltasync.engine import MAX_STEP, Manifest, Replica, TrustedKeys, Verify, pem_texts
from deltasync.errors import ConfigError, EngineError, StepOrderError

log = logging.getLogger(__name__)

__all__ = ["BACKEND", "SETTINGS", "DeltasyncCheckpointEngine", "DeltasyncCheckpointManager", "VerlSettings",
           "step_metrics"]

BACKEND = "deltasync"
SETTINGS = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync"  # where users set the options
_ROLLOUT = "actor_rollout_ref.rollout"
EngineVerify = Literal["incremental", "changed", "all"]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _refuse(name: str, expected: str, got: Any) -> ConfigError:
    """A bad option, named by the full path a verl user sets it at."""
    return ConfigError(f"{SETTINGS}.{name} must be {expected}, got {got!r}")


@dataclass(frozen=True, kw_only=True)
class VerlSettings:
    """The ``deltasync`` backend's options: ``checkpoint_engine.engine_kwargs.deltasync`` in verl's config.

    Args:
        url: the stream (``s3://bucket/run-7``, ``hf://buckets/me/rl/run-7``, a folder every process reaches).
        storage_options: fsspec options of the store (credentials, endpoint).
        dtype: the published dtype of floating tensors: ``"bfloat16"`` (the rollout's usual dtype: fp32 master
            weights publish as the bf16 bits vLLM would cast them to), ``"float16"``, ``"float32"`` or None (as the
            actor yields them).
        anchor_every: a full snapshot every this many published steps (>= 1).
        signing_key: a private key file (``deltasync keygen``, mode 0600) on the actor rank 0's node: every step
            is signed with it.
        trusted_keys: public keys (PEM text, or files where the reader runs): only steps they signed are read.
        verify: how the vLLM engines check each step (manager path): ``"incremental"`` (each changed tensor's
            checksum follows from the patched elements), ``"changed"`` or ``"all"`` (recomputed from the bits).
            The registry path's host copy verifies incrementally, or from the bits with the other two.
        prefetch: the vLLM engines read, verify and decode the next step as soon as it is committed, before the
            update asks for it (manager path); False saves the host memory of that staged step.
        changed_only: the registry path yields only the tensors that changed since the step the rollout holds;
            False yields every tensor every step (for rollouts whose weight loading must see every tensor, such
            as quantized ones that re-quantize on load).
        timeout_s: how long a rollout worker waits for the actor's step to be committed (registry path).

    Raises:
        ConfigError: a missing ``url``, an unknown option, or a value of the wrong type or out of range, named as
            ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.<option>``.

    Example::

        VerlSettings.parse({"url": "s3://bucket/run-7", "storage_options": {"anon": False}})
    """

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = "bfloat16"
    anchor_every: int = 20
    signing_key: str | None = None
    trusted_keys: tuple[str, ...] | None = None
    verify: EngineVerify = "incremental"
    prefetch: bool = True
    changed_only: bool = True
    timeout_s: float = 600.0

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> VerlSettings:
        """The settings from verl's ``engine_kwargs.deltasync`` (a dict or an OmegaConf node), checked."""
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"{SETTINGS} must be a mapping of deltasync options, got {type(options).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ConfigError(f"{SETTINGS}.{unknown[0]} is not a deltasync option; the options are {known}")
        if options.get("url") is None:
            raise ConfigError(f"{SETTINGS}.url is missing: the stream's URL, e.g. "
                              f"+{SETTINGS}.url=s3://bucket/run-7")
        return cls(**{k: _plain(v) for k, v in options.items()})

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise _refuse("url", "the stream's URL (a non-empty string)", self.url)
        if not isinstance(self.storage_options, Mapping) or not all(isinstance(k, str) for k in self.storage_options):
            # never echo the value: it may hold credentials
            raise ConfigError(f"{SETTINGS}.storage_options must be a mapping of fsspec options, got "
                              f"{type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise _refuse("dtype", f"one of {sorted(_DTYPES)} or null", self.dtype)
        if isinstance(self.anchor_every, bool) or not isinstance(self.anchor_every, int) or self.anchor_every < 1:
            raise _refuse("anchor_every", "a whole number >= 1", self.anchor_every)
        if self.signing_key is not None and (not isinstance(self.signing_key, str) or not self.signing_key):
            raise _refuse("signing_key", "the path of a private key file (deltasync keygen)", self.signing_key)
        if self.trusted_keys is not None:
            keys = [self.trusted_keys] if isinstance(self.trusted_keys, str) else self.trusted_keys
            if (not isinstance(keys, Sequence) or not keys or len(keys) > 64
                    or not all(isinstance(k, str) and k for k in keys)):
                raise _refuse("trusted_keys", "a list of public keys (PEM text or key files), 1 to 64", keys)
            object.__setattr__(self, "trusted_keys", tuple(keys))
        if self.verify not in get_args(EngineVerify):
            raise _refuse("verify", f"one of {list(get_args(EngineVerify))}", self.verify)
        if not isinstance(self.prefetch, bool):
            raise _refuse("prefetch", "true or false", self.prefetch)
        if not isinstance(self.changed_only, bool):
            raise _refuse("changed_only", "true or false", self.changed_only)
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not 0 < self.timeout_s <= 7 * 86400):
            raise _refuse("timeout_s", "seconds > 0 (at most a week)", self.timeout_s)

    @property
    def publish_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else _DTYPES[self.dtype]

    def trusted(self) -> TrustedKeys | None:
        """The trusted keys, loaded (files read here); ``ConfigError`` naming the option for a bad one."""
        if self.trusted_keys is None:
            return None
        try:
            return TrustedKeys.load(list(self.trusted_keys))
        except ConfigError as e:
            raise ConfigError(f"{SETTINGS}.trusted_keys: {e}") from None

    def init_info(self) -> dict[str, Any]:
        """The deltasync vLLM engine's ``init_info`` (JSON-safe: key files read here, sent as PEM text)."""
        # TODO(interfaces 1): EngineSettings(url=..., storage_options=..., verify=..., trusted_keys=...).init_info()
        info: dict[str, Any] = {"url": self.url, "storage_options": dict(self.storage_options), "verify": self.verify,
                                "prefetch": self.prefetch}
        if self.trusted_keys is not None:
            self.trusted()  # a bad key is named here, not by a vLLM worker
            info["trusted_keys"] = pem_texts(list(self.trusted_keys))
        return info


def _plain(value: Any) -> Any:
    """An OmegaConf node (verl's config) as plain Python containers; anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def step_metrics(manifest: Manifest) -> dict[str, float]:
    """A committed step as verl metrics (floats; the names verl's own delta backend uses where they exist).

    ``payload_mbytes``: the step's stored bytes (what a follower that holds the step before it downloads, or the
    anchor's full bytes); ``changed_ratio``: the fraction of elements that changed; ``changed_elems``.
    """
    return {
        "checkpoint_engine/deltasync_step": float(manifest.step),
        "checkpoint_engine/deltasync_anchor": 1.0 if manifest.kind == "anchor" else 0.0,
        "checkpoint_engine/payload_mbytes": manifest.object_bytes / (1 << 20),
        "checkpoint_engine/changed_ratio": float(manifest.stats.density),
        "checkpoint_engine/changed_elems": float(manifest.stats.changed),
    }


async def _drain(weights: Any) -> None:
    """Walk a weights generator to its end: every actor rank must, since producing each tensor is collective."""
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


@CheckpointEngineRegistry.register(BACKEND)
class DeltasyncCheckpointEngine(CheckpointEngine):
    """verl's ``deltasync`` checkpoint engine: publish on the actor side, follow the stream on the rollout side.

    verl makes one per actor rank (``is_master`` on rank 0) and one per rollout worker, with the options of
    ``checkpoint_engine.engine_kwargs.deltasync`` as keyword arguments (:class:`VerlSettings`); which side an
    instance is on shows in the method verl calls. No process group joins the two sides: the store does.

    Step numbers are verl's ``global_steps``. A step this engine published last, or ``global_steps=None`` (verl
    passes the same step, or none, only to wake replicas again with unchanged weights), publishes nothing; so
    does the first step of a resumed run when the stream's newest step is that very step. A step at or below
    the stream's newest step otherwise is a ``StepOrderError``: the run resumed from a checkpoint older than
    the stream's newest step, whose later steps it would contradict; publish to a new ``url``.

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes (unused: nothing is bucketed here).
        is_master: set by verl on actor rank 0, the rank that publishes.
        **options: :class:`VerlSettings`.

    Raises:
        ConfigError: a bad option, named as verl's setting.

    Example (what verl does on actor rank 0)::

        engine = CheckpointEngineRegistry.new("deltasync", is_master=True, bucket_size=2 << 30, url="s3://b/run")
        metrics = await engine.send_weights(actor.engine.get_per_tensor_param()[0], global_steps=12)
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **options: Any) -> None:
        self.settings = VerlSettings.parse(options)
        self.settings.trusted()  # a bad key file fails the worker's start, not its first step
        self.bucket_size = bucket_size
        self.is_master = is_master
        self._publisher: DeltaPublisher | None = None
        # the step being published, where the publisher's source function finds it (a box, not self: the
        # publisher must not keep this engine alive, or the finalizer below would never run)
        self._weights: list[dict[str, torch.Tensor]] = [{}]
        self._published: int | None = None  # the step this engine published (or found committed) last
        self._newest: int | None = None  # the stream's newest committed step, as this engine knows it
        self._reader: StreamReader | None = None
        self._replica: Replica | None = None  # the rollout side's verified host copy
        self._delivered: int | None = None  # the step the adapter took whole; None: unknown, yield everything
        self._finalizer: weakref.finalize | None = None  # closes the publisher and reader if close() is not called

    # --- no process group: the store joins the two sides ---

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        pass

    def finalize(self) -> None:
        pass  # the publisher and reader stay open from step to step (close() ends them)

    def close(self) -> None:
        """Flush and close the publisher (releasing the stream's lease) and the reader."""
        if self._finalizer is not None:
            self._finalizer.detach()
        _close([self._publisher, self._reader])
        self._publisher = self._reader = None

    def _track(self) -> None:
        """Close what is open when this engine is collected, or at exit (verl never calls a close)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, [self._publisher, self._reader])

    # --- actor side ---

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the actor's weights as step ``global_steps`` (rank 0) and return once it is committed; on the
        other ranks only walk the generator. Returns the step's metrics (:func:`step_metrics`) on rank 0."""
        if not self.is_master:
            await _drain(weights)
            return {}
        try:
            pub = self._open_publisher()
            step, publish = self._step_for(global_steps)
        except BaseException:
            await _drain(weights)  # the other ranks' gathers still need this rank
            raise
        if not publish:
            await _drain(weights)
            log.info("deltasync: step %d is in the stream already: nothing published", step)
        else:
            t0 = time.perf_counter()
            await self._publish(pub, step, weights)
            await asyncio.to_thread(pub.flush)
            self._newest = step
            log.info("deltasync: published step %d in %.2f s", step, time.perf_counter() - t0)
        self._published = step
        reader = self._open_reader()
        return step_metrics(await asyncio.to_thread(reader.manifest, step))

    def _open_publisher(self) -> DeltaPublisher:
        if self._publisher is None:
            s, box = self.settings, self._weights
            self._publisher = DeltaPublisher(
                s.url, lambda: box[0], storage_options=s.storage_options, anchor_every=s.anchor_every,
                dtype=s.publish_dtype, signing_key=s.signing_key, on_backlog="block",  # never skip a verl step
            )
            self._newest = self._publisher.last_committed_step
            self._track()
        return self._publisher

    def _step_for(self, global_steps: int | None) -> tuple[int, bool]:
        """The step to publish as, and whether to publish it (see the class docstring)."""
        where = f"{self.settings.url}: verl's global_steps"
        if global_steps is None:
            if self._published is not None:
                return self._published, False
            return (0 if self._newest is None else self._newest + 1), True
        if isinstance(global_steps, bool) or not isinstance(global_steps, int) or not 0 <= global_steps <= MAX_STEP:
            raise StepOrderError(f"{where} must be a step number (0..{MAX_STEP}), got {global_steps!r}")
        if global_steps == self._published:
            return global_steps, False
        if self._newest is not None and global_steps <= self._newest:
            if global_steps == self._newest and self._published is None:
                return global_steps, False  # a resumed run starts at the step the stream ends with
            raise StepOrderError(
                f"{where} is {global_steps}, but the stream already holds steps up to {self._newest}: the run "
                f"resumed from a checkpoint older than the stream's newest step, whose later steps it would "
                f"contradict; publish to a new stream ({SETTINGS}.url)")
        return global_steps, True

    async def _publish(self, pub: DeltaPublisher, step: int, weights: Any) -> None:
        """Capture ``weights`` as ``step`` (diffed against the step before; encoded and uploaded behind)."""
        # TODO(stream): pub.publish(step, weights=weights) once branch `stream` lands: each tensor diffed as it
        # arrives, instead of this second copy of the model on the host
        dtype = self.settings.publish_dtype
        collected: dict[str, torch.Tensor] = {}
        try:
            if hasattr(weights, "__aiter__"):
                async for name, tensor in weights:
                    collected[name] = _host(tensor, dtype)
            else:
                for name, tensor in weights:
                    collected[name] = _host(tensor, dtype)
        except BaseException:
            await _drain(weights)
            raise
        self._weights[0] = collected
        try:
            pub.publish(step)
        finally:
            self._weights[0] = {}

    # --- rollout side ---

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield step ``global_steps`` (None: the newest committed step) to verl's server adapter: every tensor
        the first time, afterwards only those that changed since the step the adapter last took whole.

        Waits up to ``timeout_s`` for the actor to commit the step (verl runs both sides at once). The tensors
        come from a host copy of the weights, advanced and verified against the trainer's checksums first."""
        names = await asyncio.to_thread(self._advance, global_steps)
        assert self._replica is not None
        tensors, step = self._replica.tensors, self._replica.step
        self._delivered = None  # until the adapter has taken every tensor: a failure in between resends all
        for name in names:
            yield name, tensors[name]
        self._delivered = step

    def _open_reader(self) -> StreamReader:
        if self._reader is None:
            s = self.settings
            self._reader = StreamReader(s.url, storage_options=s.storage_options, trusted_keys=s.trusted())
            self._track()
        return self._reader

    def _advance(self, global_steps: int | None) -> list[str]:
        """Bring the host copy to the step; return the names to yield."""
        reader = self._open_reader()
        timeout_s = self.settings.timeout_s
        if global_steps is None:
            step = reader.wait_for(None, timeout_s=timeout_s)
        else:
            step = global_steps
            reader.wait_for(step, timeout_s=timeout_s)
            reader.manifest(step)  # committed (StepNotFoundError otherwise: the stream went past it without it)
        verify: Verify = "incremental" if self.settings.verify == "incremental" else "full"
        rep = self._replica
        held = rep.step if rep is not None else None
        changed = None if rep is None or step < rep.step else self._catch_up(reader, rep, step, verify)
        if changed is None:
            self._replica = reader.replica(step, verify=verify)
        assert self._replica is not None
        names = list(self._replica.tensors)
        if changed is not None and self.settings.changed_only and self._delivered is not None \
                and self._delivered == held:
            names = [n for n in names if n in changed]
        log.info("deltasync: rollout at step %d, yielding %d of %d tensors", step, len(names),
                 len(self._replica.tensors))
        return names

    @staticmethod
    def _catch_up(reader: StreamReader, rep: Replica, step: int, verify: Verify) -> set[str] | None:
        """Advance ``rep`` to ``step`` along the cheapest chain; the names it changed (aliases included), or None
        where an anchor brings other tensors than the copy holds (a new copy is needed)."""
        changed: set[str] = set()
        aliases: dict[str, str] = {}
        for s in reader.chain(step, start=rep.step):
            with reader.open(s, base=rep.step) as obj:
                h = obj.header
                if h.kind == "anchor" and h.tensors.keys() != rep.checksums.keys():
                    return None
                rep.apply(obj, verify=verify)
                changed.update(n for n, t in h.tensors.items() if h.kind == "anchor" or t.changed)
                aliases.update(h.aliases)
        changed.update(a for a, target in aliases.items() if target in changed)
        return changed


def _host(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor as published: cast on its own device (less to copy), then on the host."""
    t = tensor.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu")


def _close(things: list[Any]) -> None:
    for thing in things:
        if thing is None:
            continue
        try:
            thing.close()
        except Exception as e:  # noqa: BLE001 - closing at exit: say so, never raise
            log.warning("deltasync: closing %s failed: %s", type(thing).__name__, e)


# --- the manager path ---


def _check_replica(replica: Any) -> None:
    """A replica whose vLLM servers the deltasync engine can update in place, or a ConfigError naming why not."""
    config = replica.config
    name = getattr(config, "name", None)
    if name != "vllm":
        raise ConfigError(f"{_ROLLOUT}.name must be vllm for DeltasyncCheckpointManager (its servers apply steps "
                          f"through vLLM's weight-transfer engine), got {name!r}")
    mode = getattr(getattr(replica, "rollout_mode", None), "name", None)
    if mode == "HYBRID":
        raise ConfigError(f"{_ROLLOUT}: DeltasyncCheckpointManager updates rollout replicas of their own (standalone "
                          "or colocated); a hybrid replica shares the trainer's processes: use "
                          f"{_ROLLOUT}.checkpoint_engine.backend=naive there")
    if getattr(config, "data_parallel_size", 1) != 1:
        raise ConfigError(f"{_ROLLOUT}.data_parallel_size must be 1 for DeltasyncCheckpointManager (a server's "
                          f"collective_rpc reaches one data-parallel shard), got {config.data_parallel_size!r}")
    transfer = _plain((_plain(getattr(config, "engine_kwargs", None)) or {}).get("vllm") or {}).get(
        "weight_transfer_config")
    if isinstance(transfer, str):  # vLLM's command line takes it as JSON text too
        try:
            transfer = json.loads(transfer)
        except ValueError:
            pass
    if (transfer.get("backend") if isinstance(transfer, Mapping) else None) != BACKEND:
        raise ConfigError(f"{_ROLLOUT}.engine_kwargs.vllm.weight_transfer_config must be {{backend: {BACKEND}}} for "
                          f"DeltasyncCheckpointManager (vLLM's servers apply each step with deltasync's engine), "
                          f"got {transfer!r}: add +{_ROLLOUT}.engine_kwargs.vllm.weight_transfer_config.backend="
                          f"{BACKEND}")


def _reason(e: BaseException) -> str:
    """An error as one line: Ray's wrapper unwrapped, the engine's own text (which names its class)."""
    cause = getattr(e, "cause", None)
    inner = cause if isinstance(cause, BaseException) else e
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[-1] if text else ''}"


class DeltasyncCheckpointManager(CheckpointEngineManager):
    """A verl checkpoint manager that makes every vLLM server apply each step in place through deltasync's engine.

    Set as ``actor_rollout_ref.rollout.checkpoint_manager_class`` (honoured by verl's ``RayPPOTrainer`` and the
    ``experimental/separation`` trainer) with ``checkpoint_engine.backend=deltasync`` and vLLM started with
    ``engine_kwargs.vllm.weight_transfer_config={backend: deltasync}``. Each ``update_weights(global_steps)``:

    1. the actor ranks publish the step through :class:`DeltasyncCheckpointEngine` (rank 0 waits for the commit);
    2. generation is paused (verl's ``abort_all_requests``: in-flight requests are saved for partial rollout);
    3. every replica's vLLM server runs ``init_weight_transfer_engine`` (first time), ``start_weight_update``,
       ``update_weights({"step": N})`` and ``finish_weight_update`` on all its workers: each rank writes the chain
       from the step it holds to N in place, verifies it against the trainer's checksums and undoes it whole on
       any failure or mismatch (so a failed replica still holds its previous step, bit for bit);
    4. prefix and KV caches are reset, verl's version label set (``set_global_steps``), generation resumed.

    A replica holds step N once its update returned: the engine raises on every rank otherwise, and verl's server
    relays the error. When any replica fails, ``EngineError`` says which replica holds which step; calling
    ``update_weights`` again converges (a replica at N is left alone). Returns the step's metrics
    (:func:`step_metrics`) plus the seconds spent publishing and applying.

    The vLLM engine's own ``weight_version`` is not set: verl's server exposes no call that reaches it
    (``set_global_steps`` is verl's label). Data parallelism inside one replica and hybrid replicas are refused.

    Raises:
        ConfigError: (at construction) the backend is not ``deltasync``, its options are bad, or a replica is not
            a vLLM replica started with deltasync's weight-transfer engine; each names the setting.
        EngineError: (``update_weights``) a replica failed to apply the step.
    """

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        if getattr(config, "backend", None) != BACKEND:
            raise ConfigError(f"{_ROLLOUT}.checkpoint_engine.backend must be {BACKEND} with DeltasyncCheckpointManager "
                              f"(the actor ranks publish through it), got {getattr(config, 'backend', None)!r}")
        self.settings = VerlSettings.parse(_plain(config.engine_kwargs or {}).get(BACKEND))
        self._init_info = self.settings.init_info()
        super().__init__(config, actor_wg, replicas)
        for replica in self.replicas:
            _check_replica(replica)
        self.held: dict[int, int | None] = {}  # id(replica) -> the step it holds (absent: not updated by us)
        self._initialised: set[int] = set()
        self._reader: StreamReader | None = None

    def add_replicas(self, replicas: list[Any]) -> None:
        for replica in replicas:
            _check_replica(replica)
        super().add_replicas(replicas)

    def remove_replicas(self, replicas: list[Any]) -> None:
        for replica in replicas:
            self.held.pop(id(replica), None)
            self._initialised.discard(id(replica))
        super().remove_replicas(replicas)

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        refs = self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
        metrics: dict[str, float] = {}
        for result in await asyncio.gather(*refs):
            if isinstance(result, dict):
                metrics.update(result)
        if "checkpoint_engine/deltasync_step" not in metrics:
            raise EngineError(f"no actor rank published a step (results: {metrics}): is actor rank 0's checkpoint "
                              f"engine the {BACKEND!r} backend?")
        step = int(metrics["checkpoint_engine/deltasync_step"])
        t1 = time.perf_counter()
        await self.abort_replicas()
        try:
            outcomes = await asyncio.gather(*(self._apply(r, step) for r in self.replicas), return_exceptions=True)
        finally:
            await self.resume_generation_replicas()
        failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        if failed:
            raise EngineError(f"step {step}: {len(failed)} of {len(self.replicas)} rollout replica(s) failed to apply "
                              f"it; {self.describe()}; first failure, replica {failed[0][0]}: "
                              f"{_reason(failed[0][1])} (update_weights again retries the replicas behind)")
        metrics["checkpoint_engine/deltasync_publish_s"] = t1 - t0
        metrics["checkpoint_engine/deltasync_apply_s"] = time.perf_counter() - t1
        return metrics

    def describe(self) -> str:
        """Which replica holds which step, as far as this manager knows (``unknown``: not updated by it yet)."""
        return ", ".join(f"replica {i} holds step {self.held[id(r)] if self.held.get(id(r)) is not None else 'unknown'}"
                         for i, r in enumerate(self.replicas))

    async def _apply(self, replica: Any, step: int) -> None:
        """One replica to ``step``, in place, on every worker (through its node-0 server's AsyncLLM)."""
        server = replica.servers[0]
        key = id(replica)
        if key not in self._initialised:
            await server.collective_rpc.remote("init_weight_transfer_engine", kwargs={"init_info": self._init_info})
            self._initialised.add(key)
        await server.collective_rpc.remote("start_weight_update")
        # a failed update ends the session in vLLM and leaves the engine at the step it held before (undone whole)
        await server.collective_rpc.remote("update_weights", kwargs={"update_info": {"step": step}})
        await server.collective_rpc.remote("finish_weight_update")
        self.held[key] = step
        await replica.clear_kv_cache()  # prompts cached with the previous weights must not be reused
        await asyncio.gather(*(s.set_global_steps.remote(step) for s in replica.servers))

