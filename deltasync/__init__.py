"""deltasync: publish an RL trainer's weights as sparse bit-exact deltas to any object store.

Trainer::

    from deltasync import DeltaPublisher
    pub = DeltaPublisher("s3://bucket/run1", model)
    pub.publish(step)          # after optimizer.step()

Consumer::

    reader = StreamReader("s3://bucket/run1")
    state = reader.state_dict(step)   # exact weights of any step

History::

    replay_to_folder("s3://bucket/run1", step, "ckpt-step")   # a folder transformers and vLLM load
    verify("s3://bucket/run1"); collect_garbage("s3://bucket/run1", keep_last=100)

This module exports what a trainer or an operator uses. The rest is in documented submodules:
``deltasync.errors`` (every error, one hierarchy under ``DeltaSyncError``), ``deltasync.history`` (the
results of the history tools and their finer-grained steps), ``deltasync.transports`` (a new store backend),
``deltasync.engine`` (for inference-engine integrations: staged apply, checksums, step documents).
"""

from typing import TYPE_CHECKING

from deltasync._lazy import lazy_exports
from deltasync.errors import DeltaSyncError

# Where each exported name lives. Imported on first use (PEP 562): `deltasync ls` and the other store
# commands import deltasync.store without paying for torch and numba, which the trainer and reader need.
_HOMES = {
    "DeltaPublisher": "deltasync.publish.publisher",
    "PublishOptions": "deltasync.publish.options",
    "StreamReader": "deltasync.follow.reader",
    "StepWatch": "deltasync.follow.watch",
    "NodeCache": "deltasync.store.node_cache",
    "RdmaConsumer": "deltasync.rdma.consumer",  # needs pyzmq and NIXL: pip install 'deltasync[rdma]'
    "Store": "deltasync.store",
    "replay_to_folder": "deltasync.history.rebuild",
    "push_checkpoint": "deltasync.history.push",
    "compare": "deltasync.history.compare",
    "verify": "deltasync.history.verify",
    "collect_garbage": "deltasync.history.gc",
    "stream_stats": "deltasync.history.stats",
}


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
    "PublishOptions",
    # consumer
    "StreamReader",
    "StepWatch",
    "NodeCache",
    "RdmaConsumer",
    "Store",
    # history
    "replay_to_folder",
    "push_checkpoint",
    "compare",
    "verify",
    "collect_garbage",
    "stream_stats",
    # errors (every subclass: deltasync.errors)
    "DeltaSyncError",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

if TYPE_CHECKING:  # what static checkers and IDEs see
    from deltasync.follow.reader import StreamReader
    from deltasync.follow.watch import StepWatch
    from deltasync.history.compare import compare
    from deltasync.history.gc import collect_garbage
    from deltasync.history.push import push_checkpoint
    from deltasync.history.rebuild import replay_to_folder
    from deltasync.history.stats import stream_stats
    from deltasync.history.verify import verify
    from deltasync.publish.options import PublishOptions
    from deltasync.publish.publisher import DeltaPublisher
    from deltasync.rdma.consumer import RdmaConsumer
    from deltasync.store import Store
    from deltasync.store.node_cache import NodeCache
