"""The API for inference-engine integrations: decode a step ahead, write it in place, prove it.

``deltasync`` itself exports the dozen names a trainer or an operator uses. An engine integration (such as
``rollout_loader``, the vLLM one) needs more: the staged-apply stages, the checksum arithmetic that proves
an engine's weights, the step documents, and the follow machinery. Those names live here, in one documented
module, so an integration never imports deltasync's internal modules (a test checks that ``rollout_loader``
imports only ``deltasync``, ``deltasync.engine`` and ``deltasync.errors``).

The flow, decode ahead, then only write and prove inside the engine's pause::

    from deltasync import StreamReader
    from deltasync.engine import apply_staged, layout_of, stage

    reader = StreamReader("s3://bucket/run1")
    with reader.open(step) as obj:
        staged = stage(obj, layout_of(tensors), base_step=held)   # decoded and checked; nothing written
    checksums = apply_staged(staged, tensors, checksums=before)   # XOR in place, verified, all or nothing
    # or, per patch, onto a shard: xor_apply(bits, local_positions, xor, index=global_indices)

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

from deltasync.consumers import ReplicaRecord, check_consumer_id, read_heartbeats, write_heartbeat
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
from deltasync.format._bits import DTYPES, dtype_from_name, dtype_name, int_view
from deltasync.format._kernel_cache import cache_state as kernel_cache_state
from deltasync.format._kernels import warm_kernels
from deltasync.format.checksum import add as add_checksums
from deltasync.format.checksum import (
    checksum_change,
    checksum_elements,
    format_checksum,
    parse_checksum,
    state_checksum,
    tensor_checksum,
)
from deltasync.format.documents import MAX_STEP, FingerprintReference, RankFingerprint, TensorPrint
from deltasync.format.names import CONSUMER_ID
from deltasync.format.names import check as name_matches
from deltasync.format.objects import FORMAT_VERSION, StepHeader, StepObject, TensorHeader
from deltasync.format.parts import PartedObject
from deltasync.format.patch import Patch
from deltasync.notify import EventFeed, Notifier
from deltasync.rdma.options import RdmaOptions, rdma_options
from deltasync.secrets import Secret, redact, redact_url, reveal
from deltasync.signing import SigningKey, pem_text, pem_texts, read_public_key
from deltasync.stages.apply import Replica, Verify, apply_staged, xor_apply, xor_apply_all
from deltasync.stages.staging import Layout, StagedStep, TensorSpec, layout_of, stage
from deltasync.store import Manifest, Part
from deltasync.threads import parallel_map, submit_all
from deltasync.trust import TrustedKeys, check_max_age_s, check_stream_id
from deltasync.watch import PollPolicy, StepWatch

__all__ = [
    # decode ahead, write in place, prove it
    "stage",
    "StagedStep",
    "Layout",
    "TensorSpec",
    "layout_of",
    "apply_staged",
    "xor_apply",
    "xor_apply_all",
    "Replica",
    "Verify",
    "Patch",
    "warm_kernels",
    "kernel_cache_state",
    "parallel_map",
    "submit_all",
    # bits and checksums
    "DTYPES",
    "dtype_name",
    "dtype_from_name",
    "int_view",
    "tensor_checksum",
    "checksum_elements",
    "checksum_change",
    "add_checksums",
    "format_checksum",
    "parse_checksum",
    "state_checksum",
    # step documents and objects
    "FORMAT_VERSION",
    "MAX_STEP",
    "StepObject",
    "PartedObject",
    "StepHeader",
    "TensorHeader",
    "Manifest",
    "Part",
    # following a stream, as a consumer with an identity
    "StepWatch",
    "PollPolicy",
    "EventFeed",
    "Notifier",
    "TrustedKeys",
    "check_stream_id",
    "check_max_age_s",
    "pem_text",
    "pem_texts",
    "SigningKey",
    "read_public_key",
    # secrets that never print (docs/SECURITY.md)
    "Secret",
    "reveal",
    "redact",
    "redact_url",
    "RdmaOptions",
    "rdma_options",
    "CONSUMER_ID",
    "name_matches",
    "check_consumer_id",
    "write_heartbeat",
    "read_heartbeats",
    "ReplicaRecord",
    # runtime fingerprints (docs/FORMAT.md section 5f)
    "TensorPrint",
    "RankFingerprint",
    "FingerprintReference",
    "config_key",
    "rank_digest",
    "engine_fingerprint",
    "differing",
    "mismatch_note",
    "read_reference",
    "make_reference",
    "write_reference",
]
