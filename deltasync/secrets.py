"""Secrets that never print: credentials in storage options, passwords in URLs, cluster secrets.

A secret reaches deltasync as a value (``storage_options={"secret": ...}``, an RDMA cluster secret, a URL's
``user:password@``) and must never leave it as text: not in an error, a log line, a ``repr``, a metric label or a
stored document (docs/SECURITY.md). Two guards, by construction:

- :class:`Secret` holds a value that will not print: ``repr``, ``str`` and ``format`` show ``<hidden>``, ``json``
  refuses it; the holder calls :meth:`Secret.reveal` where the value is needed (handing it to a backend).
  Settings records keep their secrets in it (``deltasync.Store`` accepts it as a storage option's value).
- Every secret value a :class:`~deltasync.store.Store` is given (storage options whose names say secret, key,
  token, password, ...; a URL's password) is scrubbed from what its backend says in an error (which may quote its
  own settings) before it is put in a deltasync error or log line; those of at least 16 characters (what
  credentials are: a shorter one would mangle ordinary words) and URL passwords are remembered in this process,
  and :func:`redact` scrubs them from any text: the command line redacts everything it prints on stderr.

Example::

    store = Store("s3://bucket/run", storage_options={"key": key_id, "secret": Secret(os.environ["S3_SECRET"])})
    repr(Secret("x"))            # "Secret(<hidden>)"
"""

from __future__ import annotations

import hmac
import re
import threading
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Secret", "hidden", "redact", "redact_url", "remember", "reveal", "scrub", "secret_values", "wrap"]

HIDDEN = "<hidden>"
# parts of an option's name that mark its value as a secret (S3 "secret", "token", HF "token", Azure "account_key",
# "sas_token", GCS "token", "password", "client_secret", "credential(s)", ...)
_SECRET_NAME = re.compile(r"secret|token|passw|credential|(^|_)key$|account_key|sas|signature|auth|session", re.I)
MIN_SECRET_CHARS = 16  # scrubbed from any text: shorter values only from a backend's own words (``redact(also=)``)
MIN_LOCAL_CHARS = 6  # a shorter value is not scrubbed even there (it would mangle ordinary words)
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:)(?P<password>[^/@\s]+)@")

_known: set[str] = set()
_lock = threading.Lock()


