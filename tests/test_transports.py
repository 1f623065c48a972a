"""The transport registry (deltasync/transports/__init__.py) and what each built-in backend adds.

The store contract (deltasync/testing/store_contract.py) runs on every backend; here: which backend a URL gets, that
backends load lazily, that a missing package names its extra, and the memory backend's notifications.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest

from deltasync.errors import (
    CorruptObjectError,
    MissingDependencyError,
    StoreConfigError,
)
from deltasync.store import Manifest, Store, sha256_file
from deltasync.transports import (
    FsspecTransport,
    LocalTransport,
    MemoryTransport,
    open_transport,
    register_transport,
    transient_errors,
    unregister_transport,
)


def test_backends_are_chosen_by_scheme(tmp_path):
    from tests.remote_cli import register, remote_url

    assert type(Store(str(tmp_path)).transport) is LocalTransport
    assert type(Store(f"file://{tmp_path}").transport) is LocalTransport
    assert type(Store("memory://x").transport) is MemoryTransport
    register()
    assert type(Store(remote_url(tmp_path)).transport) is FsspecTransport  # a protocol only fsspec knows
    local = Store(str(tmp_path)).transport.capabilities
    assert local.create_only and local.compare_and_swap and local.local_files


def test_s3_urls_get_the_s3_transport():
    pytest.importorskip("s3fs")
    from deltasync.transports import S3Transport

    t = open_transport("s3://bucket/some/prefix", {"key": "a", "secret": "b", "endpoint_url": "http://127.0.0.1:1"})
    assert type(t) is S3Transport and t.root == "bucket/some/prefix"
    assert t.capabilities.create_only and t.capabilities.compare_and_swap


def test_unknown_scheme_names_the_url_and_the_ways_to_add_one():
    with pytest.raises(StoreConfigError, match="nosuch://x.*no transport for scheme 'nosuch'.*register_transport"):
        Store("nosuch://x")


def test_registered_scheme_wins_and_can_be_forgotten(tmp_path):
    opened = []

    def factory(url, options):
        opened.append((url, options))
        return LocalTransport(tmp_path / url.split("://", 1)[1])

    scheme = f"t{uuid.uuid4().hex[:8]}"
    register_transport(scheme, factory)
    try:
        store = Store(f"{scheme}://here", storage_options={"token": "x"})
        assert opened == [(f"{scheme}://here", {"token": "x"})] and store.transport.root == str(tmp_path / "here")
        register_transport(scheme, lambda url, options: pytest.fail("replace=False keeps the first"), replace=False)
        Store(f"{scheme}://again")
    finally:
        unregister_transport(scheme)
    with pytest.raises(StoreConfigError):
        Store(f"{scheme}://here")


def test_a_factory_needing_a_missing_package_says_which():
    def factory(url, options):
        import deltasync_no_such_package  # noqa: F401

    scheme = f"t{uuid.uuid4().hex[:8]}"
    register_transport(scheme, factory)
    try:
        with pytest.raises(MissingDependencyError, match="'deltasync_no_such_package' is not installed"):
            Store(f"{scheme}://x")
    finally:
        unregister_transport(scheme)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_importing_deltasync_imports_no_backend_package(tmp_path):
    r = _run(f"""
        import sys
        import deltasync
        from deltasync.store import Store
        Store({str(tmp_path)!r}).steps()
        Store("memory://x").steps()
        print(sorted(m for m in ("s3fs", "huggingface_hub", "botocore", "aiobotocore") if m in sys.modules))
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("package", "url", "extra"), [("s3fs", "s3://bucket/run", "s3"), ("huggingface_hub", "hf://buckets/a/b/run", "hf")]
)
def test_a_missing_package_names_the_extra(package, url, extra):
    r = _run(f"""
        import sys
        sys.modules[{package!r}] = None  # as if it were not installed
        from deltasync.errors import MissingDependencyError
        from deltasync.store import Store
        try:
            Store({url!r})
        except MissingDependencyError as e:
            print("MissingDependencyError", e)
        """)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith(f"MissingDependencyError cannot open store {url!r}: the package {package!r} is not "
                           "installed")
    assert f"pip install 'deltasync[{extra}]'" in line


def test_transient_errors_include_http_clients():
    names = {e.__name__ for e in transient_errors()}
    assert {"OSError", "ConnectionError", "HTTPClientError"} <= names


def test_a_missing_object_of_a_committed_step_is_corrupt_not_skipped(tmp_path):
    store = Store(f"memory://hf-like-{tmp_path.name}")
    obj = tmp_path / "o"
    obj.write_bytes(b"payload")
    m = Manifest(step=1, base_step=None, kind="anchor", object="anchor.safetensors", object_bytes=7,
                 object_sha256=sha256_file(obj), state_checksum="0" * 64, created_unix_s=0.0)
    store.write_bytes("steps/000000000001/manifest.json", m.to_json().encode())
    with pytest.raises(CorruptObjectError, match="missing, though the step is committed"):
        store.fetch_object(m)
    store.delete("", recursive=True)
