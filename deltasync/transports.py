"""How bytes move between this machine and a store: the one stage that differs per backend.

``Store`` (store.py) owns the layout and the commit protocol and calls the primitives here. Two of them are
what makes a commit safe: ``put_bytes(..., if_absent=True)`` never replaces an existing object (the
manifest: a committed step is never replaced), and ``put_bytes(..., if_version=v)`` replaces an object only
if it is still at version ``v`` as read by ``get_versioned`` (the writer lease: a compare-and-swap).
``atomic_conditions`` says whether the backend does either atomically; where it cannot, the transport
checks first and writes after (a window of one round trip, documented in docs/FORMAT.md).

Backends: ``LocalTransport`` (rename; ``link`` for create-only; a lock file for compare-and-swap),
``S3Transport`` (S3 conditional writes ``If-None-Match: *`` and ``If-Match: <ETag>``),
``FsspecTransport`` (any fsspec filesystem: GCS, Azure, memory), ``HfBucketTransport`` (Hugging Face Storage
Buckets through huggingface_hub's batched bucket API).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Protocol

import fsspec

from deltasync.errors import StoreError


class Transport(Protocol):
    """Whole-object transfers; each object becomes visible complete or not at all."""

    atomic_conditions: bool

    def move_in(self, local: Path, path: str) -> None:
        """Publish the local file at ``path`` (the local file may be consumed)."""

    def put_bytes(self, data: bytes, path: str, *, if_absent: bool = False, if_version: str | None = None) -> None:
        """Write one small object. ``if_absent``: ``FileExistsError`` if it exists; ``if_version``:
        ``FileExistsError`` unless it is still at that version (``get_versioned``)."""

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        """An object's bytes and an opaque version tag; ``FileNotFoundError`` if it does not exist."""

    def get_file(self, path: str, local: Path) -> None:
        """Download ``path`` to ``local``; ``FileNotFoundError`` if it does not exist."""


