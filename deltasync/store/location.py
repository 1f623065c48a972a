"""Where a stream is: one value for the store's URL and its options (credentials, endpoint, region).

A store is reached by a URL *and* the options its backend needs; carried apart, the pair gets dropped on the way
(a follower's engine sent the URL and ``None`` for the credentials). :class:`StoreLocation` holds both, resolved
once by :meth:`StoreLocation.of` from whatever a public entry point was given (a URL with ``storage_options=``, a
:class:`~deltasync.store.Store`, a :class:`~deltasync.follow.reader.StreamReader`, another location), and crosses a
process boundary as data (:meth:`to_record` / :meth:`from_record`: the ``url`` and ``storage_options`` of an engine's
``init_info``).

Its secrets never print (deltasync/secrets.py): option values whose names say secret are held in
:class:`~deltasync.secrets.Secret`, a URL's password is hidden in ``repr``; only :meth:`to_record` and
:meth:`backend_options` reveal them, for the process or backend that needs them.

Example::

    where = StoreLocation.of("s3://bucket/run-7", {"key": key_id, "secret": Secret(os.environ["S3_SECRET"])})
    repr(where)    # "StoreLocation('s3://bucket/run-7', options={'key': ..., 'secret': '<hidden>'})"
    StoreLocation.from_record(json.loads(json.dumps(where.to_record()))) == where   # True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from deltasync.errors import ConfigError
from deltasync.secrets import hidden, redact_url, reveal, wrap

__all__ = ["StoreLocation", "Where"]

# what a public entry point accepts for "the store": a URL (or local path), a location, or anything that has one
# (a Store, a StreamReader: their ``location``)
Where = Union[str, "os.PathLike[str]", "StoreLocation", Any]


@dataclass(frozen=True, repr=False)
class StoreLocation:
    """A store's URL (as given: a password in it too) and its backend's options (secrets held as ``Secret``).

    Args:
        url: a local path or ``file://``, ``s3://``, ``hf://buckets/...``, ``memory://``, any fsspec URL, or a scheme
            a registered transport takes (deltasync.transports).
        options: the backend's options (fsspec ``storage_options``), string keys.

    Raises ``ConfigError`` for an empty URL or options that are not a mapping with string keys.
    """

    url: str
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        url = os.fspath(self.url) if isinstance(self.url, os.PathLike) else self.url
        if not isinstance(url, str) or not url:
            raise ConfigError(f"store location: expected a URL (a non-empty string), got {type(url).__name__}")
        options = {} if self.options is None else self.options
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            raise ConfigError("store location: storage options: expected a mapping of option names (strings) to "
                              f"values, got {type(options).__name__}")
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "options", wrap(dict(options)))

    @classmethod
    def of(cls, where: Where, storage_options: Mapping[str, Any] | None = None) -> StoreLocation:
        """The one place a ``url | Store | StreamReader | StoreLocation`` plus options is resolved.

        ``storage_options`` go with a URL or path; a store, reader or location carries its own, and options given
        beside one are a ``ConfigError`` (they would be silently ignored otherwise).
        """
        if isinstance(where, (str, os.PathLike)):
            return cls(where, storage_options or {})  # type: ignore[arg-type]
        located = where if isinstance(where, StoreLocation) else getattr(where, "location", None)
        if not isinstance(located, StoreLocation):
            raise ConfigError(f"store location: expected a URL, a Store, a StreamReader or a StoreLocation, got "
                              f"{type(where).__name__}")
        if storage_options:
            raise ConfigError(f"store location: storage options given beside {type(where).__name__} "
                              f"{located.shown!r}, which has its own: give them where it is made")
        return located

    @property
    def shown(self) -> str:
        """The URL as messages, reports and metrics show it: a password in it hidden."""
        return redact_url(self.url)

    def backend_options(self) -> dict[str, Any]:
        """The options with their secrets revealed: what the backend is given (never logged)."""
        return dict(reveal(dict(self.options)))

    def to_record(self) -> dict[str, Any]:
        """``{"url", "storage_options"}`` as JSON carries them to another process (secrets revealed: that process
        needs them; the record is sent, never logged)."""
        return {"url": self.url, "storage_options": self.backend_options()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> StoreLocation:
        """The location a :meth:`to_record` record describes; ``ConfigError`` for a record without a URL."""
        if not isinstance(record, Mapping):
            raise ConfigError(f"store location record: expected an object, got {type(record).__name__}")
        return cls(record.get("url"), record.get("storage_options") or {})  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"StoreLocation({self.shown!r}, options={hidden(dict(self.options))!r})"
