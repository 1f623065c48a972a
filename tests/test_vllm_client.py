"""The clients of the vLLM weight-transfer routes, and a ``Follower`` driving a server through ``VllmTarget``, against
a loopback HTTP stub that answers as vLLM 0.32 does (tests/integration/test_vllm_engine.py and
test_vllm_server*.py check the same against real servers).
No vLLM needed; the engine's init/update info checks import vLLM and are skipped without it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest
import torch

from deltasync import DeltaPublisher
from deltasync.errors import (
    ChecksumMismatchError,
    ConfigError,
    CorruptObjectError,
    EngineConfigError,
    EngineError,
    EngineUnreachableError,
    HeldStepError,
    StepNotFoundError,
    TensorMismatchError,
    can_retry,
    to_text,
)
from rollout_loader import Follower, PollPolicy
from rollout_loader.vllm import EngineSettings, HttpWeightTransfer, LocalWeightTransfer, VllmTarget
from tests.http_server import serving
from tests.test_cli_errors import closed_port

_WORKER_FAILED = ("Call to collective_rpc method failed: Worker failed with error '{}', please check the stack trace "
                  "above for the root cause")


def _vllm_500(message: str) -> tuple[int, dict]:
    return 500, {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}


class FakeServer:
    """Answers each route from ``replies`` (status, JSON) or a callable of the request body; records
    (route, body) of every request. The default replies are a healthy server holding ``version``."""

    def __init__(self) -> None:
        self.version = "default"
        self.calls: list[tuple[str, dict | None]] = []
        self.replies: dict[str, object] = {}

    def answer(self, route: str, body: dict | None) -> tuple[int, object]:
        self.calls.append((route, body))
        if route in self.replies:
            reply = self.replies[route]
            return reply(body) if callable(reply) else reply  # type: ignore[return-value]
        if route == "/weight_info":
            return 200, {"weight_version": self.version}
        if route == "/finish_weight_update" and body and body.get("weight_version") is not None:
            self.version = body["weight_version"]
        if route in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                     "/pause", "/resume"):
            return 200, {"message": "ok"}
        if route == "/reset_prefix_cache":
            return 200, {"success": True}
        return 404, {"detail": "Not Found"}

    def routes(self) -> list[str]:
        return [r for r, _ in self.calls]


@contextmanager
def fake_server() -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body = fake.answer(self.path.split("?", 1)[0], json.loads(raw) if raw else None)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _reply

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield fake, url


def test_an_update_is_pause_start_update_finish_reset_resume():
    with fake_server() as (fake, url):
        client = HttpWeightTransfer(url)
        assert client.held_step() is None  # vLLM's "default": never updated
        client.update(7)
        assert fake.routes()[1:] == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                                     "/weight_info", "/reset_prefix_cache", "/resume"]  # the version read back
        assert fake.calls[3][1] == {"update_info": {"step": 7}}
        assert fake.calls[4][1] == {"weight_version": "7"}
        assert client.held_step() == 7 and len(client.pauses_s) == 1


@pytest.mark.parametrize(
    ("remote", "needles"),
    [
        (ChecksumMismatchError("step 3: the engine's weights do not match; rolled back to step 2"),
         ["rolled back to step 2"]),
        (TensorMismatchError("step 3: the step does not fit the engine: 'w' is [4, 4], the engine's [8, 4]"),
         ["does not fit", "'w' is [4, 4]"]),
        (StepNotFoundError("the chain to step 9 is broken"), ["step 9"]),
    ],
)
def test_a_failed_update_keeps_the_version_and_resumes(remote, needles):
    """The engine's error crosses the HTTP boundary as data (its record leads its text): the client raises the
    same class, so whether retrying can help is the class's answer, not the client's guess."""
    with fake_server() as (fake, url):
        fake.version = "2"
        fake.replies["/update_weights"] = _vllm_500(_WORKER_FAILED.format(to_text(remote)))
        client = HttpWeightTransfer(url)
        with pytest.raises(type(remote)) as e:
            client.update(3)
        assert type(e.value) is type(remote) and can_retry(e.value) == can_retry(remote)
        assert "deltasync-error" not in str(e.value)
        for needle in needles:
            assert needle in str(e.value)
        assert "/finish_weight_update" not in fake.routes()  # vLLM closed the session; the version stays
        assert fake.routes()[-2:] == ["/reset_prefix_cache", "/resume"]  # never left paused
        assert client.held_step() == 2


def test_a_session_left_open_by_a_dead_client_is_closed_first():
    with fake_server() as (fake, url):
        starts = iter([_vllm_500(_WORKER_FAILED.format(
            "start_weight_update called while a weight update is already active. Call finish_weight_update first.")),
            (200, {"message": "ok"})])
        fake.replies["/start_weight_update"] = lambda body: next(starts)
        HttpWeightTransfer(url).update(4)
        assert fake.routes()[:5] == ["/pause", "/start_weight_update", "/finish_weight_update", "/start_weight_update",
                                     "/update_weights"]
        assert fake.version == "4"


@pytest.mark.parametrize(
    ("replies", "error", "needles"),
    [
        ({"/weight_info": (404, {"detail": "Not Found"})}, EngineConfigError,
         ["VLLM_SERVER_DEV_MODE=1", "/weight_info"]),
        ({"/init_weight_transfer_engine": _vllm_500(_WORKER_FAILED.format(
            "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."))},
         EngineConfigError, ["--weight-transfer-config '{\"backend\": \"deltasync\"}'"]),
        ({"/init_weight_transfer_engine": _vllm_500(_WORKER_FAILED.format(to_text(ConfigError(
            "deltasync engine setting verify: expected one of 'incremental', 'changed', 'all', got 'x'"))))},
         ConfigError, ["deltasync engine setting verify"]),
        ({"/init_weight_transfer_engine": _vllm_500(_WORKER_FAILED.format(
            "Invalid init_info for DeltasyncWeightTransferEngine: unexpected keyword argument 'uri'"))},
         EngineConfigError, ["Invalid init_info", "'uri'"]),
        ({"/weight_info": (200, {"weight_version": 5})}, EngineError, ["expected {'weight_version': str}"]),
        ({"/weight_info": (200, b"<html>")}, EngineError, ["not JSON"]),
    ],
    ids=["no-dev-mode", "no-weight-transfer-config", "bad-init-info", "unknown-init-key", "version-not-str",
         "not-json"],
)
def test_a_server_not_set_up_is_named_before_anything_pauses(replies, error, needles, tmp_path):
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, {"w": torch.zeros(8)}) as pub:
        pub.publish(0)
    with fake_server() as (fake, base):
        fake.replies.update(replies)
        follower = Follower(url, VllmTarget(base))
        with pytest.raises(error) as e:
            follower.connect()
        follower.close()
        assert type(e.value) is error
        for needle in needles:
            assert needle in str(e.value)
        assert "/pause" not in fake.routes()


def test_a_follower_sends_the_chain_from_the_step_the_server_holds(tmp_path, monkeypatch):
    url = str(tmp_path / "stream")
    state = {"w": torch.zeros(64), "b": torch.ones(4)}
    with DeltaPublisher(url, state, anchor_every=3, on_backlog="block") as pub:
        for step in range(6):
            state["w"][step] = step + 1.0
            pub.publish(step)
    with fake_server() as (fake, base):
        seen: list[int] = []
        target = VllmTarget(base, verify="all")
        f = Follower(url, target, on_step=seen.append)  # driven from here: no thread
        assert f.connect() is None
        init = dict(fake.calls)["/init_weight_transfer_engine"]
        assert init == {"init_info": EngineSettings(url=url, verify="all").init_info()}
        assert f.sync(4) == [3, 4]  # from the nearest anchor (3): nothing the server would not need
        f.close()
        assert seen == [3, 4] and fake.version == "4"
        assert "/collective_rpc" not in fake.routes()  # only step numbers: no object crosses

        # a restarted follower asks the server: it goes on from step 4, and the server is told nothing new
        fake.calls.clear()
        f = Follower(url, VllmTarget(base, step=0))
        assert f.connect() == 4
        assert dict(fake.calls)["/init_weight_transfer_engine"]["init_info"]["step"] == 4
        assert f.wait_for(5, timeout_s=30) == 5
        f.close()
        assert [b["update_info"]["step"] for r, b in fake.calls if r == "/update_weights"] == [5]

    # a relative stream path reaches the server as an absolute one (the server has its own working directory)
    monkeypatch.chdir(tmp_path)
    with fake_server() as (fake, base):
        f = Follower("stream", VllmTarget(base))
        f.connect()
        f.close()
        assert dict(fake.calls)["/init_weight_transfer_engine"]["init_info"]["url"] == url


def test_a_follower_retries_a_failed_step_and_asks_the_server_again(tmp_path):
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, {"w": torch.zeros(8)}) as pub:
        pub.publish(0)
    with fake_server() as (fake, base):
        fake.replies["/update_weights"] = _vllm_500(_WORKER_FAILED.format(to_text(CorruptObjectError(
            "step 0: SHA-256 differs"))))
        f = Follower(url, VllmTarget(base), policy=PollPolicy(fast_s=0.05))
        with pytest.raises(Exception, match="step 0 not live within 1.0s") as e:
            f.wait_for(0, timeout_s=1.0)
        f.close()
        assert type(e.value).__name__ == "WaitTimeoutError" and type(e.value.__cause__) is CorruptObjectError
        assert fake.routes().count("/resume") == fake.routes().count("/pause") >= 2  # never left paused
        assert fake.routes().count("/weight_info") >= 2  # after a failure the server is asked which step it holds


class FakeLLM:
    """An offline ``vllm.LLM``'s weight-transfer methods, as vLLM 0.32 words their failures."""

    def __init__(self, fail: str | None = None) -> None:
        self.version, self.fail, self.calls = "default", fail, []

    def generate(self, *a: object) -> None: ...
    def collective_rpc(self, *a: object, **k: object) -> list: return []
    def get_weight_version(self) -> str: return self.version
    def init_weight_transfer_engine(self, request: dict) -> None: self.calls.append(("init", request))
    def start_weight_update(self) -> None: self.calls.append(("start", None))
    def reset_prefix_cache(self) -> None: self.calls.append(("reset", None))

    def update_weights(self, request: dict) -> None:
        self.calls.append(("update", request))
        if self.fail:
            raise RuntimeError(self.fail)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))
        self.version = weight_version or self.version