class Secret:
    """A value that does not print. ``reveal()`` returns it where it is needed; equality compares in constant
    time; pickling keeps it (a process that receives it needs it); JSON refuses it.

    Raises ``TypeError`` for a value that is not a string or bytes.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str | bytes | Secret) -> None:
        if isinstance(value, Secret):
            value = value.reveal()
        if not isinstance(value, (str, bytes)):
            raise TypeError(f"Secret: expected a str or bytes, got {type(value).__name__}")
        self._value = value

    def reveal(self) -> Any:
        return self._value

    def __repr__(self) -> str:
        return f"Secret({HIDDEN})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        a, b = self._value, other._value
        if type(a) is not type(b):
            return False
        return hmac.compare_digest(a.encode() if isinstance(a, str) else a, b.encode() if isinstance(b, str) else b)

    def __hash__(self) -> int:
        return hash(("Secret", len(self._value)))

    def __bool__(self) -> bool:
        return bool(self._value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Secret, (self._value,))


def is_secret_name(name: object) -> bool:
    """Whether an option named ``name`` holds a secret (by its name: secret, token, password, key, ...)."""
    return isinstance(name, str) and _SECRET_NAME.search(name) is not None


def secret_values(options: Any, *, _secret: bool = False, _depth: int = 0) -> list[str]:
    """Every secret value in ``options`` (a mapping, nested mappings and lists): ``Secret`` values, and strings
    under names that say secret."""
    out: list[str] = []
    if _depth > 8:
        return out
    if isinstance(options, Secret):
        value = options.reveal()
        out.append(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
    elif isinstance(options, Mapping):
        for k, v in options.items():
            out += secret_values(v, _secret=_secret or is_secret_name(k), _depth=_depth + 1)
    elif isinstance(options, (list, tuple)):
        for v in options:
            out += secret_values(v, _secret=_secret, _depth=_depth + 1)
    elif _secret and isinstance(options, str):
        out.append(options)
    elif isinstance(options, str) and "@" in options:  # a URL with a password (an endpoint)
        out += [m.group("password") for m in _URL_PASSWORD.finditer(options)]
    return out


def reveal(options: Any, *, _depth: int = 0) -> Any:
    """``options`` with every ``Secret`` replaced by its value (what a backend is given)."""
    if isinstance(options, Secret):
        return options.reveal()
    if _depth > 8:
        return options
    if isinstance(options, Mapping):
        return {k: reveal(v, _depth=_depth + 1) for k, v in options.items()}
    if isinstance(options, list):
        return [reveal(v, _depth=_depth + 1) for v in options]
    if isinstance(options, tuple):
        return tuple(reveal(v, _depth=_depth + 1) for v in options)
    return options


def hidden(options: Any, *, _depth: int = 0) -> Any:
    """``options`` as a repr or a message may show them: every secret value (by name, or a ``Secret``) replaced by
    ``<hidden>``, URLs' passwords too."""
    if isinstance(options, Secret):
        return HIDDEN
    if _depth > 8:
        return HIDDEN
    if isinstance(options, Mapping):
        return {k: HIDDEN if is_secret_name(k) and v is not None else hidden(v, _depth=_depth + 1)
                for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return type(options)(hidden(v, _depth=_depth + 1) for v in options)
    if isinstance(options, str):
        return redact_url(options)
    return options


def remember(*values: Any, public: str = "", min_chars: int = MIN_SECRET_CHARS) -> None:
    """Remember secret values (strings, bytes, ``Secret``s) so that :func:`redact` scrubs them from any text; a
    value that ``public`` (a URL that is shown anyway) contains is no secret, and is not scrubbed (a test store's
    secret that is also its bucket's name would otherwise turn every message into ``<hidden>``)."""
    with _lock:
        for v in values:
            if isinstance(v, Secret):
                v = v.reveal()
            if isinstance(v, bytes):
                v = v.decode("utf-8", "replace")
            if isinstance(v, str) and len(v) >= min_chars and v not in public:
                _known.add(v)


def redact_url(url: str) -> str:
    """``url`` with the password of a ``user:password@`` part hidden (and remembered)."""
    if not isinstance(url, str) or "@" not in url:
        return url
    for m in _URL_PASSWORD.finditer(url):
        # a URL's password is a secret whatever its length (ordinary words are rarely one)
        remember(urllib.parse.unquote(m.group("password")), m.group("password"), min_chars=MIN_LOCAL_CHARS)
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{HIDDEN}@", url)


def redact(text: str, *, also: Iterable[str] = ()) -> str:
    """``text`` with every secret this process was given (:func:`remember`: values of at least 16 characters, what
    credentials are; a shorter one would mangle ordinary words) and every URL password hidden; ``also``: more
    values to hide here (a store's own secrets, however short, in what its backend said)."""
    if not isinstance(text, str):
        text = str(text)
    text = redact_url(text)  # first: a password in a URL is then scrubbed wherever else the text repeats it
    with _lock:
        known = sorted(_known | {a for a in also if isinstance(a, str) and len(a) >= MIN_LOCAL_CHARS},
                       key=len, reverse=True)
    for value in known:
        if value in text:
            text = text.replace(value, HIDDEN)
    return text


def wrap(options: Any, *, _secret: bool = False, _depth: int = 0) -> Any:
    """``options`` with every string under a secret-looking name (nested too) held in a :class:`Secret`: what a
    settings holder keeps, so that no repr, log or error of it can show them (``reveal`` undoes it)."""
    if _depth > 8 or isinstance(options, Secret):
        return options
    if isinstance(options, Mapping):
        return {k: wrap(v, _secret=_secret or is_secret_name(k), _depth=_depth + 1) for k, v in options.items()}
    if isinstance(options, list):
        return [wrap(v, _secret=_secret, _depth=_depth + 1) for v in options]
    if _secret and isinstance(options, (str, bytes)):
        return Secret(options)
    return options


def scrub(error: BaseException, *, also: Iterable[str] = ()) -> None:
    """Redact the messages of ``error`` and its causes in place (best effort: an exception whose text comes from
    its ``args``), so that a traceback that prints the chain shows no secret either (``also``: as ``redact``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo and len(seen) < 8:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        try:
            text = str(e)
            clean = redact(text, also=also)
            if clean != text and e.args:
                e.args = (clean,)
        except Exception:  # noqa: BLE001 - an exception whose str() fails is left as it is
            pass
        todo += [e.__cause__, e.__context__]
