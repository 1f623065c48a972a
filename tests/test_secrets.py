"""Secrets never print (deltasync/secrets.py; issue 30 item 15): credentials in storage options and passwords in
URLs reach no error, log line, repr or stored document, on every path that carries one; and a storage option of
the wrong type is the user's mistake (exit 2), never reported as a bug (exit 3)."""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import ConfigError, StoreConfigError, StoreError
from deltasync.secrets import Secret, hidden, redact, redact_url, reveal
from deltasync.store import Store
from deltasync.transports import register_transport, unregister_transport
from deltasync.transports.memory import MemoryTransport

ROOT = Path(__file__).resolve().parent.parent
SECRET = "S3CRET-do-not-print-0123456789"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync_cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.parametrize(("option", "named"), [
    ("endpoint_url=5", "endpoint_url"), ("client_kwargs=5", "client_kwargs"), ("config_kwargs=[1]", "config_kwargs"),
    ('config_kwargs={"colour": 1}', "config_kwargs"), ('anon="yes"', "anon"), ("secret=5", "secret"),
])
def test_a_wrong_typed_storage_option_is_a_user_error(option, named):
    r = _cli("ls", "s3://bucket/run", "-S", option, "-S", "key=AKIAEXAMPLE", "-S", f"token={SECRET}",
             "-S", "endpoint_url=http://127.0.0.1:9" if named != "endpoint_url" else "anon=false")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: StoreConfigError") and named in r.stderr, r.stderr
    assert SECRET not in r.stdout + r.stderr


def test_a_secret_value_does_not_print():
    s = Secret(SECRET)
    for text in (repr(s), str(s), f"{s}", f"{s!r:>40}", repr({"secret": s}), repr([s])):
        assert SECRET not in text and "<hidden>" in text
    with pytest.raises(TypeError):
        json.dumps({"secret": s})  # never stored by accident
    assert pickle.loads(pickle.dumps(s)) == s and s.reveal() == SECRET  # a process that receives it needs it
    assert reveal({"a": [s], "b": {"c": s}}) == {"a": [SECRET], "b": {"c": SECRET}}
    assert hidden({"secret": "x", "key": "y", "token": "z", "endpoint_url": "http://u:pw@h/", "anon": True}) == {
        "secret": "<hidden>", "key": "<hidden>", "token": "<hidden>", "endpoint_url": "http://u:<hidden>@h/",
        "anon": True}
    with pytest.raises(TypeError):
        Secret(5)  # type: ignore[arg-type]


class _Talkative(MemoryTransport):
    """A backend whose errors quote its own settings (some do): every read fails, naming the secret."""

    def __init__(self, url: str, options: dict) -> None:
        super().__init__("talkative-" + url.rsplit("/", 1)[-1])
        self.secret = options["secret"]
        self.transient = options.get("transient", False)

    def get(self, key, *, start=None, end=None):  # noqa: ANN001
        if self.transient:
            raise ConnectionResetError(f"connection reset while signing with secret={self.secret}")
        raise ValueError(f"the request signed with {self.secret} was refused")


@pytest.fixture
def talkative():
    register_transport("talkative", _Talkative)
    yield
    unregister_transport("talkative")


def test_a_backend_that_quotes_a_secret_is_redacted_in_every_error_and_log(talkative, caplog):
    store = Store("talkative://x/run", storage_options={"secret": Secret(SECRET)}, retries=1, retry_base_s=0.01)
    assert isinstance(store.transport.secret, str)  # the backend was given the value
    with pytest.raises(StoreConfigError) as e:  # the backend tripped over its settings: the user's to fix
        store.read_bytes("stream.json")
    assert SECRET not in str(e.value) and "<hidden>" in str(e.value)
    store = Store("talkative://x/run", storage_options={"secret": SECRET, "transient": True}, retries=1,
                  retry_base_s=0.01)
    with caplog.at_level(logging.DEBUG), pytest.raises(StoreError) as e:
        store.read_bytes("stream.json")
    assert SECRET not in str(e.value) and SECRET not in caplog.text and "<hidden>" in caplog.text
    assert SECRET not in repr(store) and SECRET not in repr(StreamReader(store).__dict__.get("store"))


def test_a_password_in_a_url_is_never_shown(tmp_path):
    assert redact_url("https://user:pw%40x@host:1/path") == "https://user:<hidden>@host:1/path"
    assert "pw" not in redact("cannot reach http://u:pw-123456@h:1/x, and pw-123456 again")
    r = _cli("ls", f"http://admin:{SECRET}@127.0.0.1:9/stream")
    assert r.returncode == 2 and SECRET not in r.stdout + r.stderr and "<hidden>" in r.stderr, r.stderr
    from deltasync.notify import EventFeed
    from rollout_loader.vllm.client import HttpWeightTransfer

    for make in (lambda: EventFeed(f"http://u:{SECRET}@127.0.0.1:9/events"),
                 lambda: HttpWeightTransfer(f"http://u:{SECRET}@127.0.0.1:9")):
        with pytest.raises(ConfigError) as e:
            make()
        assert SECRET not in str(e.value)


def test_no_secret_reaches_a_stored_document_or_a_metric(tmp_path):
    """A follower given credentials writes heartbeats and serves metrics: neither holds them."""
    from rollout_loader import Follower, StateDictTarget

    url = str(tmp_path / "stream")
    with DeltaPublisher(url, {"w": torch.zeros(8)}) as pub:
        pub.publish(0)
    options = {"auto_mkdir": True, "password": Secret(SECRET)}
    with Follower(url, StateDictTarget(), storage_options=options, consumer_id="c0") as follower:
        follower.wait_for(0, timeout_s=30)
        from rollout_loader.metrics import FollowerStats

        text = repr(follower.status()) + repr(FollowerStats(follower.reader.url).__dict__)
    stored = b"".join(p.read_bytes() for p in Path(url).rglob("*") if p.is_file())
    assert SECRET.encode() not in stored and SECRET not in text


def test_engine_settings_take_secrets_and_send_their_values_only_to_the_engine():
    from rollout_loader.vllm.settings import EngineSettings

    settings = EngineSettings(url="s3://b/run", storage_options={"key": "AKIAEXAMPLE", "secret": Secret(SECRET)})
    assert SECRET not in repr(settings)
    assert settings.init_info()["storage_options"]["secret"] == SECRET
    json.dumps(settings.init_info())  # JSON as vLLM carries it



def test_a_debug_traceback_and_a_chained_cause_show_no_secret(talkative, monkeypatch, capsys):
    """DELTASYNC_DEBUG=1 prints the traceback, causes included: what the backend said is scrubbed there too."""
    from tests.test_cli_errors import run_main

    monkeypatch.setenv("DELTASYNC_DEBUG", "1")
    code, out, err = run_main(monkeypatch, capsys, "ls", "talkative://x/run", "-S", f"secret={SECRET}")
    assert code == 2 and "Traceback" in err and SECRET not in out + err, err
    store = Store("talkative://x/run", storage_options={"secret": SECRET})
    with pytest.raises(StoreConfigError) as e:
        store.read_bytes("stream.json")
    import traceback

    assert SECRET not in "".join(traceback.format_exception(e.value))
    assert SECRET not in repr(store.storage_options) and isinstance(store.storage_options["secret"], Secret)