def test_an_offline_engine_is_driven_through_the_same_calls():
    llm = FakeLLM()
    client = LocalWeightTransfer(llm)
    assert client.held_step() is None
    client.init(EngineSettings(url="s3://b/run", step=3))
    assert llm.calls[0][1] == {"init_info": EngineSettings(url="s3://b/run", step=3).init_info()}
    client.update(4)
    assert [c for c, _ in llm.calls] == ["init", "start", "update", "finish", "reset"]
    assert llm.calls[2][1] == {"update_info": {"step": 4}} and client.held_step() == 4
    # an error relayed from a worker process comes back as its class, from its record
    for text, error in [(_WORKER_FAILED.format(to_text(TensorMismatchError("step 5: the step does not fit"))),
                         TensorMismatchError),
                        (_WORKER_FAILED.format(to_text(ChecksumMismatchError("rolled back to step 4"))),
                         ChecksumMismatchError),
                        ("Weight transfer not configured. Please set weight_transfer_config", EngineConfigError)]:
        llm.fail = text
        with pytest.raises(error) as e:
            client.update(5)
        assert type(e.value) is error and llm.calls[-1] == ("reset", None) and client.held_step() == 4
    llm.fail = "something else"
    with pytest.raises(RuntimeError, match="something else"):
        client.update(5)


