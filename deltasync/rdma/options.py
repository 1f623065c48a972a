"""How a process joins the RDMA fast path (:class:`RdmaOptions`), checked where it is given.

Kept apart from the trainer and consumer (which need pyzmq and NIXL) so that a vLLM engine can check an
``init_info`` naming a controller without either installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltasync.errors import ConfigError, MissingDependencyError

__all__ = ["RdmaOptions", "rdma_options"]

MIN_SECRET_CHARS = 32
INSTALL_HINT = "pip install 'deltasync[rdma]'"


def missing(what: str, e: ImportError) -> MissingDependencyError:
    """The error for a package of the ``rdma`` extra that is not installed (one line naming the extra)."""
    return MissingDependencyError(f"the RDMA fast path needs {what} ({e}); install it with {INSTALL_HINT}")


def check_secret(value: object, *, where: str) -> str:
    """``value`` if it can be the cluster secret (a string of 32 to 4096 characters), else :class:`ConfigError`
    (which never shows the value)."""
    if not isinstance(value, str) or not MIN_SECRET_CHARS <= len(value) <= 4096:
        got = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise ConfigError(f"{where}: the RDMA secret must be a string of {MIN_SECRET_CHARS} to 4096 characters, "
                          f"got {got}")
    return value


@dataclass(frozen=True, kw_only=True)
class RdmaOptions:
    """How a process joins the fast path: the controller's ZMQ address and the sizes of its buffers.

    ``slots`` x ``slot_bytes`` is the trainer's registered ring (a larger object goes through the store
    only); ``capacity_bytes`` is a consumer's registered inbox. ``plan_wait_s``: how long the trainer's
    first offer waits for the controller's plan (0: steps before the plan go through the store only).
    ``secret``: the cluster secret that authenticates the control plane (:mod:`deltasync.rdma.auth`;
    default ``$DELTASYNC_RDMA_SECRET``); never shown in a repr.
    """

    controller: str
    rank: int = 0
    slots: int = 4
    slot_bytes: int = 64 << 20
    chunk_bytes: int = 1 << 20
    ack_deadline_s: float = 10.0
    max_inflight_bytes: int | None = None
    capacity_bytes: int = 64 << 20
    read_timeout_s: float = 10.0
    announce_wait_s: float = 1.0
    plan_wait_s: float = 0.0
    device: str = "cpu"
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Every field checked here, where it is given (from a config, ``init_info``): a wrong type would
        otherwise surface later as a builtin ``TypeError`` or a ``ZMQError`` deep in a thread."""
        if not (isinstance(self.controller, str) and self.controller.startswith(("tcp://", "ipc://", "inproc://"))
                and len(self.controller) <= 1024):
            raise ConfigError("rdma: controller must be a ZMQ address such as 'tcp://host:5555', got "
                              f"{self.controller!r}")
        for name, low, high in (("rank", 0, 1 << 20), ("slots", 1, 1 << 16), ("slot_bytes", 1, 1 << 40),
                                ("chunk_bytes", 1, 1 << 40), ("capacity_bytes", 1, 1 << 40)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"rdma: {name} must be a whole number in [{low}, {high}], got {value!r}")
        if self.max_inflight_bytes is not None and (isinstance(self.max_inflight_bytes, bool) or not isinstance(
                self.max_inflight_bytes, int) or self.max_inflight_bytes < 1):
            raise ConfigError("rdma: max_inflight_bytes must be a positive whole number or null, got "
                              f"{self.max_inflight_bytes!r}")
        for name in ("ack_deadline_s", "read_timeout_s", "announce_wait_s", "plan_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 86400:
                raise ConfigError(f"rdma: {name} must be a number of seconds in [0, 86400], got {value!r}")
        if not (isinstance(self.device, str) and (self.device == "cpu" or self.device.startswith("cuda"))):
            raise ConfigError(f"rdma: device must be 'cpu' or a CUDA device such as 'cuda:0', got {self.device!r}")
        if self.secret is not None:
            check_secret(self.secret, where="rdma")


def rdma_options(rdma: str | RdmaOptions | dict) -> RdmaOptions:
    """``rdma`` as options: a controller address (``tcp://host:port``), a dict of fields, or options."""
    if isinstance(rdma, RdmaOptions):
        return rdma
    if isinstance(rdma, str):
        return RdmaOptions(controller=rdma)
    if isinstance(rdma, dict):
        try:
            return RdmaOptions(**rdma)
        except TypeError as e:
            raise ConfigError(f"rdma options {sorted(map(str, rdma))}: {e} "
                              f"(fields: {sorted(RdmaOptions.__dataclass_fields__)})") from None
    raise ConfigError(f"rdma: expected a controller address, a dict or RdmaOptions, got {type(rdma).__name__}")
