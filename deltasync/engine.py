"""The API for inference-engine integrations: decode a step ahead, write it in place, prove it.

``deltasync`` itself exports the dozen names a trainer or an operator uses. An engine integration (such as
``rollout_loader``, the vLLM one) needs more: the in-place write and its undo, the checksum arithmetic that proves
an engine's weights, the step documents, the follow machinery, heartbeats and fingerprints. What an engine author
uses is exported here, and nothing else (the library's own stages keep their modules): one documented module, so
an integration never imports deltasync's internal modules (a test checks that ``rollout_loader``
imports only ``deltasync``, ``deltasync.engine`` and ``deltasync.errors``).

The flow deltasync's own vLLM engine runs (rollout_loader/vllm: ``prefetch.prepare``, ``state.WorkerState``), to
decode and prove ahead and only write inside the engine's pause::

    from deltasync import StreamReader
    from deltasync.engine import checksum_change, xor_apply

    reader = StreamReader("s3://bucket/run1")                 # trusted_keys=...: only signed steps exist
    with reader.open(step, base=held) as obj:                 # the object, its size and digest checked
        patches = obj.patches()                               # Patch: name, positions, xor, checksum (after it)
    for p in patches:                                         # sealed ahead: each write proved before it is made
        pos, x = torch.from_numpy(p.positions), torch.from_numpy(p.xor)
        if (sums[p.name] + checksum_change(bits[p.name], pos, x, pos)) % 2**64 != p.checksum:
            raise ...                                         # refuse the step: nothing was written
    for p in patches:                                         # the pause: a scatter, nothing else
        xor_apply(bits[p.name], p.positions, p.xor, checksum=False)   # the same XOR again undoes it

``bits`` are the engine's tensors (only their bits are touched; ``dtype_name`` names their format dtype), ``sums``
each tensor's running checksum (``tensor_checksum`` once, then kept by the changes; a dense patch, positions None,
changes every element). A shard writes its own elements
(``xor_apply(..., index=global_indices)``, ``checksum_elements`` of a shard's part). Engines that keep a plain state
dict use ``Replica`` (anchor, then ``Replica.apply`` per step, verified as ``Verify`` says). A writer that needs no
positions (its tensors are the trainer's, whole or one part each) takes ``obj.packed(name)`` instead of
``obj.patch(name)`` and ``xor_apply_packed``, which decodes the positions as it scatters.

A step's checksum is the sum of its tensors' checksums modulo 2**64 (docs/FORMAT.md section 3):
``tensor_checksum`` for a whole tensor, ``checksum_elements`` for some of its elements (a shard's),
``checksum_change`` for what a write would change (before making it),
``add_checksums`` to combine them, ``format_checksum``/``parse_checksum`` for the manifest's hex form.
Runtime fingerprints (``deltasync.fingerprints``): ``TensorPrint``/``RankFingerprint`` of what an engine computes
with, ``rank_digest``/``engine_fingerprint`` to digest them, ``config_key`` of the configuration, ``read_reference``
and ``differing`` to compare with a reference; ``ReplicaRecord`` carries them into heartbeats.
``parallel_map``/``submit_all`` spread work across tensors on deltasync's thread pool (or, for a pause that
must not queue behind other work, a pool of the caller's).
"""

from deltasync.fingerprints import (
    config_key,
    differing,
    engine_fingerprint,
    make_reference,
    mismatch_note,
    rank_digest,
    read_reference,
    write_reference,
)
from deltasync.follow.consumers import ReplicaRecord, check_consumer_id, write_heartbeat
from deltasync.follow.reader import open_reader
from deltasync.follow.watch import FollowLoop, PollPolicy, StepWatch, retry_delay_s
from deltasync.format._bits import DTYPES, dtype_name
from deltasync.format._kernel_cache import cache_state as kernel_cache_state
from deltasync.format._kernels import warm_kernels
from deltasync.format.checksum import add as add_checksums
from deltasync.format.checksum import (
    checksum_change,
    checksum_elements,
    format_checksum,
    parse_checksum,
    tensor_checksum,
)
from deltasync.format.documents import MAX_STEP, RankFingerprint, TensorPrint
from deltasync.format.names import CONSUMER_ID
from deltasync.format.names import check as name_matches
from deltasync.format.objects import StepHeader, StepObject
from deltasync.format.parts import PartedObject
from deltasync.notify import EventFeed, Notifier
from deltasync.rdma.options import rdma_options
from deltasync.secrets import redact_url, reveal
from deltasync.signing import SigningKey, pem_text, pem_texts, read_public_key
from deltasync.stages.apply import Replica, Verify, xor_apply, xor_apply_all, xor_apply_packed
from deltasync.store import Manifest
from deltasync.store.location import StoreLocation
from deltasync.threads import parallel_map, submit_all
from deltasync.trust import TrustedKeys, check_max_age_s, check_stream_id

__all__ = [
    # decode ahead, write in place, prove it
    "xor_apply",
    "xor_apply_all",
    "xor_apply_packed",
    "Replica",
    "Verify",
    "warm_kernels",
    "kernel_cache_state",
    "parallel_map",
    "submit_all",
    # bits and checksums
    "DTYPES",
    "dtype_name",
    "tensor_checksum",
    "checksum_elements",
    "checksum_change",
    "add_checksums",
    "format_checksum",
    "parse_checksum",
    # step documents and objects
    "MAX_STEP",
    "StepObject",
    "PartedObject",
    "StepHeader",
    "Manifest",
    # following a stream, as a consumer with an identity
    "StepWatch",
    "PollPolicy",
    "FollowLoop",
    "retry_delay_s",
    "EventFeed",
    "Notifier",
    "TrustedKeys",
    "check_stream_id",
    "check_max_age_s",
    "pem_text",
    "pem_texts",
    "SigningKey",
    "read_public_key",
    # where a stream is: its URL and options as one value (crosses to an engine as data), and the reader for it
    "StoreLocation",
    "open_reader",
    # secrets that never print (docs/SECURITY.md)
    "reveal",
    "redact_url",
    "rdma_options",
    "CONSUMER_ID",
    "name_matches",
    "check_consumer_id",
    "write_heartbeat",
    "ReplicaRecord",
    # runtime fingerprints (docs/FORMAT.md section 5f)
    "TensorPrint",
    "RankFingerprint",
    "config_key",
    "rank_digest",
    "engine_fingerprint",
    "differing",
    "mismatch_note",
    "read_reference",
    "make_reference",
    "write_reference",
]
