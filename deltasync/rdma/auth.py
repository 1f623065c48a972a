"""Who a peer on the RDMA control plane is: CurveZMQ keys derived from one cluster secret.

Why CurveZMQ: it is libzmq's own security mechanism (pyzmq's wheels carry it). Every connection is
encrypted, the controller is authenticated by its key, every client by its own, replays are refused, and
no cryptography is written here. ZAP (``zmq.auth``) tells the controller which key sent each message.

Why keys derived from a secret: the operator hands every process one secret (``DELTASYNC_RDMA_SECRET``, or
``RdmaOptions.secret``), as with torchrun's rendezvous settings, yet each peer *name* has a key pair of its
own: ``controller``, ``trainer:<rank>``, ``consumer:<id>``. The controller derives the public key a name
must use, so a message is accepted only from the key of the name it claims, a rank or consumer comes back
after a restart only under its own key, and a process without the secret cannot complete a handshake at all
(the controller's key derives from the secret too, and is never sent). HKDF-SHA256 (``cryptography``)
turns the secret and a name into the 32 bytes of a Curve25519 secret key.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from deltasync.rdma.options import missing

try:
    import zmq
    import zmq.utils.z85
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
except ImportError as e:  # the rdma extra
    raise missing("pyzmq and cryptography", e) from None

from deltasync.errors import ConfigError
from deltasync.rdma.options import MIN_SECRET_CHARS, check_secret

SECRET_ENV = "DELTASYNC_RDMA_SECRET"
_SALT = b"deltasync rdma control plane v1"
CONTROLLER = "controller"


def cluster_secret(secret: str | None = None, *, where: str = "rdma") -> bytes:
    """The cluster's secret: ``secret``, else ``$DELTASYNC_RDMA_SECRET``; :class:`ConfigError` when there is
    none or it is shorter than 32 characters (make one with ``openssl rand -hex 32``)."""
    value = secret if secret is not None else os.environ.get(SECRET_ENV)
    if value is None:
        raise ConfigError(f"{where}: the RDMA control plane is authenticated: set {SECRET_ENV} (or the rdma option "
                          f"'secret') to the same random string of at least {MIN_SECRET_CHARS} characters on the "
                          "controller and every trainer and consumer, e.g. the output of `openssl rand -hex 32`")
    from deltasync.secrets import remember

    remember(value)  # scrubbed from every error and log line (deltasync/secrets.py)
    return check_secret(value, where=where).encode()


@contextmanager
def cluster_secret_for_this_run() -> Iterator[str]:
    """A fresh secret in ``$DELTASYNC_RDMA_SECRET`` (unless one is set) while a run that starts the controller
    and its peers itself (the demo, a benchmark) lasts; the peers it spawns inherit it. Restored on exit."""
    given = os.environ.get(SECRET_ENV)
    if given is not None:
        yield given
        return
    os.environ[SECRET_ENV] = value = secrets.token_hex(32)
    try:
        yield value
    finally:
        os.environ.pop(SECRET_ENV, None)


def trainer_name(rank: int) -> str:
    return f"trainer:{rank}"


def consumer_name(consumer_id: str) -> str:
    return f"consumer:{consumer_id}"


@lru_cache(maxsize=4096)  # bounded: names come from peers
def keypair(secret: bytes, name: str) -> tuple[bytes, bytes]:
    """``name``'s Curve25519 key pair (public, secret; Z85 text as ZMQ takes it), the same in every process that
    holds ``secret``."""
    raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=name.encode()).derive(secret)
    secret_key = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def public_key(secret: bytes, name: str) -> str:
    """``name``'s public key as ZAP reports a peer (Z85 text)."""
    return keypair(secret, name)[0].decode()


def serve(ctx: zmq.Context, sock: zmq.Socket, secret: bytes) -> object:
    """Make ``sock`` (not yet bound) a CURVE server under the controller's key, with a ZAP handler that
    accepts any client key (each message is then checked against the key of the name it claims) and records
    it as the message's ``User-Id``. Returns the handler, to stop when the socket closes."""
    from zmq.auth import CURVE_ALLOW_ANY
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
    public, private = keypair(secret, CONTROLLER)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = private, public, True
    return auth


def connect_as(sock: zmq.Socket, secret: bytes, name: str) -> None:
    """Make ``sock`` (not yet connected) a CURVE client speaking as ``name``, trusting only the controller's key."""
    public, private = keypair(secret, name)
    sock.curve_secretkey, sock.curve_publickey = private, public
    sock.curve_serverkey = keypair(secret, CONTROLLER)[0]