def test_unreachable_server_and_bad_urls():
    with pytest.raises(EngineUnreachableError, match="cannot connect to the vLLM server"):
        HttpWeightTransfer(f"http://127.0.0.1:{closed_port()}").held_step()
    with pytest.raises(ConfigError, match="expected http://host:port"):
        HttpWeightTransfer("localhost:8000")


def test_engine_settings_are_checked():
    """Every setting typed and bounded where it is given (issue 19, item 12), named in the error."""
    assert EngineSettings(url="s3://b/run").verify == "incremental"
    for bad, needle in [(dict(url=""), "setting url"), (dict(url="x", verify="some"), "setting verify"),
                        (dict(url="x", mode="fast"), "setting mode"), (dict(url="x", step=-1), "setting step"),
                        (dict(url="x", step=True), "setting step"),
                        (dict(url="x", storage_options=[]), "setting storage_options"),
                        (dict(url="x", step=10**12), "setting step"),
                        (dict(url="x", prefetch="yes"), "setting prefetch"),
                        (dict(url="x", rdma={"controller": "tcp://h:1", "slots": "4"}), "slots must be a whole number"),
                        (dict(url="x", rdma={"controller": "tcp://h:1", "announce_wait_s": float("nan")}),
                         "announce_wait_s must be a number of seconds"),
                        (dict(url="x", rdma={"controller": "h:1"}), "controller must be a ZMQ address"),
                        (dict(url="x", rdma={"controller": "tcp://h:1", "colour": 1}), "fields:"),
                        (dict(url="x", rdma={"controller": "tcp://h:1", "engine": "a b"}), "setting rdma.engine"),
                        (dict(url="x", notify="mirror:8901"), "setting notify"),
                        (dict(url="x", trusted_keys=["not a key"]), "setting trusted_keys")]:
        with pytest.raises(ConfigError, match=needle):
            EngineSettings(**bad)
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['uri'\]"):
        EngineSettings.parse({"uri": "s3://b/run"})
    with pytest.raises(ConfigError, match="expected an object of engine settings"):
        EngineSettings.parse(["s3://b/run"])
    assert EngineSettings.parse(EngineSettings(url="x", rdma="tcp://h:1").init_info()) == EngineSettings(
        url="x", rdma={"controller": "tcp://h:1"})


