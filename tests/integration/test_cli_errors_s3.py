"""Errors a user sees with a real S3 server (SeaweedFS on loopback) that checks credentials: wrong keys,
no keys, a wrong prefix or bucket. Each is one line and exit 2 from the CLI, a specific ``DeltaSyncError``
from the Python API, and never retried."""

from __future__ import annotations

import json
import logging
import subprocess
import time
import uuid

import pytest

from deltasync.errors import StoreAuthError
from deltasync.store import Store
from tests.integration.seaweedfs import SeaweedFS, _server
from tests.test_cli_errors import assert_one_line_error, no_aws_credentials, run_main  # noqa: F401 - fixture

pytestmark = pytest.mark.s3

KEY = SECRET = "deltasync"  # the identity the server knows: the fixtures' own storage options


def _require_credentials(server: SeaweedFS, timeout_s: float = 30) -> None:
    """Give the server one identity (it then refuses every other request), and wait until it does."""
    command = (f"s3.configure -access_key={KEY} -secret_key={SECRET} -user=deltasync-tests "
               "-actions=Read,Write,List,Tagging,Admin -apply")
    subprocess.run([server.binary, "shell", f"-master=127.0.0.1:{server.ports['master']}"], input=f"{command}\nexit\n",
                   capture_output=True, text=True, timeout=60, check=True)
    deadline = time.monotonic() + timeout_s
    while True:
        refused = accepted = False
        wrong = {**server.storage_options, "secret": "wrong"}
        with Store("s3://deltasync-tests/probe", storage_options=wrong) as store:
            try:
                store.exists("x")
            except StoreAuthError:
                refused = True
        with Store("s3://deltasync-tests/probe", storage_options=server.storage_options) as store:
            store.exists("x")
            accepted = True
        if refused and accepted:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("SeaweedFS does not check credentials after s3.configure")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A SeaweedFS of this module's own that checks credentials (the shared one accepts any)."""
    servers = _server(tmp_path_factory.mktemp("seaweedfs-auth"))
    server = next(servers)
    try:
        server.new_url()  # creates the test bucket while any request is still accepted
        _require_credentials(server)
        yield server
    finally:
        servers.close()  # stops the server


def cli_options(opts: dict) -> list[str]:
    """Storage options as a user types them: -S KEY=VALUE, JSON values."""
    return [x for k, v in opts.items() for x in ("-S", f"{k}={json.dumps(v)}")]


def without_keys(opts: dict) -> dict:
    return {k: v for k, v in opts.items() if k not in ("key", "secret")}


@pytest.mark.parametrize(
    ("change", "code"),
    [({"key": "nobody"}, "InvalidAccessKeyId"), ({"secret": "wrong"}, "SignatureDoesNotMatch")],
    ids=["wrong-key", "wrong-secret"],
)
def test_rejected_credentials(s3, change, code, monkeypatch, capsys, caplog):
    url = s3.new_url()
    opts = {**s3.storage_options, **change}
    exit_code, out, err = run_main(monkeypatch, capsys, "ls", url, *cli_options(opts))
    assert_one_line_error(exit_code, err, "StoreAuthError", url, "access refused", code, "AWS_ACCESS_KEY_ID")
    assert out == ""
    with caplog.at_level(logging.WARNING, logger="deltasync"), Store(url, storage_options=opts) as store:
        with pytest.raises(StoreAuthError, match=code):
            store.steps()
        with pytest.raises(StoreAuthError, match="403"):  # a HEAD request: S3 answers 403 without a body
            store.exists("stream.json")
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # never retried


def test_missing_credentials(s3, no_aws_credentials, monkeypatch, capsys):  # noqa: F811
    url = s3.new_url()
    opts = without_keys(s3.storage_options)
    exit_code, _, err = run_main(monkeypatch, capsys, "ls", url, *cli_options(opts))
    assert_one_line_error(exit_code, err, "StoreAuthError", url, "no credentials found", "-S key=... -S secret=...")
    with Store(url, storage_options=opts) as store, pytest.raises(StoreAuthError, match="no credentials found"):
        store.steps()


def test_anonymous_access_to_a_private_bucket(s3, monkeypatch, capsys):
    url = s3.new_url()
    opts = {**without_keys(s3.storage_options), "anon": True}
    exit_code, _, err = run_main(monkeypatch, capsys, "ls", url, *cli_options(opts))
    assert_one_line_error(exit_code, err, "StoreAuthError", "AccessDenied")


def test_wrong_prefix_or_bucket(s3, monkeypatch, capsys):
    opts = s3.storage_options
    parent = s3.new_url()
    with Store(f"{parent}/run-7", storage_options=opts) as store:
        store.create_stream()  # a stream with no steps yet, one level below where the user looks
    exit_code, out, err = run_main(monkeypatch, capsys, "ls", f"{parent}/run-7", "--json", *cli_options(opts))
    assert exit_code == 0 and json.loads(out) == [] and err == ""

    exit_code, out, err = run_main(monkeypatch, capsys, "ls", parent, *cli_options(opts))
    assert_one_line_error(exit_code, err, "StreamNotFoundError", f"no deltasync stream at {parent}", "it holds run-7")
    exit_code, _, err = run_main(monkeypatch, capsys, "ls", f"{parent}/run-8", *cli_options(opts))
    assert_one_line_error(exit_code, err, "StreamNotFoundError", "the location does not exist")
    bucket = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run-7"
    exit_code, _, err = run_main(monkeypatch, capsys, "show", bucket, "0", *cli_options(opts))
    assert_one_line_error(exit_code, err, "StreamNotFoundError", f"no deltasync stream at {bucket}")
