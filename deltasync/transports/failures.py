"""What a store failure means: worth retrying (``transient_errors``), or not (``classify_failure``).

Told apart by class name and HTTP status, so that clients which are not installed (botocore,
huggingface_hub, httpx) need not be imported to recognise their errors.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

_TRANSIENT = (
    ("botocore.exceptions", ("ConnectionError", "HTTPClientError")),
    ("aiohttp", ("ClientError",)),
    ("httpx", ("TransportError",)),
    ("httpx2", ("TransportError",)),
)


def transient_errors() -> tuple[type[BaseException], ...]:
    """Exception types worth retrying: the builtins, plus the HTTP clients' own (botocore's connection
    errors, for one, are not ``OSError``s; huggingface_hub uses ``httpx2``). Clients that are not installed
    are skipped; this imports those that are (``is_transient`` imports nothing). Failures that retrying
    cannot mend are told apart first (:func:`classify_failure`)."""
    for module, _ in _TRANSIENT:
        try:
            importlib.import_module(module)
        except ImportError:
            continue
    return _transient_types()


def _transient_types() -> tuple[type[BaseException], ...]:
    """The transient types of the clients this process has imported (an error of a client never imported
    cannot have been raised)."""
    errors: list[type[BaseException]] = [OSError, TimeoutError, ConnectionError]
    for module, names in _TRANSIENT:
        mod = sys.modules.get(module)
        errors += [getattr(mod, n) for n in names if hasattr(mod, n)] if mod is not None else []
    return tuple(errors)


def is_transient(error: BaseException) -> bool:
    """Whether retrying ``error`` may help (``transient_errors``), without importing any HTTP client."""
    return isinstance(error, _transient_types())


FailureKind = Literal["no_credentials", "auth", "not_found", "unreachable", "unknown_option"]

# S3 error codes that mean "who you are" or "what you may do", not "try again"
_AUTH_CODES = frozenset({
    "AccessDenied", "AccountProblem", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidSecurity",
    "InvalidToken", "SignatureDoesNotMatch", "TokenRefreshRequired", "UnauthorizedAccess", "Forbidden", "401", "403",
})
_NO_CREDENTIALS = frozenset({
    "botocore.exceptions.NoCredentialsError", "botocore.exceptions.PartialCredentialsError",
    "botocore.exceptions.NoAuthTokenError", "botocore.exceptions.CredentialRetrievalError",
    "botocore.exceptions.TokenRetrievalError", "botocore.exceptions.SSOError", "botocore.exceptions.ProfileNotFound",
    "huggingface_hub.errors.LocalTokenNotFoundError",
})
_CONNECT = frozenset({
    "botocore.exceptions.ConnectionError",  # endpoint, connect timeout, proxy, TLS: never a reply
    "aiohttp.client_exceptions.ClientConnectorError",
    "httpx.ConnectError", "httpx.ConnectTimeout", "httpx2.ConnectError", "httpx2.ConnectTimeout",
    "builtins.ConnectionRefusedError", "socket.gaierror", "huggingface_hub.errors.OfflineModeIsEnabled",
})
_UNKNOWN_KWARG = re.compile(r"unexpected keyword argument '(\w+)'")
_HINTS: dict[str, dict[str, str]] = {
    "s3": {
        "no_credentials": "give storage options key and secret (CLI: -S key=... -S secret=...), set "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or use an AWS profile; anon=true for a public bucket",
        "auth": "check the access key and secret (storage options key/secret, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) "
        "and the bucket's permissions",
        "unreachable": "check the endpoint (storage option endpoint_url or client_kwargs.endpoint_url), "
        "the network, and that the server is running",
    },
    "hf": {
        "no_credentials": "set HF_TOKEN, run `hf auth login`, or pass storage option token=...",
        "auth": "check the token (HF_TOKEN, `hf auth login` or storage option token=...) and its access to the bucket",
        "unreachable": "check the network and the endpoint (HF_ENDPOINT or storage option endpoint)",
    },
    "file": {
        "auth": "check the folder's owner and permissions",
        "unreachable": "check the path",
    },
    "": {
        "no_credentials": "pass the backend's credentials as storage options (CLI: -S KEY=VALUE)",
        "auth": "check the credentials (storage options) and the permissions",
        "unreachable": "check the endpoint, the network, and that the server is running",
    },
}


@dataclass(frozen=True)
class StoreFailure:
    """What a store error means for the user, where blind retrying cannot mend it.

    ``no_credentials``/``auth``: never retried. ``not_found``: the backend's own "no such object" (read as
    ``FileNotFoundError``). ``unreachable``: no connection at all; final for a store that never answered
    (a wrong endpoint), transient for one that did (an outage). ``unknown_option``: a storage option the
    backend does not take (``detail`` is its name).
    """

    kind: FailureKind
    detail: str

    def hint(self, protocol: str) -> str:
        """What to check, in the backend's own words (empty for ``not_found`` and ``unknown_option``)."""
        family = {"s3": "s3", "s3a": "s3", "hf": "hf", "file": "file", "local": "file"}.get(protocol, "")
        return _HINTS[family].get(self.kind, "")