def _content_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalTransport:
    """A folder on this machine: temporary name, fsync, atomic rename; ``link`` never replaces a file."""

    atomic_conditions = True

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def move_in(self, local: Path, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(local, "rb+") as f:
            os.fsync(f.fileno())
        _share(local)
        try:
            os.replace(local, path)
        except OSError:  # another filesystem: copy under a temporary name, then rename
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            shutil.copyfile(local, tmp)
            os.replace(tmp, path)

    def put_bytes(self, data: bytes, path: str, *, if_absent: bool = False, if_version: str | None = None) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _share(tmp)
        try:
            if if_absent:
                os.link(tmp, path)  # atomic, and fails if the name exists: never replaces a file
            elif if_version is not None:
                with _locked(path):
                    try:
                        current = _content_version(Path(path).read_bytes())
                    except FileNotFoundError:
                        current = None
                    if current != if_version:
                        raise FileExistsError(f"{path} changed since it was read")
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        data = Path(path).read_bytes()
        return data, _content_version(data)

    def get_file(self, path: str, local: Path) -> None:
        shutil.copyfile(path, local)


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on ``path`` for processes of this machine (a sibling ``.lock`` file)."""
    lock = f"{os.path.dirname(path)}/.{os.path.basename(path)}.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _umask() -> int:
    try:  # Linux tells it without changing it
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()


def _share(path: str | Path) -> None:
    """Give a file made under a private temporary name the permissions the umask asks for (temporary files
    are 0600: an inference server running as another user could not read the store)."""
    os.chmod(path, 0o666 & ~UMASK)


class FsspecTransport:
    """Any fsspec filesystem whose single-object PUT is atomic (GCS, Azure Blob, memory).

    Create-only writes use fsspec's ``mode="create"``, which backends implement natively where they can;
    fsspec's own fallback (and the compare-and-swap here) checks first and writes after.
    """

    atomic_conditions = False

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        # memory:// lives in this process: a lock makes its conditions atomic
        self.atomic_conditions = "memory" in protocols
        self._lock = threading.Lock()

    def move_in(self, local: Path, path: str) -> None:
        self.fs.put_file(str(local), path)  # multipart for large files, streamed from disk

    def put_bytes(self, data: bytes, path: str, *, if_absent: bool = False, if_version: str | None = None) -> None:
        with self._lock:
            if if_absent:
                self.fs.pipe_file(path, data, mode="create")
                return
            if if_version is not None:
                try:
                    current = _content_version(self.fs.cat_file(path))
                except FileNotFoundError:
                    current = None
                if current != if_version:
                    raise FileExistsError(f"{path} changed since it was read")
            self.fs.pipe_file(path, data)

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        data = self.fs.cat_file(path)
        return data, _content_version(data)

    def get_file(self, path: str, local: Path) -> None:
        self.fs.get_file(path, str(local))


class S3Transport(FsspecTransport):
    """S3 and S3-compatible servers through s3fs, with S3's conditional writes: ``If-None-Match: *``
    (create-only) and ``If-Match: <ETag>`` (compare-and-swap). AWS S3 and SeaweedFS honour both."""

    atomic_conditions = True

    def put_bytes(self, data: bytes, path: str, *, if_absent: bool = False, if_version: str | None = None) -> None:
        bucket, key, _ = self.fs.split_path(path)
        condition = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_version} if if_version is not None else {}
        self._call("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        self.fs.invalidate_cache(path)

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        bucket, key, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes, str]:
            reply = await self._client_call("get_object", Bucket=bucket, Key=key)
            async with reply["Body"] as body:
                return await body.read(), reply["ETag"]

        return self._sync(get)

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self._sync(lambda: self._client_call(method, **kwargs))

    async def _client_call(self, method: str, **kwargs: Any) -> Any:
        await self.fs.set_session()
        client = await self.fs.get_s3(kwargs.get("Bucket"))
        return await getattr(client, method)(**kwargs)

    def _sync(self, make: Any) -> Any:
        """Run a coroutine on s3fs's loop; S3's answers become the builtin errors the store understands."""
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error

        async def run() -> Any:
            return await make()

        try:
            return fsspec.asyn.sync(self.fs.loop, run)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise FileExistsError(f"condition failed: {code or status}") from None
            raise translate_boto_error(e) from e


class HfBucketTransport:
    """Hugging Face Storage Buckets: batched uploads from files, downloads that fail on a missing file.

    Buckets offer no conditional write: create-only and compare-and-swap are a check then a write.

    ``download_bucket_files`` only warns about missing files unless told otherwise; here a missing file is
    always an error, so a step can never be half-downloaded silently.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, storage_options: dict[str, Any]) -> None:
        from huggingface_hub import HfApi

        parts = root.split("/")
        if len(parts) < 3 or parts[0] != "buckets":
            raise StoreError(f"hf://{root}: a bucket URL looks like hf://buckets/<namespace>/<name>[/path]")
        self.fs = fs
        self.atomic_conditions = False
        self.bucket_id = f"{parts[1]}/{parts[2]}"
        self._prefix = f"buckets/{self.bucket_id}/"
        self.api = HfApi(token=storage_options.get("token"), endpoint=storage_options.get("endpoint"))

    def _key(self, path: str) -> str:
        if not path.startswith(self._prefix):
            raise StoreError(f"{path} is outside bucket {self.bucket_id}")
        return path[len(self._prefix) :]

    def move_in(self, local: Path, path: str) -> None:
        self.api.batch_bucket_files(self.bucket_id, add=[(str(local), self._key(path))])
        self._invalidate()

    def put_bytes(self, data: bytes, path: str, *, if_absent: bool = False, if_version: str | None = None) -> None:
        # buckets have no conditional writes: check, then write (a window of one round trip; docs/FORMAT.md)
        if if_absent or if_version is not None:
            try:
                current: str | None = self.get_versioned(path)[1]
            except FileNotFoundError:
                current = None
            if (if_absent and current is not None) or (if_version is not None and current != if_version):
                raise FileExistsError(f"{path} exists or changed since it was read")
        self.api.batch_bucket_files(self.bucket_id, add=[(data, self._key(path))])
        self._invalidate()

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        data = self.fs.cat_file(path)
        return data, _content_version(data)

    def get_file(self, path: str, local: Path) -> None:
        from huggingface_hub.errors import EntryNotFoundError

        try:
            self.api.download_bucket_files(self.bucket_id, [(self._key(path), str(local))], raise_on_missing_files=True)
        except EntryNotFoundError as e:
            raise FileNotFoundError(path) from e

    def _invalidate(self) -> None:
        # HfFileSystem caches listings; our own writes must be visible to our next listing
        self.fs.invalidate_cache()


def transient_errors() -> tuple[type[BaseException], ...]:
    """Exception types worth retrying: the builtins, plus the HTTP clients' own (botocore's connection
    errors, for one, are not ``OSError``s; huggingface_hub uses ``httpx2``). Clients that are not installed
    are skipped. Failures that retrying cannot mend are told apart first (:func:`classify_failure`)."""
    errors: list[type[BaseException]] = [OSError, TimeoutError, ConnectionError]
    for module, names in (
        ("botocore.exceptions", ("ConnectionError", "HTTPClientError")),
        ("aiohttp", ("ClientError",)),
        ("httpx", ("TransportError",)),
        ("httpx2", ("TransportError",)),
    ):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        errors += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return tuple(errors)


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


def transport_for(fs: fsspec.AbstractFileSystem, root: str, storage_options: dict[str, Any]) -> Transport:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        return LocalTransport(fs)
    if "hf" in protocols and root.startswith("buckets/"):
        return HfBucketTransport(fs, root, storage_options)
    if "s3" in protocols and hasattr(fs, "split_path") and hasattr(fs, "get_s3"):
        return S3Transport(fs)
    return FsspecTransport(fs)
