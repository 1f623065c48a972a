"""Transports: how bytes move between this process and a store, one module per backend, chosen by URL scheme.

``open_transport(url, storage_options)`` looks the URL's scheme up in a registry: first the schemes
registered with ``register_transport`` and the built-in ones (local folders, ``memory://``, ``s3://``,
``hf://``), then, on the first scheme nobody registered, the ``deltasync.transports`` entry points of
installed packages, and last any protocol fsspec knows (``gs://``, ``az://``, ...: fsspec.py). Backends are
imported only when a URL needs them: importing deltasync imports neither s3fs nor huggingface_hub, and a
missing package is a ``MissingDependencyError`` that names the extra to install.

A new backend is one module: a ``Transport`` subclass (base.py: ``put``, ``get``, ``list``, ``delete``,
``capabilities``) and a factory ``(url, storage_options) -> Transport``, registered by
``register_transport("scheme", factory)`` or, from another package, by an entry point::

    [project.entry-points."deltasync.transports"]
    myscheme = "mypackage.transport:open_my_transport"

It proves itself with the store contract every built-in backend passes: a pytest class subclassing
``deltasync.testing.store_contract.StoreContract`` with the URL of a new, empty stream.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from deltasync.errors import MissingDependencyError, StoreConfigError
from deltasync.transports.base import Capabilities, Data, Entry, Transport
from deltasync.transports.failures import (
    FailureKind,
    StoreFailure,
    classify_failure,
    is_throttling,
    is_transient,
    retry_after_s,
    transient_errors,
)

log = logging.getLogger(__name__)

__all__ = [
    "Capabilities",
    "Data",
    "Entry",
    "FailureKind",
    "StoreFailure",
    "Transport",
    "TransportFactory",
    "classify_failure",
    "is_throttling",
    "is_transient",
    "retry_after_s",
    "open_transport",
    "register_transport",
    "scheme_of",
    "transient_errors",
]

TransportFactory = Callable[[str, dict[str, Any]], Transport]
"""``factory(url, storage_options) -> Transport``: opens a transport on ``url``."""

ENTRY_POINT_GROUP = "deltasync.transports"

# built-in backends as "module:factory" (imported on first use) and the extra their packages come with
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "": ("deltasync.transports.local:open_local", None),
    "file": ("deltasync.transports.local:open_local", None),
    "local": ("deltasync.transports.local:open_local", None),
    "memory": ("deltasync.transports.memory:open_memory", None),
    "s3": ("deltasync.transports.s3:open_s3", "s3"),
    "s3a": ("deltasync.transports.s3:open_s3", "s3"),
    "hf": ("deltasync.transports.hf_bucket:open_hf", "hf"),
}
_REGISTRY: dict[str, TransportFactory | tuple[str, str | None]] = dict(_BUILTIN)
_LOCK = threading.Lock()
_ENTRY_POINTS_LOADED = [False]

# names other modules import from here; each from its backend module, on first use
_LAZY = {
    "LocalTransport": "deltasync.transports.local",
    "UMASK": "deltasync.transports.local",
    "share": "deltasync.transports.local",
    "FsspecTransport": "deltasync.transports.fsspec",
    "MemoryTransport": "deltasync.transports.memory",
    "S3Transport": "deltasync.transports.s3",
    "HfBucketTransport": "deltasync.transports.hf_bucket",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case ("" for a plain path)."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def register_transport(scheme: str, factory: TransportFactory | str, *, replace: bool = True) -> None:
    """Open URLs of ``scheme`` with ``factory`` (a callable, or ``"module:attribute"`` imported on first use).

    Replaces a registered scheme (built-in ones included) unless ``replace=False``, which keeps it.
    """
    scheme = scheme.lower()
    with _LOCK:
        if replace or scheme not in _REGISTRY:
            _REGISTRY[scheme] = factory if callable(factory) else (factory, None)


def unregister_transport(scheme: str) -> None:
    """Forget ``scheme`` (a built-in one goes back to its own module)."""
    scheme = scheme.lower()
    with _LOCK:
        _REGISTRY.pop(scheme, None)
        if scheme in _BUILTIN:
            _REGISTRY[scheme] = _BUILTIN[scheme]


def open_transport(url: str, storage_options: dict[str, Any] | None = None) -> Transport:
    """The transport for ``url``; ``storage_options`` go to the backend (credentials, endpoint, ...; a
    ``deltasync.Secret`` as its value).

    ``StoreConfigError`` for a scheme no backend takes; ``MissingDependencyError`` (with the extra to
    install) where the backend's package is missing. The backend's own errors pass through.
    """
    scheme = scheme_of(url)
    entry = _lookup(scheme)
    if entry is None:
        from deltasync.secrets import redact_url

        raise StoreConfigError(
            f"cannot open store {redact_url(url)!r}: no transport for scheme {scheme!r} (built in: "
            f"{', '.join(sorted(s for s in _REGISTRY if s))}; others through register_transport, the "
            f"{ENTRY_POINT_GROUP!r} entry points, or fsspec)"
        )
    factory, extra = (entry, None) if callable(entry) else _import(entry, url)
    from deltasync.secrets import reveal

    try:  # a backend is given the values of deltasync.Secret options (it needs them; nothing else does)
        return factory(url, reveal(dict(storage_options or {})))
    except ImportError as e:  # a package the backend imports on first use (fsspec's gcsfs, adlfs, ...)
        raise _missing(url, e, extra) from e


def _lookup(scheme: str) -> TransportFactory | tuple[str, str | None] | None:
    """Registered and built-in schemes, then entry points (loaded once), then fsspec's protocols."""
    if scheme in _REGISTRY:
        return _REGISTRY[scheme]
    if not _ENTRY_POINTS_LOADED[0]:
        _load_entry_points()
        if scheme in _REGISTRY:
            return _REGISTRY[scheme]
    if _fsspec_knows(scheme):
        return ("deltasync.transports.fsspec:open_fsspec", None)
    return None


def _load_entry_points() -> None:
    """Register the factories of installed packages (``deltasync.transports`` group); explicit
    registrations win. The factories themselves are imported when a URL first needs them."""
    with _LOCK:
        if _ENTRY_POINTS_LOADED[0]:
            return
        _ENTRY_POINTS_LOADED[0] = True
        found = list(entry_points(group=ENTRY_POINT_GROUP))
        for ep in found:
            _REGISTRY.setdefault(ep.name.lower(), (ep.value, None))
    if found:
        log.debug("transports from entry points: %s", ", ".join(f"{ep.name}={ep.value}" for ep in found))


def reload_entry_points() -> None:
    """Read the entry points again on the next unknown scheme (after installing a package at run time)."""
    with _LOCK:
        _ENTRY_POINTS_LOADED[0] = False


def _fsspec_knows(scheme: str) -> bool:
    from fsspec.registry import known_implementations, registry

    return bool(scheme) and (scheme in registry or scheme in known_implementations)


def _import(entry: tuple[str, str | None], url: str) -> tuple[TransportFactory, str | None]:
    """The factory named ``"module:attribute"``; a missing package names the extra that brings it."""
    target, extra = entry
    module, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise _missing(url, e, extra) from e
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj, extra


def _missing(url: str, error: ImportError, extra: str | None) -> MissingDependencyError:
    name = getattr(error, "name", None)
    reason = f"the package {name!r} is not installed" if name else str(error)
    hint = f"pip install 'deltasync[{extra}]'" if extra else f"pip install {name}" if name else "install it"
    return MissingDependencyError(f"cannot open store {url!r}: {reason} ({hint})")
