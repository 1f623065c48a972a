"""What a follower keeps at the newest step: a :class:`Target`, which advances to a step, opening what it needs
from the reader the follower gives it. :class:`StateDictTarget` (a state dict in this process) fetches and applies
each step's object; :class:`~rollout_loader.vllm.VllmTarget` (a vLLM engine) sends the step number to an engine that
reads the store itself. The follower (:mod:`rollout_loader.follower`) drives either the same way."""

from __future__ import annotations

from typing import Any, Protocol

from deltasync import StreamReader
from deltasync.engine import Replica, StepObject, Verify
from deltasync.errors import WaitTimeoutError

__all__ = ["StateDictTarget", "Target"]


class Target(Protocol):
    """Something that holds weights at a step and moves them to another step, one step at a time.

    The follower calls :meth:`connect` before the first step (and again after a failure), then :meth:`advance`
    with each step of the chain to the newest: a delta based on ``step``, or an anchor. A target that holds no
    step yet (``step`` None) is sent an anchor first.

    Example (a target that only records the steps, reading each step's manifest)::

        class Recorder:
            step = None

            def connect(self, reader, *, notify=None):
                return self.step

            def advance(self, reader, step):
                reader.manifest(step)
                self.step = step
    """

    @property
    def step(self) -> int | None:
        """The step the target holds (None: none yet)."""

    def connect(self, reader: StreamReader, *, notify: str | None = None) -> int | None:
        """Point the target at the stream ``reader`` reads (``notify``: the follower's event feed URL, if any) and
        learn which step it holds; returns that step. Changes no weights."""

    def advance(self, reader: StreamReader, step: int) -> None:
        """Move to ``step`` (a delta based on ``step``, or an anchor), opening what it needs from ``reader``,
        verified; all or nothing: on an error the target keeps the step it held."""


class StateDictTarget:
    """A pure-torch target: a ``Replica`` (state dict plus checksums) in this process.

    Example: ``Follower(url, StateDictTarget(verify="full")).sync()``
    """

    def __init__(self, *, verify: Verify = "incremental", device: str = "cpu") -> None:
        self.replica: Replica | None = None
        self.verify = verify
        self.device = device

    @property
    def step(self) -> int | None:
        return self.replica.step if self.replica else None

    def connect(self, reader: StreamReader, *, notify: str | None = None) -> int | None:
        """Nothing to point at the stream: the state dict is in this process. Returns the step held."""
        return self.step

    def advance(self, reader: StreamReader, step: int) -> None:
        """Fetch, verify and apply ``step``'s object (an anchor that carries its delta from the step held opens as
        that delta: a few bytes instead of the dense anchor)."""
        with reader.open(step, base=self.step) as obj:
            self.apply(obj)

    def apply(self, obj: StepObject) -> None:
        """Apply an anchor (any time) or a delta based on ``step``; all or nothing."""
        if self.replica is None or (obj.header.kind == "anchor"
                                    and obj.header.tensors.keys() != self.replica.checksums.keys()):
            self.replica = Replica.from_anchor(obj, device=self.device)
        else:
            self.replica.apply(obj, verify=self.verify)

    def state_dict(self) -> dict[str, Any]:
        if self.replica is None:
            raise WaitTimeoutError("no step has been applied yet")
        return self.replica.state_dict()
