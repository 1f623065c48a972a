"""S3 and S3-compatible servers (``s3://bucket/prefix``) through s3fs, with S3's conditional writes.

``If-None-Match: *`` makes a create-only write atomic, ``If-Match: <ETag>`` a compare-and-swap; AWS S3 and
SeaweedFS honour both (tests/integration). Large objects go through s3fs: multipart, concurrent, streamed
from disk. Needs the ``s3`` extra (s3fs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import s3fs  # noqa: F401 - imported here so that a missing package names the extra (deltasync[s3])

from deltasync.transports.base import Capabilities, Data, read_data, too_large
from deltasync.transports.fsspec import FsspecTransport

_READ_BYTES = 1 << 16  # what s3fs reads a body by


class S3Transport(FsspecTransport):
    """Objects under ``bucket/prefix`` of an ``s3fs.S3FileSystem``."""

    capabilities = Capabilities(create_only=True, compare_and_swap=True)

    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        if not (if_absent or if_version is not None):
            super().put(key, data)
            return
        path = self.path(key)
        bucket, s3_key, _ = self.fs.split_path(path)
        condition = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_version}
        body = read_data(data)  # conditional writes are small documents: one PutObject
        self._call("put_object", Bucket=bucket, Key=s3_key, Body=bytes(body), **condition)
        self.fs.invalidate_cache(path)

    def delete(self, key: str) -> None:
        """DeleteObject: a refusal is raised (s3fs's ``rm`` deletes in bulk and drops every per-key error, so a
        garbage collection without delete rights reported steps deleted that were all still there)."""
        path = self.path(key)
        bucket, s3_key, _ = self.fs.split_path(path)
        self._call("delete_object", Bucket=bucket, Key=s3_key)
        self.fs.invalidate_cache(path)

    def delete_tree(self, prefix: str) -> None:
        """Every object under the folder ``prefix``, in bulk requests whose per-key errors are raised."""
        path = self.path(prefix.rstrip("/"))
        try:
            found = self.fs.find(path)
        except FileNotFoundError:
            return
        bucket = self.fs.split_path(path)[0]
        keys = [self.fs.split_path(p)[1] for p in found]
        for i in range(0, len(keys), 1000):  # S3's limit per DeleteObjects request
            batch = keys[i:i + 1000]
            reply = self._call("delete_objects", Bucket=bucket,
                               Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = reply.get("Errors") or []
            if errors:
                first = errors[0]
                kind = PermissionError if first.get("Code") == "AccessDenied" else OSError
                raise kind(f"{len(errors)} of {len(batch)} objects under {prefix} not deleted: "
                           f"{first.get('Code')}: {first.get('Message')} ({first.get('Key')})")
        self.fs.invalidate_cache(path)

    def get_file(self, key: str, local: Path, *, max_bytes: int | None = None) -> None:
        """The object into ``local``; with ``max_bytes``, bounded (``Transport.get_file``): one GetObject, whose
        Content-Length refuses a larger object before any of its body is read (the response closed at once, its
        connection not drained), and whose body is read to ``max_bytes + 1`` bytes at most where a server sends
        none. The requests are s3fs's own: that one GET streamed for an object up to s3fs's block size (50 MiB),
        ranged parts in parallel after it for a larger one (s3fs's concurrent download, as its ``get_file`` does).
        Done here rather than through an fsspec callback: s3fs leaves the response open when ``set_size`` raises,
        and aiohttp then keeps its connection out of the pool for good."""
        if max_bytes is None:
            super().get_file(key, local)
            return
        bucket, s3_key, _ = self.fs.split_path(self.path(key))
        block = int(self.fs.default_block_size)
        in_parts = getattr(self.fs, "_download_file_part_concurrent", None)  # s3fs >= 2025.10

        async def download() -> None:
            reply = await self._client_call("get_object", Bucket=bucket, Key=s3_key, **self.fs.req_kw)
            body = reply["Body"]
            try:
                size = reply.get("ContentLength")
                if size is not None and size > max_bytes:
                    raise too_large(key, max_bytes, int(size))
                if size is not None and size > block and in_parts is not None and self.fs.max_concurrency > 1:
                    body.close()
                    await in_parts(bucket, s3_key, str(local), size, block)
                    return
                done = 0
                with open(local, "wb") as f:  # noqa: ASYNC230 - s3fs writes its downloads on its loop too
                    while done <= max_bytes:
                        data = await body.read(min(_READ_BYTES, max_bytes + 1 - done))
                        if not data:
                            break
                        f.write(data)
                        done += len(data)
                if done > max_bytes:
                    raise too_large(key, max_bytes, done)
            finally:
                body.close()  # after the whole body: nothing to do; before: the connection is closed, not drained

        self._sync(download)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        bucket, s3_key, _ = self.fs.split_path(self.path(key))

        async def get() -> tuple[bytes, str]:
            reply = await self._client_call("get_object", Bucket=bucket, Key=s3_key)
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


def s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """The options with deltasync's defaults for botocore: unless told otherwise, a connect that has not
    succeeded in 2 s will not (botocore waits 60 s, five times), and one attempt per request, since
    ``Store.call`` retries (and bounds the time). ``total_max_attempts``: botocore's ``max_attempts`` counts
    retries after the first, so ``max_attempts: 1`` still sent a throttled request twice, and a create-only
    write whose reply was lost came back as a conflict before the store could tell it from one.
    The caller's dict is not changed."""
    options = dict(storage_options)
    config = options.get("config_kwargs", {})
    if isinstance(config, dict):
        options["config_kwargs"] = {"connect_timeout": 2, **config,
                                    "retries": dict(config.get("retries", {"total_max_attempts": 1}))}
    return options


def open_s3(url: str, storage_options: dict[str, Any]) -> S3Transport:
    """``s3://bucket/prefix`` (``s3a://`` too); storage options go to s3fs (key, secret, endpoint_url, ...)."""
    fs, root = fsspec.core.url_to_fs(url, **s3_options(storage_options))
    # s3fs retries a throttled request 5 times on its own, unjittered: one logical read could become 25
    # requests with botocore's. Store.call is the one retry policy (jittered, honouring Retry-After).
    fs.retries = 1
    return S3Transport(fs, root)
