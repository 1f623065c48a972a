"""Retries for store operations: transient failures retried with capped exponential backoff and jitter,
failures that retrying cannot mend (credentials, a wrong endpoint, an unknown option) refused at once with
what to check (``transports.failures`` tells them apart)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from deltasync.errors import (
    DeltaSyncError,
    StoreAuthError,
    StoreConfigError,
    StoreError,
    StoreUnreachableError,
)
from deltasync.secrets import Secret, redact, scrub
from deltasync.transports import StoreFailure, classify_failure, is_throttling, is_transient, retry_after_s

log = logging.getLogger("deltasync.store")

T = TypeVar("T")


def _from_backend(error: BaseException) -> bool:
    """Whether ``error`` is a backend's reaction to its input (a ``TypeError``, ``AttributeError``, ``KeyError`` or
    ``ValueError`` raised in a backend's own code, not deltasync's)."""
    if not isinstance(error, (TypeError, AttributeError, KeyError, ValueError)) or isinstance(error, DeltaSyncError):
        return False
    tb = error.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and _PACKAGE not in last


_PACKAGE = str(Path(__file__).resolve().parents[1])  # deltasync/ (this file is deltasync/store/retries.py)

# the types of the storage options users set most, per backend: a wrong one is named before the backend trips on
# it somewhere deep (a str where a bool belongs, an int for a URL); others the backend checks itself
_OPTION_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "s3": {"anon": (bool,), "use_ssl": (bool,), "requester_pays": (bool,), "version_aware": (bool,),
           "endpoint_url": (str,), "key": (str, Secret), "secret": (str, Secret), "token": (str, Secret),
           "profile": (str,), "client_kwargs": (Mapping,), "config_kwargs": (Mapping,),
           "s3_additional_kwargs": (Mapping,)},
    "hf": {"token": (str, Secret, bool), "endpoint": (str,)},
    "gs": {"token": (str, Secret, Mapping), "project": (str,), "endpoint_url": (str,)},
}


def check_option_types(protocol: str, options: Mapping[str, object]) -> None:
    """``StoreConfigError`` for a well-known storage option of the wrong type (named, with the type it has; never
    its value: it may be a credential)."""
    family = {"s3a": "s3", "gcs": "gs"}.get(protocol, protocol)
    types = _OPTION_TYPES.get(family, {})
    for name, value in options.items():
        want = types.get(name)
        if want is not None and value is not None and not (isinstance(value, want)
                                                           and not (bool not in want and isinstance(value, bool))):
            names = " or ".join(_TYPE_WORDS.get(w, w.__name__) for w in want)
            raise StoreConfigError(f"storage option {name!r} of the {protocol!r} filesystem must be {names}, got "
                                   f"{_TYPE_WORDS.get(type(value), type(value).__name__)}")


_TYPE_WORDS: dict[type, str] = {bool: "true or false", str: "a string", Secret: "a Secret", Mapping: "an object",
                                dict: "an object", int: "a number", float: "a number", list: "a list"}


class Retrier:
    """The retry policy of one store, a part of it (``Store.call`` delegates here): what every transport call runs
    through. Given what it needs and nothing more: the store's URL and scheme (for messages and hints), the names of
    its options and its secret values (scrubbed from what the backend says); it keeps whether the store has ever
    answered and how long the store asked to be left alone.

    Example::

        retry = Retrier("s3://bucket/run", "s3", retries=4)
        data = retry.call("read latest.json", lambda: transport.get("latest.json"))
    """

    def __init__(self, url: str, protocol: str, *, retries: int = 4, retry_base_s: float = 0.2,
                 retry_max_s: float = 60.0, option_names: frozenset[str] = frozenset(),
                 secrets: tuple[str, ...] = ()) -> None:
        self.url = url
        self.protocol = protocol
        self.retries = retries
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.option_names = option_names  # the store's storage options (names only: what a refusal lists)
        self._secrets = secrets  # the store's own secret values (what its backend's words may quote)
        self._answered = False  # has the store ever answered? (then a failed connect is an outage, not a wrong URL)
        self._throttled_until = 0.0  # monotonic time until which the store asked to be left alone

    def throttle_s(self) -> float:
        """Seconds the store still asked callers to wait (``Retry-After``, or a throttling answer: HTTP 429 or
        503, S3 ``SlowDown``); pollers stretch their next delay to it. 0 when it did not."""
        return max(0.0, self._throttled_until - time.monotonic())

    def call(self, what: str, fn: Callable[[], T], *, landed: Callable[[], bool] | None = None) -> T:
        """Run one store operation, retrying transient errors ``retries`` times and ``retry_max_s`` at most.

        Never retried: a definite answer (``FileNotFoundError``, ``FileExistsError``); missing or refused
        credentials (``StoreAuthError``); a storage option the backend does not take (``StoreConfigError``);
        an endpoint that cannot be connected to while the store has never answered (``StoreUnreachableError``:
        a wrong endpoint fails in seconds, while an outage of a store that did answer is retried).

        ``landed`` (for a conditional write) says whether the store holds what ``fn`` writes: a write whose
        reply was lost may have happened (a timeout or a 503 after the commit is routine on object stores),
        so when a retry meets ``FileExistsError`` and ``landed()`` finds this caller's own bytes, the write
        succeeded; anything else stays a conflict (two mirrors committing the same manifest: the second is told
        the step exists). This needs the backend's client not to retry on its own (s3.py: one attempt).
        """
        started = time.monotonic()
        failed = False  # an earlier attempt failed without a definite answer: it may have landed
        for attempt in range(self.retries + 1):
            try:
                result = fn()
            except FileExistsError:
                self._answered = True
                if failed and landed is not None and self._landed(what, landed):
                    log.info("%s: %s had landed (its reply was lost): done", self.url, what)
                    return None  # type: ignore[return-value]
                raise
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                self._answered = True
                raise
            except Exception as e:
                scrub(e, also=self._secrets)  # the backend's own words, kept as the cause: no secret in them
                failure = classify_failure(e, self.option_names)
                if failure is not None and not (failure.kind == "unreachable" and self._answered):
                    raise self.refusal(failure, what) from e
                if not is_transient(e):
                    if self.option_names and _from_backend(e):  # the backend tripped over a setting: the user's
                        raise self.settings_failed(e, what) from e
                    raise
                delay = self.retry_base_s * 2**attempt * (0.5 + random.random())
                asked = retry_after_s(e)
                if asked is not None or is_throttling(e):
                    # the store said how long (or that it is overloaded): wait at least that, and make pollers wait too
                    delay = max(delay, min(asked if asked is not None else 2 * delay, self.retry_max_s))
                    self._throttled_until = time.monotonic() + delay
                spent = time.monotonic() - started
                if attempt == self.retries or spent + delay > self.retry_max_s:
                    raise StoreError(f"{self.url}: {what} failed after {attempt + 1} attempts in {spent:.1f}s: "
                                     f"{redact(str(e), also=self._secrets)}") from e
                log.warning("%s: %s failed (%s); retrying in %.2fs", self.url, what,
                            redact(str(e), also=self._secrets), delay)
                failed = True
                time.sleep(delay)
            else:
                self._answered = True
                return result
        raise AssertionError("unreachable")

    def _landed(self, what: str, landed: Callable[[], bool]) -> bool:
        """``landed()``, read with the same retries; a store that cannot tell counts as "not ours"."""
        try:
            return bool(self.call(f"read back {what}", landed))
        except Exception as e:  # noqa: BLE001 - the conflict is reported, with this reason logged
            log.warning("%s: could not read back %s to tell a lost reply from a conflict: %s", self.url, what,
                        redact(str(e), also=self._secrets))
            return False

    def settings_failed(self, error: BaseException, what: str) -> StoreConfigError:
        """The error for a backend that failed on its settings (a wrong type, a value it cannot use): the user's
        to fix, never retried, naming the options given (their names, never their values)."""
        detail = redact(" ".join(f"{type(error).__name__}: {error}".split()), also=self._secrets)[:300]
        return StoreConfigError(
            f"{self.url}: {what}: the {self.protocol!r} filesystem failed on its settings ({detail}); check each "
            f"storage option's type and value (options given: {', '.join(sorted(self.option_names))})")

    def refusal(self, failure: StoreFailure, what: str) -> Exception:
        """The error a user sees for a failure that retrying cannot mend: what, why, and what to check."""
        detail = redact(" ".join(failure.detail.split()), also=self._secrets)  # one line, no secret
        hint = failure.hint(self.protocol)
        if failure.kind == "no_credentials":
            return StoreAuthError(f"{self.url}: {what}: no credentials found ({detail}); {hint}")
        if failure.kind == "auth":
            return StoreAuthError(f"{self.url}: {what}: access refused ({detail}); {hint}")
        if failure.kind == "unreachable":
            return StoreUnreachableError(f"{self.url}: {what}: cannot connect to the store ({detail}); {hint}")
        if failure.kind == "not_found":
            return FileNotFoundError(f"{self.url}: {detail}")
        return StoreConfigError(
            f"{self.url}: storage option {detail!r} is not one the {self.protocol!r} filesystem takes "
            f"(options given: {', '.join(sorted(self.option_names))}); check its spelling"
        )
