"""Errors a user sees: each failure caused by input, configuration or environment is a specific
``DeltaSyncError`` through the Python API, and through the CLI one line on stderr and exit status 2.

Stores and servers here are real where it matters and need no network: loopback ports with nothing
listening, a loopback socket whose connects time out, s3fs and huggingface_hub's own clients. Real S3
credentials checks run against SeaweedFS (tests/integration/test_cli_errors_s3.py), real vLLM servers in
tests/integration/test_vllm_server_errors.py; the HTTP stub below replays what vLLM 0.32 answers (as seen
there) and what no vLLM would, since a reply is input too.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest

from deltasync.errors import (
    ConfigError,
    DeltaSyncError,
    EngineConfigError,
    EngineError,
    EngineUnreachableError,
    MissingDependencyError,
    StoreAuthError,
    StoreConfigError,
    StoreError,
    StoreUnreachableError,
)
from deltasync.store import Store
from deltasync_cli import main
from tests.http_server import serving


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """The real entry point, in this process: exit status, stdout, stderr."""
    monkeypatch.setattr("sys.argv", ["deltasync", *args])
    with pytest.raises(SystemExit) as e:
        main()
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def run_cli(*args: str, env: dict | None = None, block_vllm: bool = False) -> subprocess.CompletedProcess:
    """The command in a fresh process, as a user runs it; ``block_vllm``: as if vLLM were not installed."""
    prelude = "import sys; sys.modules['vllm'] = None; " if block_vllm else ""  # every `import vllm...` fails
    code = prelude + "from deltasync_cli import main; sys.argv[0] = 'deltasync'; main()"
    return subprocess.run([sys.executable, "-c", "import sys; " + code, *args], capture_output=True, text=True,
                          timeout=300, env=env)


def assert_one_line_error(code: int, err: str, *needles: str, status: int = 2) -> str:
    """Exit ``status``, exactly one line on stderr, no traceback, naming every needle."""
    lines = err.strip().splitlines()
    assert code == status, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def closed_port() -> int:
    """A loopback port with nothing listening (connects are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def listening_socket() -> Iterator[tuple[str, socket.socket]]:
    """A loopback URL that accepts connections and never answers: a test can see whether anything connected."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        yield f"http://127.0.0.1:{s.getsockname()[1]}", s


def was_contacted(s: socket.socket) -> bool:
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@contextmanager
def blackhole() -> Iterator[str]:
    """A loopback endpoint whose connects time out, like a firewalled or dead host: it listens with a full
    queue and never accepts, so the kernel drops new connection requests."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fill = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fill.append(c)
    try:
        probe = socket.socket()
        probe.settimeout(0.5)
        with pytest.raises(TimeoutError):  # the endpoint really does not complete a connect
            probe.connect(("127.0.0.1", port))
        probe.close()
        yield f"http://127.0.0.1:{port}"
    finally:
        for c in fill:
            c.close()
        srv.close()


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """An environment where botocore finds no credentials: no variables, no files, no instance metadata."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# --- usage errors: checked before anything runs ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["ls", "--bogus"], ["No such option: --bogus", "deltasync ls --help"]),
        (["ls"], ["Missing argument 'url'"]),
        (["ls", "x", "-S", "no-equals-sign"], ["expected KEY=VALUE", "'no-equals-sign'"]),
        (["follow", "URL", "--server", "SERVER", "--verify", "everything"],
         ["--verify", "'everything'", "'incremental', 'changed', 'all'"]),
        (["follow", "URL", "--server", "SERVER", "--mode", "fast"], ["--mode", "'fast'", "'auto', 'live', 'reload'"]),
        (["follow", "URL", "--server", "SERVER", "--poll-s", "-1"], ["--poll-s"]),
    ],
)
def test_usage_errors_are_one_line_and_touch_nothing(args, needles, monkeypatch, capsys, tmp_path):
    with listening_socket() as (server, sock):
        args = [server if a == "SERVER" else str(tmp_path / "stream") if a == "URL" else a for a in args]
        code, out, err = run_main(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, *needles)
        assert not was_contacted(sock)  # --verify/--mode are refused before the server is asked anything
    assert out == "" and not (tmp_path / "stream").exists()


def test_vllm_target_checks_its_settings_before_contacting_the_engine():
    from rollout_loader.vllm import VllmTarget

    with listening_socket() as (server, sock):
        with pytest.raises(ConfigError,
                           match="setting verify: expected one of 'incremental', 'changed', 'all', got 'everything'"):
            VllmTarget(server, verify="everything")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="setting mode: expected one of 'auto', 'live', 'reload', got 'fast'"):
            VllmTarget(server, mode="fast")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="expected http://host:port"):
            VllmTarget("localhost:8000")
        with pytest.raises(ConfigError, match="expected a vllm.LLM, a server URL .* got dict"):
            VllmTarget({})
        assert not was_contacted(sock)


def test_no_arguments_prints_the_help(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys)
    assert code == 2 and "Usage" in out + err and "Traceback" not in out + err


# --- a wrong URL or prefix -----------------------------------------------------------------------------


def test_ls_of_a_location_without_a_stream_is_an_error(tmp_path, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "ls", str(tmp_path / "nowhere"))
    assert_one_line_error(code, err, "StreamNotFoundError", f"no deltasync stream at {tmp_path / 'nowhere'}",
                          "the location does not exist")
    assert out == ""
    (tmp_path / "runs" / "run-7").mkdir(parents=True)  # the stream would be one level down: say what is there
    (tmp_path / "runs" / "notes.txt").write_text("x")
    code, out, err = run_main(monkeypatch, capsys, "ls", str(tmp_path / "runs"))
    assert_one_line_error(code, err, "no deltasync stream at", "it holds notes.txt, run-7")
    code, out, err = run_main(monkeypatch, capsys, "show", str(tmp_path / "runs"), "3")
    assert_one_line_error(code, err, "StreamNotFoundError", "no deltasync stream at")
    assert not (tmp_path / "runs" / "steps").exists() and not (tmp_path / "runs" / "stream.json").exists()


def test_a_stream_with_no_steps_yet_is_not_an_error(tmp_path, monkeypatch, capsys):
    url = str(tmp_path / "stream")
    with Store(url) as store:
        store.create_stream()  # what a publisher writes first
    code, out, err = run_main(monkeypatch, capsys, "ls", url)
    assert code == 0 and "0 committed steps" in " ".join(out.split()) and err == ""  # the title may wrap
    code, out, err = run_main(monkeypatch, capsys, "ls", url, "--json")
    assert code == 0 and json.loads(out) == []


def test_follow_a_wrong_url_fails_before_following(tmp_path, monkeypatch, capsys):
    with http_stub(OK) as stub:
        code, out, err = run_main(monkeypatch, capsys, "follow", str(tmp_path / "nowhere"), "--server", stub.url)
    assert_one_line_error(code, err, "StreamNotFoundError", "no deltasync stream at")
    assert "/pause" not in stub.routes


# --- stores: credentials, unknown options, unreachable endpoints ----------------------------------------


def test_missing_s3_credentials(no_aws_credentials, monkeypatch, capsys, caplog):
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{closed_port()}"  # botocore signs before it connects: never reached
    code, _, err = run_main(monkeypatch, capsys, "ls", "s3://bucket/run", "-S", f"endpoint_url={endpoint}")
    assert_one_line_error(code, err, "StoreAuthError", "s3://bucket/run", "no credentials found",
                          "-S key=... -S secret=...", "AWS_ACCESS_KEY_ID")
    store = Store("s3://bucket/run", storage_options={"endpoint_url": endpoint})
    with caplog.at_level(logging.WARNING, logger="deltasync"), store, pytest.raises(StoreAuthError, match="no "
                                                                                                          "credentials "
                                                                                                          "found"):
        store.steps()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # not retried


def test_unknown_storage_option(monkeypatch, capsys):
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    code, _, err = run_main(monkeypatch, capsys, "ls", "s3://bucket/run", "-S", f"endpoint_url={endpoint}",
                            "-S", "key=a", "-S", "secret=b", "-S", "regoin=eu-west-1")
    assert_one_line_error(code, err, "StoreConfigError", "storage option 'regoin'", "'s3' filesystem")
    opts = {"endpoint_url": endpoint, "key": "a", "secret": "b", "regoin": "x"}
    with Store("s3://bucket/run", storage_options=opts) as store:
        with pytest.raises(StoreConfigError, match="'regoin'"):
            # s3fs takes any option, botocore refuses it at first use
            store.exists("stream.json")


def test_unknown_storage_option_of_a_filesystem_that_checks_at_once(tmp_path):
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class StrictFS(LocalFileSystem):
        protocol = ("strictfs",)

        def __init__(self, auto_mkdir: bool = False) -> None:  # no **kwargs: an unknown option is a TypeError
            super().__init__(auto_mkdir=auto_mkdir)

    fsspec.register_implementation("strictfs", StrictFS, clobber=True)
    with pytest.raises(StoreConfigError, match="storage option 'auto_mkdri'"):
        Store(f"strictfs://{tmp_path}", storage_options={"auto_mkdri": True})
    calls: list = []
    with pytest.raises(TypeError):  # a TypeError that names no option of ours is not a configuration error
        Store(f"strictfs://{tmp_path}").call("op",
                                             _raiser(calls, TypeError("f() got an unexpected keyword argument 'y'")))


def test_unreachable_s3_endpoint_fails_at_once(monkeypatch, capsys, caplog):
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    opts = ["-S", "key=a", "-S", "secret=b", "-S", f"endpoint_url={endpoint}"]
    code, _, err = run_main(monkeypatch, capsys, "ls", "s3://bucket/run", *opts)
    assert_one_line_error(code, err, "StoreUnreachableError", "cannot connect to the store", endpoint, "endpoint_url")
    with caplog.at_level(logging.WARNING, logger="deltasync"), Store(
        "s3://bucket/run", storage_options={"key": "a", "secret": "b", "endpoint_url": endpoint}
    ) as store:
        with pytest.raises(StoreUnreachableError):
            store.steps()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # a store that never answered: no retries


@pytest.mark.timeout(90)  # botocore's own defaults (60 s per connect, 5 attempts) would run past this
def test_s3_endpoint_that_never_accepts_fails_with_a_connect_timeout(monkeypatch, capsys):
    pytest.importorskip("s3fs")
    with blackhole() as endpoint:
        code, _, err = run_main(monkeypatch, capsys, "ls", "s3://bucket/run", "-S", "key=a", "-S", "secret=b",
                                "-S", f"endpoint_url={endpoint}")
        assert_one_line_error(code, err, "StoreUnreachableError", "Connect timeout")
        with Store("s3://bucket/run", storage_options={"key": "a", "secret": "b", "endpoint_url": endpoint}) as store:
            assert store.transport.fs.config_kwargs["connect_timeout"] == 2  # the default deltasync sets for s3
            with pytest.raises(StoreUnreachableError, match="Connect timeout"):
                store.steps()
    user = {"key": "a", "secret": "b", "endpoint_url": "http://127.0.0.1:1", "config_kwargs": {"connect_timeout": 7}}
    with Store("s3://bucket/run", storage_options=user) as store:
        assert store.transport.fs.config_kwargs["connect_timeout"] == 7  # the user's own setting wins
    assert user["config_kwargs"] == {"connect_timeout": 7}  # and their options are not changed


def test_hf_bucket_without_network(monkeypatch, capsys):
    pytest.importorskip("huggingface_hub")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    code, _, err = run_main(monkeypatch, capsys, "ls", "hf://buckets/someone/bucket/run", "-S", f"endpoint={endpoint}")
    assert_one_line_error(code, err, "StoreUnreachableError", "hf://buckets/someone/bucket/run", "HF_ENDPOINT")
    with Store("hf://buckets/someone/bucket/run", storage_options={"endpoint": endpoint}) as store:
        with pytest.raises(StoreUnreachableError, match="Connection refused"):
            store.steps()


def test_hf_bucket_without_a_token(monkeypatch, capsys):
    """A Hub that refuses the request (HTTP 401, as huggingface.co does without a valid token)."""
    pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with http_stub({"*": (401, {"error": "Invalid credentials in Authorization header"})}) as hub:
        code, _, err = run_main(monkeypatch, capsys, "ls", "hf://buckets/someone/bucket/run", "-S",
                                f"endpoint={hub.url}")
        assert_one_line_error(code, err, "StoreAuthError", "401", "HF_TOKEN")
        with Store("hf://buckets/someone/bucket/run", storage_options={"endpoint": hub.url}) as store:
            with pytest.raises(StoreAuthError):
                store.steps()
        assert len(hub.routes) == 2  # one request each: an authentication error is never retried


# --- the retry policy itself ------------------------------------------------------------------------


def _raiser(calls: list, error: BaseException):
    def fn():
        calls.append(1)
        raise error

    return fn


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    reply = {"Error": {"Code": code, "Message": f"{code} message"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(reply, "ListObjectsV2")


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken"])
def test_authentication_errors_are_never_retried(tmp_path, code):
    pytest.importorskip("botocore")
    from s3fs.errors import translate_boto_error

    store = Store(str(tmp_path), retries=5, retry_base_s=0.001)
    calls: list = []
    with pytest.raises(StoreAuthError, match=f"list: access refused \\({code}: {code} message\\)"):
        store.call("list", _raiser(calls, translate_boto_error(_client_error(code, 403))))  # as s3fs raises it
    assert len(calls) == 1
    calls.clear()
    from botocore.exceptions import NoCredentialsError

    with pytest.raises(StoreAuthError, match="no credentials found"):
        store.call("list", _raiser(calls, NoCredentialsError()))
    assert len(calls) == 1


def test_connect_failures_are_final_only_until_the_store_answered(tmp_path):
    pytest.importorskip("botocore")
    from botocore.exceptions import EndpointConnectionError

    store = Store(str(tmp_path), retries=3, retry_base_s=0.001)
    calls: list = []
    with pytest.raises(StoreUnreachableError):  # never answered: a wrong endpoint
        store.call("list", _raiser(calls, EndpointConnectionError(endpoint_url="http://127.0.0.1:1")))
    assert len(calls) == 1
    assert store.call("list", lambda: "answer") == "answer"
    calls.clear()
    with pytest.raises(StoreError, match="failed after 4 attempts") as e:  # answered before: an outage, retried
        store.call("list", _raiser(calls, EndpointConnectionError(endpoint_url="http://127.0.0.1:1")))
    assert len(calls) == 4 and not isinstance(e.value, StoreUnreachableError)


def test_definite_answers_are_not_retried(tmp_path):
    store = Store(str(tmp_path), retries=3, retry_base_s=0.001)
    for error in (FileNotFoundError("x"), FileExistsError("x")):
        calls: list = []
        with pytest.raises(type(error)):
            store.call("op", _raiser(calls, error))
        assert len(calls) == 1


def test_total_retry_time_is_bounded(tmp_path):
    store = Store(str(tmp_path), retries=100, retry_base_s=0.01, retry_max_s=0.05)
    calls: list = []
    with pytest.raises(StoreError, match="failed after"):
        store.call("op", _raiser(calls, TimeoutError("slow")))
    # delays are at least 0.005 * 2**k: the fifth would take the total past 0.05 s whatever the jitter
    assert 1 <= len(calls) <= 5


# --- the vLLM server, seen from the client -----------------------------------------------------------


class Stub:
    def __init__(self, url: str) -> None:
        self.url = url
        self.routes: list[str] = []


@contextmanager
def http_stub(replies: dict[str, tuple[int, object]]) -> Iterator[Stub]:
    """A loopback HTTP server answering each route (path without query; "*" for any) with (status, JSON
    body or raw bytes), recording the routes asked."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            route = self.path.split("?", 1)[0]
            stub.routes.append(route)
            status, body = replies.get(route, replies.get("*", (404, {"detail": "Not Found"})))
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_HEAD = _reply

        def log_message(self, *args: object) -> None:
            pass

    stub = Stub("")
    with serving(Handler) as stub.url:
        yield stub


# what vLLM 0.32 answers (tests/integration/test_vllm_server_errors.py checks these against real servers)
OK = {"/pause": (200, {"status": "paused"}), "/resume": (200, {"status": "resumed"}),
      "/weight_info": (200, {"weight_version": "default"}),
      "/init_weight_transfer_engine": (200, {"message": "Weight transfer initialized"})}
NO_DEV_MODE = {"/weight_info": (404, {"detail": "Not Found"})}  # every dev route: 404 {"detail": "Not Found"}
NO_WEIGHT_TRANSFER = {**OK, "/init_weight_transfer_engine": (500, {"error": {
    "message": "Call to collective_rpc method failed: Worker failed with error 'Weight transfer not configured. Please "
    "set weight_transfer_config to enable weight transfer.', please check the stack trace above for the root cause",
    "type": "InternalServerError", "param": None, "code": 500}})}


@pytest.mark.parametrize(
    ("replies", "error", "needles"),
    [
        (NO_DEV_MODE, EngineConfigError, ["VLLM_SERVER_DEV_MODE=1", "/weight_info"]),
        (NO_WEIGHT_TRANSFER, EngineConfigError, ["--weight-transfer-config '{\"backend\": \"deltasync\"}'"]),
        ({"/weight_info": (200, b"<html>not json")}, EngineError, ["not JSON"]),
        ({"/weight_info": (200, {"weight_version": 3})}, EngineError, ["expected {'weight_version': str}"]),
        ({"/weight_info": (200, [1, 2])}, EngineError, ["expected {'weight_version': str}"]),
        ({"/weight_info": (503, {"error": "overloaded"})}, EngineError, ["HTTP 503", "overloaded"]),
    ],
    ids=["no-dev-mode", "no-weight-transfer", "not-json", "version-not-str", "a-list", "http-503"],
)
def test_server_not_set_up_for_deltasync(replies, error, needles, tmp_path, monkeypatch, capsys):
    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget

    url = str(tmp_path / "stream")
    with Store(url) as store:
        store.create_stream()
    with http_stub(replies) as stub:
        follower = Follower(url, VllmTarget(stub.url))
        with pytest.raises(error) as e:
            follower.connect()
        follower.close()
        assert not isinstance(e.value, StoreError)  # an engine failure is not a store failure
        for needle in needles:
            assert needle in str(e.value)
        code, _, err = run_main(monkeypatch, capsys, "follow", url, "--server", stub.url)
        assert_one_line_error(code, err, type(e.value).__name__, *needles)
        assert "/pause" not in stub.routes  # found out before anything paused


def test_a_servers_words_cannot_drive_the_terminal(tmp_path, monkeypatch, capsys):
    """An HTTP body (or an engine error relayed in one) is the server's text: the one-line error shows its control
    characters escaped, so a hostile or broken server cannot clear the screen, retitle the window or reorder text."""
    from deltasync.errors import to_text

    url = str(tmp_path / "stream")
    with Store(url) as store:
        store.create_stream()
    nasty = "over\x1b[2J\x1b]0;owned\x07loaded\x9b31m \u202egnp.exe"
    for reply, name in (((503, f"overloaded: {nasty}".encode()), "EngineError"),
                        ((500, {"error": {"message": to_text(ConfigError(nasty))}}), "ConfigError")):
        with http_stub({**OK, "/init_weight_transfer_engine": reply}) as stub:
            code, _, err = run_main(monkeypatch, capsys, "follow", url, "--server", stub.url)
        line = assert_one_line_error(code, err, name, "over\\x1b[2J\\x1b]0;owned\\x07loaded", "\\u202egnp.exe")
        assert line.isprintable(), repr(line)


def test_unreachable_server(tmp_path, monkeypatch, capsys):
    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget

    server = f"http://127.0.0.1:{closed_port()}"
    url = str(tmp_path / "stream")
    with Store(url) as store:
        store.create_stream()
    follower = Follower(url, VllmTarget(server))
    with pytest.raises(EngineUnreachableError, match="cannot connect to the vLLM server"):
        follower.connect()
    follower.close()
    code, _, err = run_main(monkeypatch, capsys, "follow", url, "--server", server)
    assert_one_line_error(code, err, "EngineUnreachableError", server)


# --- follow without vLLM installed ------------------------------------------------------------------


def test_follow_needs_no_vllm_package_for_a_server(tmp_path):
    """`deltasync follow --server` runs where vLLM is not installed: it gets as far as the server (none
    listens here), and says that, not ImportError."""
    server = f"http://127.0.0.1:{closed_port()}"
    with Store(str(tmp_path / "stream")) as store:
        store.create_stream()
    r = run_cli("follow", str(tmp_path / "stream"), "--server", server, block_vllm=True)
    assert_one_line_error(r.returncode, r.stderr, "EngineUnreachableError", server)


def test_an_offline_engine_without_vllm_names_the_extra(tmp_path):
    script = (
        "import sys; sys.modules['vllm'] = None\n"
        "from deltasync.errors import MissingDependencyError\n"
        "from rollout_loader.vllm import start_engine\n"

        "for make in (lambda: start_engine('model'),):\n"
        "    try:\n"
        "        make()\n"
        "    except MissingDependencyError as e:\n"
        "        print(type(e).__name__, e.name, str(e))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 1, r.stderr
    for line in lines:
        assert line.startswith("MissingDependencyError vllm ") and "pip install 'deltasync[vllm]'" in line


def test_missing_dependency_error_is_an_import_error():
    assert issubclass(MissingDependencyError, ImportError) and issubclass(MissingDependencyError, DeltaSyncError)


# --- what is not a user error --------------------------------------------------------------------


def test_an_unexpected_error_is_one_line_with_a_hint(tmp_path, monkeypatch, capsys):
    url = str(tmp_path / "stream")
    with Store(url) as store:
        store.create_stream()

    def broken(self):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(Store, "steps", broken)
    monkeypatch.delenv("DELTASYNC_DEBUG", raising=False)
    code, _, err = run_main(monkeypatch, capsys, "ls", url)
    assert_one_line_error(code, err, "internal error", "ZeroDivisionError: a bug", "DELTASYNC_DEBUG=1", status=3)
    monkeypatch.setenv("DELTASYNC_DEBUG", "1")
    code, _, err = run_main(monkeypatch, capsys, "ls", url)
    assert code == 3 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: internal error")


def test_environment_errors_are_user_errors(tmp_path, monkeypatch, capsys):
    url = str(tmp_path / "stream")
    with Store(url) as store:
        store.create_stream()

    def denied(self):
        raise PermissionError(13, "Permission denied", url)

    monkeypatch.setattr(Store, "steps", denied)
    code, _, err = run_main(monkeypatch, capsys, "ls", url)
    assert_one_line_error(code, err, "PermissionError", "Permission denied")


def test_the_demo_without_transformers_names_the_extra():
    """It exited 3 ("internal error") with a raw ModuleNotFoundError."""
    code = ("import sys; sys.modules['transformers'] = None; sys.argv[0] = 'deltasync'\n"
            "from deltasync_cli import main\nmain()\n")
    r = subprocess.run([sys.executable, "-c", code, "demo", "--engine", "torch", "--steps", "2"], capture_output=True,
                       text=True, timeout=300)
    assert_one_line_error(r.returncode, r.stderr, "MissingDependencyError", "pip install 'deltasync[demo]'")
