"""The control plane's messages: msgpack-encoded msgspec structs, each decoded as hostile input.

Control messages travel over ZMQ (a ROUTER in the controller, a DEALER per trainer rank and per consumer). Every
message comes from a peer: its size is bounded before decoding, its fields are typed and range-checked (names
by pattern, whole), and one that fails is a :class:`ControlMessageError`. ``docs/RDMA.md`` tells the protocol.
"""

from __future__ import annotations

from typing import Annotated

from deltasync.rdma.options import missing

try:
    import msgspec
    import zmq
except ImportError as e:  # the rdma extra
    raise missing("pyzmq and msgspec", e) from None

from deltasync.errors import ControlMessageError
from deltasync.format.names import PEER_NAME, whole
from deltasync.rdma.outbox import AgentName, RingLayout, SlotInfo, Step

MAX_MESSAGE_BYTES = 16 << 20  # a hello carries NIXL metadata (KBs) and a tensor list (~100 B per tensor)
MAX_TENSORS = 100_000
Name = Annotated[str, msgspec.Meta(pattern=whole(PEER_NAME))]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 42)]
Metadata = Annotated[bytes, msgspec.Meta(min_length=1, max_length=8 << 20)]

# --- messages: peers -> controller ---


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    numel: Count
    itemsize: Annotated[int, msgspec.Meta(ge=1, le=16)]


class PartMeta(msgspec.Struct, frozen=True, array_like=True):
    name: TensorName
    start: Count
    stop: Count


class TrainerHello(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank
    metadata: Metadata
    ring: RingLayout
    tensors: Annotated[dict[TensorName, TensorMeta], msgspec.Meta(max_length=MAX_TENSORS)]
    parts: Annotated[list[PartMeta], msgspec.Meta(max_length=MAX_TENSORS)]


class ConsumerHello(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: Name
    engine: Name
    agent: AgentName
    needs: Annotated[list[TensorName], msgspec.Meta(max_length=MAX_TENSORS)]
    everything: bool = False  # needs every tensor the trainer ranks hold (a whole-model consumer)


class StepReady(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank
    slot: SlotInfo


class Applied(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: Name
    step: Step


class MetadataRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank


# --- messages: controller -> peers ---


class TrainerPlan(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    consumers: Annotated[list[AgentName], msgspec.Meta(max_length=1 << 16)]


class RankMetadata(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank
    ring: RingLayout
    metadata: Metadata


class PlannedRead(msgspec.Struct, frozen=True, kw_only=True):
    source: RankMetadata
    parts: Annotated[list[PartMeta], msgspec.Meta(max_length=MAX_TENSORS)]


class ConsumerPlan(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    reads: Annotated[list[PlannedRead], msgspec.Meta(max_length=1 << 16)]


class EngineVersion(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    engine: Name
    step: Step


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    reason: Annotated[str, msgspec.Meta(max_length=2000)]


ToController = TrainerHello | ConsumerHello | StepReady | Applied | MetadataRequest
ToPeer = TrainerPlan | ConsumerPlan | RankMetadata | StepReady | EngineVersion | Refused
encoder = msgspec.msgpack.Encoder()
to_controller = msgspec.msgpack.Decoder(ToController)
to_peer = msgspec.msgpack.Decoder(ToPeer)


def decode_message(frame: bytes, decoder: msgspec.msgpack.Decoder, *, where: str) -> object:
    """One control message, validated; :class:`ControlMessageError` naming ``where`` otherwise."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ControlMessageError(f"{where}: {len(frame)} bytes, expected at most {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as e:  # (a string that is not UTF-8)
        raise ControlMessageError(f"{where}: invalid control message: {e}") from None


def socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 1024)  # larger frames are dropped by ZMQ itself
    sock.setsockopt(zmq.LINGER, 0)
    return sock

