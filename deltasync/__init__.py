"""deltasync: publish an RL trainer's weights as sparse bit-exact deltas to any object store.

Trainer::

    pub = DeltaPublisher("s3://bucket/run1", model)
    pub.publish(step)          # after optimizer.step()

Consumer::

    reader = StreamReader("s3://bucket/run1")
    state = reader.state_dict(step)   # exact weights of any step
"""

from .apply import Replica
from .checksum import state_checksum, tensor_checksum
from .errors import (
    BaseStepMismatchError,
    ChecksumMismatchError,
    CorruptObjectError,
    DeltaSyncError,
    FormatError,
    PublishError,
    StepNotFoundError,
    StepOrderError,
    StoreError,
    TensorMismatchError,
    WaitTimeoutError,
    WriterConflictError,
)
from .format import FORMAT_VERSION, StepHeader, StepObject, TensorHeader
from .publisher import DeltaPublisher, StepMetrics
from .reader import StreamReader
from .store import Manifest, Store

__all__ = [
    "FORMAT_VERSION",
    "BaseStepMismatchError",
    "ChecksumMismatchError",
    "CorruptObjectError",
    "DeltaPublisher",
    "DeltaSyncError",
    "FormatError",
    "Manifest",
    "PublishError",
    "Replica",
    "StepHeader",
    "StepMetrics",
    "StepNotFoundError",
    "StepObject",
    "StepOrderError",
    "Store",
    "StoreError",
    "StreamReader",
    "TensorHeader",
    "TensorMismatchError",
    "WaitTimeoutError",
    "WriterConflictError",
    "state_checksum",
    "tensor_checksum",
]