def test_update_info_is_checked():
    pytest.importorskip("vllm")
    from rollout_loader.vllm.engine import DeltasyncUpdateInfo

    assert DeltasyncUpdateInfo(step=3).step == 3 and DeltasyncUpdateInfo().step == "latest"
    for bad in (-1, "newest", 2.0, None, True, 10**12):
        with pytest.raises(ConfigError, match="step must be a step number or 'latest'"):
            DeltasyncUpdateInfo(step=bad)


def test_a_held_step_error_from_the_server_is_one_and_stops_the_follower(tmp_path):
    """The client rebuilds the engine's HeldStepError (not retryable) from its record: a follower told the wrong
    step stops instead of retrying for ever."""
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, {"w": torch.zeros(8)}) as pub:
        pub.publish(0)
    with fake_server() as (fake, base):
        fake.replies["/init_weight_transfer_engine"] = _vllm_500(_WORKER_FAILED.format(to_text(HeldStepError(
            "init_info says the engine holds step 0, but its weights are not that step's"))))
        with Follower(url, VllmTarget(base, step=0)) as f, pytest.raises(Exception) as e:
            f.wait_for(0, timeout_s=30)
        assert type(e.value).__name__ == "FollowError" and type(e.value.__cause__) is HeldStepError


# --- issue 19, item 7: the client of a server trusts nothing it is sent ---


