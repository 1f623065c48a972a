"""deltasync: publish an RL trainer's weights as sparse bit-exact deltas to any object store.

Trainer::

    pub = DeltaPublisher("s3://bucket/run1", model)
    pub.publish(step)          # after optimizer.step()

Consumer::

    reader = StreamReader("s3://bucket/run1")
    state = reader.state_dict(step)   # exact weights of any step

History::

    replay_to_folder("s3://bucket/run1", step, "ckpt-step")   # a folder transformers and vLLM load
    verify("s3://bucket/run1"); collect_garbage("s3://bucket/run1", keep_last=100)

Engine integrations (decode ahead, then only write and prove inside the engine's pause)::

    with reader.open(step) as obj:
        staged = stage(obj, layout, base_step=held)      # decoded and checked; nothing written
    checksums = apply_staged(staged, tensors, checksums=before)   # XOR in place, verified, all or nothing
    # or, per patch, onto a shard: xor_apply(bits, local_positions, xor, index=global_indices)
"""

from deltasync.errors import (
    BaseStepMismatchError,
    ChecksumMismatchError,
    HeldStepError,
    ResourceLimitError,
    ConfigError,
    CorruptObjectError,
    DeltaSyncError,
    EngineConfigError,
    EngineError,
    EngineUnreachableError,
    FollowError,
    FormatError,
    MissingDependencyError,
    OutputExistsError,
    PublishError,
    StepExistsError,
    StepNotFoundError,
    StepOrderError,
    StoreAuthError,
    StoreConfigError,
    StoreError,
    StoreUnreachableError,
    StreamNotFoundError,
    TensorMismatchError,
    WaitTimeoutError,
    WriterConflictError,
)
from deltasync.format._bits import DTYPES, dtype_from_name, dtype_name, int_view
from deltasync.format._kernels import warm_kernels
from deltasync.format.checksum import add as add_checksums
from deltasync.format.checksum import (
    checksum_elements,
    format_checksum,
    parse_checksum,
    state_checksum,
    tensor_checksum,
)
from deltasync.format.objects import (
    FORMAT_VERSION,
    StepHeader,
    StepObject,
    TensorHeader,
)
from deltasync.format.parts import PartedObject
from deltasync.format.patch import Patch
from deltasync.history.compare import Comparison, compare
from deltasync.history.gc import (
    GcPlan,
    check_consumer_id,
    collect_garbage,
    plan_gc,
    read_heartbeats,
    run_gc,
    write_heartbeat,
)
from deltasync.history.push import push_checkpoint
from deltasync.history.rebuild import (
    ReplayResult,
    reconstruct_state_dict,
    reconstruct_tensor,
    replay_to_folder,
)
from deltasync.history.stats import StreamStats, layer_density, plot_stats, stream_stats
from deltasync.history.verify import VerifyReport, verify
from deltasync.publish.publisher import DeltaPublisher, StepMetrics
from deltasync.node_cache import NodeCache
from deltasync.reader import StreamReader
from deltasync.watch import PollPolicy, StepWatch
from deltasync.stages.apply import Replica, Verify, apply_staged, xor_apply, xor_apply_all
from deltasync.stages.staging import Layout, StagedStep, TensorSpec, layout_of, stage
from deltasync.store import Manifest, Part, Store
from deltasync.transports import (
    Capabilities,
    Entry,
    Transport,
    open_transport,
    register_transport,
)

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltasync")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    # trainer
    "DeltaPublisher",
    "StepMetrics",
    "Store",
    "Manifest",
    # stores: a new backend is one Transport subclass, registered by URL scheme (or entry point)
    "Transport",
    "RdmaConsumer",
    "Capabilities",
    "Entry",
    "open_transport",
    "register_transport",
    # consumer
    "StreamReader",
    "NodeCache",
    "StepWatch",
    "PollPolicy",
    "Replica",
    "Verify",
    "StepObject",
    "PartedObject",
    "Part",
    "StepHeader",
    "TensorHeader",
    "FORMAT_VERSION",
    "write_heartbeat",
    "read_heartbeats",
    "check_consumer_id",
    # engine integrations (rollout_loader): decode ahead, write in place, prove it
    "Patch",
    "stage",
    "StagedStep",
    "Layout",
    "TensorSpec",
    "layout_of",
    "apply_staged",
    "xor_apply",
    "xor_apply_all",
    "warm_kernels",
    "DTYPES",
    "dtype_name",
    "dtype_from_name",
    "int_view",
    "tensor_checksum",
    "checksum_elements",
    "add_checksums",
    "format_checksum",
    "parse_checksum",
    "state_checksum",
    # history
    "replay_to_folder",
    "ReplayResult",
    "reconstruct_state_dict",
    "reconstruct_tensor",
    "push_checkpoint",
    "compare",
    "Comparison",
    "verify",
    "VerifyReport",
    "collect_garbage",
    "plan_gc",
    "run_gc",
    "GcPlan",
    "stream_stats",
    "StreamStats",
    "layer_density",
    "plot_stats",
    # errors
    "DeltaSyncError",
    "FormatError",
    "CorruptObjectError",
    "TensorMismatchError",
    "BaseStepMismatchError",
    "ChecksumMismatchError",
    "HeldStepError",
    "ResourceLimitError",
    "StepNotFoundError",
    "StreamNotFoundError",
    "StepOrderError",
    "StepExistsError",
    "StoreError",
    "StoreAuthError",
    "StoreUnreachableError",
    "StoreConfigError",
    "WriterConflictError",
    "PublishError",
    "WaitTimeoutError",
    "FollowError",
    "OutputExistsError",
    "ConfigError",
    "MissingDependencyError",
    "EngineError",
    "EngineUnreachableError",
    "EngineConfigError",
]


def __getattr__(name: str):
    """The RDMA consumer is imported on first use: it needs pyzmq and NIXL (``pip install 'deltasync[rdma]'``)."""
    if name == "RdmaConsumer":
        from deltasync.rdma.consumer import RdmaConsumer

        return RdmaConsumer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
