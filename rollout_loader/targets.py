"""What a follower keeps at the newest step: a target that applies step objects (:class:`Target`, e.g.
:class:`StateDictTarget`, a state dict in this process) or one that reads the store itself (:class:`StreamTarget`,
e.g. a vLLM engine). The follower (:mod:`rollout_loader.follower`) drives either."""

from __future__ import annotations

from typing import Any, Protocol

from deltasync import StreamReader
from deltasync.engine import Replica, StepObject, Verify
from deltasync.errors import WaitTimeoutError

__all__ = ["StateDictTarget", "StreamTarget", "Target"]


class Target(Protocol):
    """Something that holds weights at a step and can move them to another step: the follower fetches each
    step's object and hands it over."""

    @property
    def step(self) -> int | None: ...

    def apply(self, obj: StepObject) -> None:
        """Apply an anchor (any time) or a delta based on ``step``; all or nothing."""


class StreamTarget(Protocol):
    """A target that reads the store itself (a vLLM engine's weight-transfer engine,
    :class:`~rollout_loader.vllm.VllmTarget`): the follower sends it step numbers along the chain, never objects."""

    reads_store: bool  # True

    @property
    def step(self) -> int | None: ...

    def connect(self, reader: StreamReader, *, notify: str | None = None) -> int | None:
        """Learn which step the target holds and point it at the stream ``reader`` reads (its URL, storage options
        and trusted keys; ``notify``: the follower's event feed, if any); returns that step."""

    def advance(self, step: int) -> None:
        """Move to ``step`` (a delta based on ``step``, or an anchor), verified; all or nothing."""


class StateDictTarget:
    """A pure-torch target: a ``Replica`` (state dict plus checksums) in this process."""

    def __init__(self, *, verify: Verify = "incremental", device: str = "cpu") -> None:
        self.replica: Replica | None = None
        self.verify = verify
        self.device = device

    @property
    def step(self) -> int | None:
        return self.replica.step if self.replica else None

    def apply(self, obj: StepObject) -> None:
        if self.replica is None or (obj.header.kind == "anchor"
                                    and obj.header.tensors.keys() != self.replica.checksums.keys()):
            self.replica = Replica.from_anchor(obj, device=self.device)
        else:
            self.replica.apply(obj, verify=self.verify)

    def state_dict(self) -> dict[str, Any]:
        if self.replica is None:
            raise WaitTimeoutError("no step has been applied yet")
        return self.replica.state_dict()