class Hostile(BaseHTTPRequestHandler):
    """What a wrong or hostile server sends, chosen by ``Hostile.mode``."""

    protocol_version = "HTTP/1.1"
    mode = ""
    other = ""  # another server's base URL, for the redirect

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        mode = Hostile.mode
        if mode == "redirect":
            self.send_response(307)
            self.send_header("Location", Hostile.other + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif mode == "no-content":
            self.send_response(204)
            self.end_headers()
        elif mode == "huge":
            self.send_response(200)
            self.send_header("Content-Length", str(400 << 20))
            self.end_headers()
            try:
                for _ in range(400):
                    self.wfile.write(b" " * (1 << 20))
            except OSError:
                pass
        elif mode == "drip":
            body = json.dumps({"weight_version": "3"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    import time

                    time.sleep(0.4)
            except OSError:
                pass
        else:
            body = json.dumps({"weight_version": mode}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    do_POST = do_GET


@pytest.mark.parametrize(("mode", "needle"), [
    ("redirect", "HTTP 307"),
    ("no-content", "expected HTTP 200, got 204"),
    ("huge", "the reply is over"),
    ("drip", "did not arrive whole within 2s"),
])
def test_the_client_refuses_what_a_server_should_not_send(mode, needle):
    with fake_server() as (other, other_url), serving(Hostile) as url:
        Hostile.mode, Hostile.other = mode, other_url
        client = HttpWeightTransfer(url, timeout_s=2.0, check_timeout_s=2.0)
        with pytest.raises(EngineError, match=needle):
            client.weight_version()
        assert other.calls == []  # the redirect's target heard nothing


def test_a_weight_version_of_other_digits_names_no_step():
    with serving(Hostile) as url:
        for version, step in (("²", None), ("٣", None), ("12", 12), ("1e3", None), (" 7", None), ("7\n", None)):
            Hostile.mode = version
            assert HttpWeightTransfer(url).held_step() == step


def test_an_update_the_server_does_not_name_afterwards_is_an_error():
    """A server (or something in front of it) that answers every route 200 and changes nothing is caught by
    reading the version back."""
    with fake_server() as (fake, url):
        fake.replies["/finish_weight_update"] = (200, {"message": "ok"})  # the version is never set
        with pytest.raises(EngineError, match="says it holds step None after an update to step 3"):
            HttpWeightTransfer(url).update(3)
        assert fake.routes()[-2:] == ["/reset_prefix_cache", "/resume"]


@pytest.mark.parametrize("bad", [
    {"held_step": 3, "arrived": {"v": "rdma"}, "pauses_s": [], "checksums": {}},           # a step that is no number
    # a checksum that is no number
    {"held_step": 3, "arrived": {}, "pauses_s": [], "checksums": {"w": {}}},
    {"held_step": [1], "arrived": {}, "pauses_s": [], "checksums": {}},                    # unhashable held step
    {"held_step": 1, "arrived": {}, "pauses_s": [], "checksums": {"w": 2**64}},            # past 64 bits
    {"held_step": 1, "arrived": {}, "pauses_s": ["x"], "checksums": {}},
    # a configuration key and a digest with a line break after them: "$" matched there; the heartbeat (whose
    # pattern matches whole) then refused the record, and the consumer's every heartbeat failed
    {"held_step": 1, "arrived": {}, "pauses_s": [], "checksums": {},
     "fingerprint": {"config_key": "0123456789abcdef\n"}},
    {"held_step": 1, "arrived": {}, "pauses_s": [], "checksums": {},
     "fingerprint": {"config_key": "0123456789abcdef", "digest": "0" * 64 + "\n"}},
    {"held_step": 1, "arrived": {"1\n": "rdma"}, "pauses_s": [], "checksums": {}},
], ids=["arrived-key", "checksum-type", "held-list", "checksum-64", "pause-type", "config-key-newline",
        "digest-newline", "arrived-newline"])
def test_a_status_reply_that_is_not_one_is_an_engine_error(bad):
    """Found by the input fuzzer: these raised TypeError / ValueError from inside combine_status."""
    from rollout_loader.vllm.client import combine_status

    with pytest.raises(EngineError, match="rank 0: expected a deltasync status"):
        combine_status([bad], where="http://server/collective_rpc")
    good = {"held_step": 3, "arrived": {"3": "rdma"}, "pauses_s": [0, 0.25], "checksums": {"w": 2**64 - 1}}
    assert combine_status([good, good], where="x")["checksums"] == {"w": (2 * (2**64 - 1)) % 2**64}



def test_a_long_engine_error_keeps_its_class():
    """vLLM's body around a long engine error (a message of a few thousand characters, JSON-escaped) is read whole:
    a truncated body hides the record, and a setting retrying cannot fix would come back as a retryable error."""
    with fake_server() as (fake, url):
        remote = ConfigError("deltasync engine setting verify: " + "é" * 3000)  # as vLLM sends it: 18 KB
        fake.replies["/init_weight_transfer_engine"] = _vllm_500(_WORKER_FAILED.format(to_text(remote)))
        with pytest.raises(ConfigError, match="setting verify") as e:
            HttpWeightTransfer(url).init(EngineSettings(url="s3://b/run"))
        assert not can_retry(e.value)


def test_a_framework_http_clients_error_comes_back_as_the_engine_raised_it():
    """A framework's own HTTP client (here vLLM's, subclassed as frameworks do to add headers) raises its own error
    (requests' HTTPError) whose response holds vLLM's body: the engine's class and retry answer come back, not a
    transient-looking HTTPError a follower would retry for ever."""
    pytest.importorskip("requests")
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from rollout_loader.vllm import SyncClientTransfer

    class AuthClient(HTTPVLLMWeightSyncClient):
        """What a framework writes: vLLM's client with its own headers (so deltasync cannot swap in its own)."""

    with fake_server() as (fake, url):
        for route, remote in (("/init_weight_transfer_engine", ConfigError("deltasync engine setting mode: no")),
                              ("/update_weights", CorruptObjectError("step 3: SHA-256 differs"))):
            fake.replies[route] = _vllm_500(_WORKER_FAILED.format(to_text(remote)))
        target = VllmTarget(AuthClient(url))
        assert isinstance(target.client, SyncClientTransfer)
        with pytest.raises(ConfigError, match="setting mode") as e:
            target.client.init(EngineSettings(url="s3://b/run"))
        assert not can_retry(e.value)
        with pytest.raises(CorruptObjectError, match="SHA-256 differs") as e:
            target.client.update(3)
        assert can_retry(e.value)


def test_only_vllms_own_clients_are_swapped_for_deltasyncs():
    """vLLM's ``HTTPVLLMWeightSyncClient`` is driven as the server it names (pause, read-back, prefix-cache reset);
    a framework's class that only shares its name (or subclasses it) may send what deltasync's client would not (its
    auth headers, its certificates), so it is driven through its own four methods. The same for Ray's client."""
    from rollout_loader.vllm import SyncClientTransfer

    class HTTPVLLMWeightSyncClient:  # a framework's own, with its own auth
        base_url, timeout = "http://127.0.0.1:1", (3, 30)

        def init_weight_transfer_engine(self, init_info: dict) -> None: ...
        def start_weight_update(self) -> None: ...
        def update_weights(self, update_info: dict) -> None: ...
        def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    class RayVLLMWeightSyncClient(HTTPVLLMWeightSyncClient):
        handles = None

    for lookalike in (HTTPVLLMWeightSyncClient(), RayVLLMWeightSyncClient()):
        assert isinstance(VllmTarget(lookalike).client, SyncClientTransfer)
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer import clients

    real = clients.HTTPVLLMWeightSyncClient("http://127.0.0.1:1", timeout=12)
    assert isinstance(VllmTarget(real).client, HttpWeightTransfer) and VllmTarget(real).client.timeout_s == 12
    real.timeout = (3, 30)  # requests takes a (connect, read) pair: not one number, so the default
    assert VllmTarget(real).client.timeout_s == 600.0


def test_a_status_sums_the_ranks_host_memory():
    """Each rank states the host copies it keeps (``host_bytes``); a rank of an engine that predates it states none."""
    from rollout_loader.vllm.client import combine_status

    good = {"held_step": 3, "arrived": {}, "pauses_s": [], "checksums": {}}
    assert combine_status([{**good, "host_bytes": 5}, {**good, "host_bytes": 2}, good], where="x")["host_bytes"] == 7
    with pytest.raises(EngineError, match="expected a deltasync status"):
        combine_status([{**good, "host_bytes": -1}], where="x")