def classify_failure(error: BaseException, option_names: Iterable[str] = ()) -> StoreFailure | None:
    """Tell the failures that retrying cannot mend from the transient ones (None), from the exception and
    its causes, by class name (so that backends which are not installed need not be imported)."""
    chain = list(_causes(error))
    for e in chain:
        if _classes(e) & _NO_CREDENTIALS:
            return StoreFailure("no_credentials", str(e) or type(e).__name__)
    for e in chain:  # the server's own words (an S3 code) before the builtin error they were translated to
        status, code, message = _http_status(e)
        if status in (401, 403) or code in _AUTH_CODES:
            return StoreFailure("auth", f"{code or status}: {message}" if message else str(code or status))
        if status == 404 and "huggingface_hub.errors.HfHubHTTPError" in _classes(e):
            return StoreFailure("not_found", message or str(e))
    for e in chain:
        if isinstance(e, PermissionError):
            return StoreFailure("auth", str(e) or "permission denied")
        if _classes(e) & _CONNECT:
            return StoreFailure("unreachable", str(e) or type(e).__name__)
        m = _UNKNOWN_KWARG.search(str(e)) if isinstance(e, TypeError) else None
        if m and m.group(1) in set(option_names):
            return StoreFailure("unknown_option", m.group(1))
    return None


def _classes(e: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__}


def _causes(error: BaseException, limit: int = 8) -> Iterator[BaseException]:
    """``error``, then what caused it (explicit cause first), without loops."""
    seen: set[int] = set()
    todo = [error]
    while todo and len(seen) < limit:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def _http_status(e: BaseException) -> tuple[int | None, str | None, str]:
    """(HTTP status, S3 error code, message) of a botocore ``ClientError`` or an httpx/huggingface_hub HTTP
    error; (None, None, "") for anything else."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        err = response.get("Error") or {}
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        code = err.get("Code")
        return (status if isinstance(status, int) else None, str(code) if code else None, str(err.get("Message") or ""))
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        return status, None, str(e).splitlines()[0] if str(e) else ""
    return None, None, ""


_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                             "RequestThrottled", "ServiceUnavailable"})


def is_throttling(error: BaseException) -> bool:
    """Whether the store answered that it is overloaded (HTTP 429 or 503, S3 ``SlowDown`` and kin), in the
    error or what caused it: a poller should slow down, not only retry."""
    for e in _causes(error):
        status, code, _ = _http_status(e)
        if status in (429, 503) or code in _THROTTLE_CODES or any(c in str(e)
                                                                  for c in ("SlowDown", "reduce your request rate")):
            return True
    return False


MAX_RETRY_AFTER_S = 3600.0


def retry_after_s(error: BaseException) -> float | None:
    """The seconds a ``Retry-After`` header of the store's answer asks for (delta-seconds; an HTTP date is
    read as its distance from now), bounded to an hour; None without one. Looks through the error's causes
    and both response kinds (botocore's dict, an httpx/requests response)."""
    import email.utils
    import time

    for e in _causes(error):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
        else:
            headers = getattr(response, "headers", None) or {}
        try:
            value = headers.get("retry-after") or headers.get("Retry-After")
        except Exception:  # noqa: BLE001 - a header mapping of unknown make
            continue
        if not isinstance(value, str) or len(value) > 64:
            continue
        value = value.strip()
        if value.isdigit():
            return min(float(value), MAX_RETRY_AFTER_S)
        try:
            when = email.utils.parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            continue
        return min(max(0.0, when - time.time()), MAX_RETRY_AFTER_S)
    return None
