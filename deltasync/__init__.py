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
"""

from deltasync.errors import (
    BaseStepMismatchError,
    ChecksumMismatchError,
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
from deltasync.format.checksum import state_checksum, tensor_checksum
from deltasync.format.objects import (
    FORMAT_VERSION,
    StepHeader,
    StepObject,
    TensorHeader,
)
from deltasync.history.compare import Comparison, compare
from deltasync.history.gc import (
    GcPlan,
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
from deltasync.reader import StreamReader
from deltasync.stages.apply import Replica
from deltasync.store import Manifest, Store

__all__ = [
    "FollowError",
    "StreamNotFoundError",
    "StoreUnreachableError",
    "StoreConfigError",
    "StoreAuthError",
    "StepExistsError",
    "MissingDependencyError",
    "EngineUnreachableError",
    "EngineError",
    "EngineConfigError",
    "ConfigError",
    "FORMAT_VERSION",
    "BaseStepMismatchError",
    "ChecksumMismatchError",
    "Comparison",
    "CorruptObjectError",
    "DeltaPublisher",
    "DeltaSyncError",
    "FormatError",
    "GcPlan",
    "Manifest",
    "OutputExistsError",
    "PublishError",
    "Replica",
    "ReplayResult",
    "StepHeader",
    "StepMetrics",
    "StepNotFoundError",
    "StepObject",
    "StepOrderError",
    "Store",
    "StoreError",
    "StreamReader",
    "StreamStats",
    "TensorHeader",
    "TensorMismatchError",
    "VerifyReport",
    "WaitTimeoutError",
    "WriterConflictError",
    "collect_garbage",
    "compare",
    "layer_density",
    "plan_gc",
    "plot_stats",
    "push_checkpoint",
    "read_heartbeats",
    "reconstruct_state_dict",
    "reconstruct_tensor",
    "replay_to_folder",
    "run_gc",
    "state_checksum",
    "stream_stats",
    "tensor_checksum",
    "verify",
    "write_heartbeat",
]
