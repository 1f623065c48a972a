"""One engine-settings record (rollout_loader/vllm/settings.py): every setting reaches the engine from every way in
(``VllmTarget``, ``deltasync follow``, ``init_info``), walked field by field, so a setting added to the record and
forgotten by one of them fails here. The engine's side is its real ``parse_init_info`` (vLLM installed); the
clients' side a loopback stub answering as vLLM does (tests/test_vllm_client.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import ConfigError
from deltasync.notify import EventFeed
from deltasync.trust import TrustedKeys
from rollout_loader import Follower
from rollout_loader.vllm import EngineSettings, VllmTarget
from tests.test_cli_errors import run_main
from tests.test_vllm_client import fake_server

FIELDS = [f.name for f in dataclasses.fields(EngineSettings)]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    pytest.importorskip("cryptography")
    from deltasync.signing import keygen

    folder = tmp_path_factory.mktemp("keys")
    private, public = keygen(str(folder / "trainer.key"))
    keygen(str(folder / "leaked.key"))  # a key to revoke, beside it
    return private, public


def _leaked(public) -> str:
    return str(Path(public).with_name("leaked.key.pub"))


def _values(tmp_path, public) -> dict:
    """A value other than the default for every setting, and the init_info value it must arrive as."""
    pem = open(public).read()
    return {
        "url": (str(tmp_path / "elsewhere"), str(tmp_path / "elsewhere")),
        "storage_options": ({"anon": True}, {"anon": True}),
        "verify": ("all", "all"),
        "mode": ("reload", "reload"),
        "step": (0, 0),
        "prefetch": (False, False),
        "rdma": ("tcp://127.0.0.1:5555", {"controller": "tcp://127.0.0.1:5555"}),
        "notify": ("http://127.0.0.1:1/events", "http://127.0.0.1:1/events"),
        "trusted_keys": ([public], [pem]),
        "revoked_keys": ([_leaked(public)], [open(_leaked(public)).read()]),
        "stream_id": ("run-7", "run-7"),
        "max_age_s": (600, 600.0),
        "representation": ("fp8", "fp8"),
        "max_host_bytes": (1 << 30, 1 << 30),
        "fingerprint": ("pause", "pause"),
    }


def _stream(tmp_path, private=None) -> str:
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, {"w": torch.zeros(8)}, signing_key=private, stream_id="run-7") as pub:
        pub.publish(0)
    return url


def _sent(fake) -> dict:
    return dict(fake.calls)["/init_weight_transfer_engine"]["init_info"]


def test_the_table_covers_every_setting(tmp_path, keys):
    assert sorted(_values(tmp_path, keys[1])) == sorted(FIELDS)


@pytest.mark.parametrize("name", FIELDS)
def test_every_setting_reaches_the_engine_from_vllm_target(name, tmp_path, keys):
    value, want = _values(tmp_path, keys[1])[name]
    url = _stream(tmp_path, keys[0])
    with fake_server() as (fake, base):
        f = Follower(url, VllmTarget(base, **{name: value}))
        f.connect()
        f.close()
        sent = _sent(fake)
    assert sent[name] == want
    assert set(sent) == set(FIELDS)  # the whole record, every time
    # and as one record: the same through settings=
    with fake_server() as (fake, base):
        f = Follower(url, VllmTarget(base, EngineSettings(**{name: value})))
        f.connect()
        f.close()
        assert _sent(fake)[name] == want


def test_the_store_its_options_keys_and_feed_come_from_the_follower(tmp_path, keys):
    """Given once, to the follower: the engine is sent its reader's URL, storage options and trusted keys, and its
    event feed."""
    url = _stream(tmp_path, keys[0])
    with fake_server() as (fake, base):
        feed = EventFeed("http://127.0.0.1:1/events")
        f = Follower(url, VllmTarget(base), storage_options={"auto_mkdir": True},
                     trusted_keys=TrustedKeys.load([keys[1]], stream_id="run-7", max_age_s=600), notifier=feed)
        f.connect()
        f.close()
        feed.close()
        sent = _sent(fake)
    assert sent["url"] == url and sent["storage_options"] == {"auto_mkdir": True}
    assert sent["trusted_keys"] == [open(keys[1]).read()] and sent["notify"] == "http://127.0.0.1:1/events"
    assert sent["stream_id"] == "run-7" and sent["max_age_s"] == 600.0  # the pin and the freshness, with the keys


# how `deltasync follow` sets each setting; url/storage_options/trusted_keys/revoked_keys/notify reach the engine
# through the follower (the stream argument, -S, --trusted-key, --revoked-key, --notify)
CLI = {
    "url": lambda v: [],
    "storage_options": lambda v: ["-S", "auto_mkdir=true"],
    "verify": lambda v: ["--verify", v],
    "mode": lambda v: ["--mode", v],
    "step": lambda v: ["--engine-step", str(v)],
    "prefetch": lambda v: ["--no-prefetch"],
    "rdma": lambda v: ["--rdma", v],
    "notify": lambda v: ["--notify", v],
    "trusted_keys": lambda v: ["--trusted-key", v[0], "--stream-id", "run-7"],
    "revoked_keys": lambda v: ["--trusted-key", str(Path(v[0]).with_name("trainer.key.pub")), "--stream-id", "run-7",
                               "--revoked-key", v[0]],
    "stream_id": lambda v: ["--trusted-key", KEY_FILE[0], "--stream-id", v],
    "max_age_s": lambda v: ["--trusted-key", KEY_FILE[0], "--stream-id", "run-7", "--max-age-s", str(v)],
    "representation": lambda v: ["--representation", v],
    "max_host_bytes": lambda v: ["--max-host-bytes", str(v)],
    "fingerprint": lambda v: ["--fingerprint", v],
}
KEY_FILE: list[str] = []  # the trusted key's file, for the flags that need one beside them


@pytest.mark.parametrize("name", FIELDS)
def test_every_setting_reaches_the_engine_from_the_command_line(name, tmp_path, keys, monkeypatch, capsys):
    assert sorted(CLI) == sorted(FIELDS)
    KEY_FILE[:] = [str(keys[1])]
    value, want = _values(tmp_path, keys[1])[name]
    url = _stream(tmp_path, keys[0])
    with fake_server() as (fake, base):
        code, _, err = run_main(monkeypatch, capsys, "follow", url, "--server", base, "--until", "0", "--timeout-s",
                                "20", *CLI[name](value))
        sent = _sent(fake)
    assert code == 0, err
    if name == "url":
        assert sent["url"] == url  # the stream argument
    elif name == "storage_options":
        assert sent["storage_options"] == {"auto_mkdir": True}  # -S values are parsed as JSON where they can be
    else:
        assert sent[name] == want


@pytest.mark.parametrize("name", FIELDS)
def test_every_setting_is_taken_by_the_engine_as_sent(name, tmp_path, keys):
    """The engine's own parse (its real class, vLLM installed) takes every field of the record, unchanged."""
    pytest.importorskip("vllm")
    from rollout_loader.vllm.engine import DeltasyncWeightTransferEngine

    value, _ = _values(tmp_path, keys[1])[name]
    settings = EngineSettings(url="s3://b/run", **{name: value}) if name != "url" else EngineSettings(url=value)
    parsed = DeltasyncWeightTransferEngine.parse_init_info(None, settings.init_info())  # type: ignore[arg-type]
    assert parsed == settings and DeltasyncWeightTransferEngine.init_info_cls is EngineSettings


def test_a_bad_or_unknown_setting_is_named_everywhere(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['verfy'\]"):
        VllmTarget("http://127.0.0.1:1", verfy="all")
    with pytest.raises(ConfigError, match="setting verify"):
        VllmTarget("http://127.0.0.1:1", verify="some")
    with pytest.raises(ConfigError, match="setting representation: expected one of 'checkpoint', 'fp8', got 'bf16'"):
        VllmTarget("http://127.0.0.1:1", representation="bf16")
    for bad in (-1, 1.5, True, "1GiB"):
        with pytest.raises(ConfigError, match=r"setting max_host_bytes: expected a number of bytes \(an integer"):
            EngineSettings(url="s3://b/run", max_host_bytes=bad)
    with pytest.raises(ConfigError, match="settings must be an EngineSettings"):
        VllmTarget("http://127.0.0.1:1", {"verify": "all"})
    url = _stream(tmp_path)
    code, _, err = run_main(monkeypatch, capsys, "follow", url, "--server", "http://127.0.0.1:1", "--rdma", "{bad")
    assert code == 2 and "--rdma" in err
    code, _, err = run_main(monkeypatch, capsys, "follow", url, "--server", "http://127.0.0.1:1", "--rdma", "h:1")
    assert code == 2 and "controller must be a ZMQ address" in err


def test_no_secret_in_a_repr_or_an_error():
    """Credentials and the RDMA secret never print (issue 30, item 15): a repr lands in logs, an error on a screen."""
    secret, key = "S3CRET-" + "s" * 40, "AKIA-EXAMPLE-KEY"
    settings = EngineSettings(url="s3://b/run", storage_options={"key": key, "secret": secret, "token": secret},
                              rdma={"controller": "tcp://127.0.0.1:5555", "secret": secret})
    assert secret not in repr(settings) and key not in repr(settings) and "<hidden>" in repr(settings)
    assert settings.init_info()["storage_options"]["secret"] == secret  # what the engine needs still travels
    for bad in (dict(rdma={"controller": "h:1", "secret": secret}), dict(rdma={"secret": secret}),
                dict(rdma={"controller": "tcp://h:1", "secret": secret, "slots": "4"}),
                dict(storage_options=[("secret", secret)]), dict(rdma={"controller": "tcp://h:1", "secret": "short"})):
        with pytest.raises(ConfigError) as e:
            EngineSettings(url="s3://b/run", **bad)
        assert secret not in str(e.value) and "short" not in str(e.value), str(e.value)


def test_an_engine_reads_no_key_file_a_client_names(tmp_path, keys):
    """``init_info`` comes from whoever reaches the engine: its trusted keys are PEM text. A path would make the
    engine read a file of the client's choosing (``/dev/zero`` never ends, a pipe never answers, and which files
    exist shows in the error). Settings made in this process (the constructor, a trainer's config) still read key
    files, and send their PEM text."""
    pem = open(keys[1]).read()
    for given in ([str(keys[1])], str(keys[1]), ["/dev/zero"], [pem, str(keys[1])], [b"-----BEGIN PUBLIC KEY-----"]):
        with pytest.raises(ConfigError, match="setting trusted_keys: expected public keys as PEM text"):
            EngineSettings.parse({"url": "s3://b/run", "trusted_keys": given})
    assert EngineSettings.parse({"url": "s3://b/run", "trusted_keys": [pem]}).trusted_keys == (pem,)
    assert EngineSettings.parse({"url": "s3://b/run", "trusted_keys": [str(keys[1])]},
                                key_files=True).trusted_keys == (pem,)
    assert EngineSettings(url="s3://b/run", trusted_keys=[keys[1]]).init_info()["trusted_keys"] == [pem]
    with pytest.raises(ConfigError, match="need the id of the stream they sign for"):  # a pin beside them
        EngineSettings(url="s3://b/run", trusted_keys=[keys[1]]).trusted()
    pytest.importorskip("vllm")
    from rollout_loader.vllm.engine import DeltasyncWeightTransferEngine
    from rollout_loader.vllm.trainer import DeltasyncTrainerInitInfo

    with pytest.raises(ConfigError, match="reads no key file a client names"):
        DeltasyncWeightTransferEngine.parse_init_info(None, {"url": "s3://b/run", "trusted_keys": [str(keys[1])]})  # type: ignore[arg-type]
    info = DeltasyncTrainerInitInfo(url="s3://b/run", rank=0, engine={"trusted_keys": [str(keys[1])]})
    assert info.engine.init_info()["trusted_keys"] == [pem]  # type: ignore[union-attr]


def test_settings_of_any_size_shape_or_type_are_a_config_error_naming_them():
    """What a client sends (or a framework's config holds) may be anything: a value that is no JSON, nested past any
    sense, or a flood of unknown names is a ``ConfigError`` naming the setting, in a message of bounded size."""
    deep: object = "leaf"
    for _ in range(100_000):
        deep = {"a": deep}
    for fields, name in ((dict(storage_options={"client_kwargs": {"config": object()}}), "storage_options"),
                         (dict(storage_options={"x": b"bytes"}), "storage_options"),
                         (dict(storage_options={"x": deep}), "storage_options"),
                         (dict(verify=[deep]), "verify"),
                         (dict(mode="x" * (10 << 20)), "mode")):
        with pytest.raises(ConfigError, match=f"setting {name}: expected") as e:
            EngineSettings(url="s3://b/run", **fields)
        assert len(str(e.value)) < 1000
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) .* and 99990 more") as e:
        EngineSettings.parse({f"k{i}" + "x" * 1000: 1 for i in range(100_000)})
    assert len(str(e.value)) < 2000


def test_the_engine_refuses_what_the_follower_revoked(tmp_path):
    """A leaked key is revoked (docs/SECURITY.md): the follower refuses its steps, and the engine, which reads and
    checks every step itself, must refuse them too, or a step swapped in the store after the follower checked it
    would be applied. Here A endorsed B from step 2, then B leaked: revoked at the follower, whose engine settings
    carry the revocation, and the engine's reader (built from them as the engine builds it) refuses B's steps."""
    from deltasync.errors import UntrustedKeyError
    from deltasync.signing import keygen

    a = keygen(str(tmp_path / "a.key"))
    b = keygen(str(tmp_path / "b.key"), endorsed_by=a[0], from_step=2)
    url = str(tmp_path / "stream")
    state = {"w": torch.zeros(8)}
    for key, steps in ((a[0], (0, 1)), (b[0], (2, 3))):
        with DeltaPublisher(url, state, signing_key=key, on_backlog="block", stream_id="run-7") as pub:
            for step in steps:
                state["w"][step] += 1
                pub.publish(step)
    trust = TrustedKeys.load([a[1]], revoked=[b[1]], stream_id="run-7")
    with fake_server() as (fake, base):
        follower = Follower(url, VllmTarget(base), trusted_keys=trust)
        try:
            with pytest.raises(UntrustedKeyError, match="revoked"):
                follower.reader.manifest(2)
            follower.connect()
            sent = _sent(fake)
        finally:
            follower.close()
    assert sent["revoked_keys"] == [open(b[1]).read()] and sent["trusted_keys"] == [open(a[1]).read()]
    assert sent["stream_id"] == "run-7"
    engine_side = EngineSettings.parse(sent)
    with StreamReader(url, trusted_keys=engine_side.trusted()) as reader:
        reader.manifest(1)
        with pytest.raises(UntrustedKeyError, match="revoked"):
            reader.manifest(2)
    with pytest.raises(ConfigError, match="setting revoked_keys: expected trusted_keys beside it"):
        EngineSettings(url=url, revoked_keys=[b[1]]).trusted()


def test_a_signing_trainers_engines_are_sent_its_trust(tmp_path, keys):
    """A trainer that signs (TRL, verl, the vLLM trainer engine: TrainerSync) points its engines at the stream
    with its own trust: its key, pinned to its stream, so they apply nothing a bucket writer forged."""
    from deltasync import PublishOptions
    from rollout_loader.vllm.trainer_sync import TrainerSync

    url = str(tmp_path / "stream")
    with fake_server() as (fake, base):
        sync = TrainerSync(url, source={"w": torch.zeros(8)}, target=VllmTarget(base), served_dtype=False,
                           options=PublishOptions(signing_key=keys[0], stream_id="run-7"))
        try:
            sync.open()
            sent = _sent(fake)
        finally:
            sync.close()
    assert sent["stream_id"] == "run-7" and sent["trusted_keys"] == [open(keys[1]).read()]


def test_a_follower_made_from_a_reader_gives_the_engine_its_credentials(tmp_path, keys):
    """Issue 32 item 6: the reader is the store's one value (URL, options, keys); a follower made from it, not from a
    URL, sends the engine the same credentials (revealed only into init_info: the settings' repr hides them)."""
    url = _stream(tmp_path, keys[0])
    secret = "s3cr3t-" + "x" * 24
    options = {"key": "AKIA-test", "secret": secret, "auto_mkdir": True}
    with fake_server() as (fake, base):
        reader = StreamReader(url, storage_options=options,
                              trusted_keys=TrustedKeys.load([keys[1]], stream_id="run-7"))
        f = Follower(reader, VllmTarget(base))
        f.connect()
        settings = f.target.engine_settings(reader)
        f.close()
        reader.close()
        sent = _sent(fake)
    assert sent["url"] == url and sent["storage_options"] == options
    assert sent["trusted_keys"] == [open(keys[1]).read()] and sent["stream_id"] == "run-7"
    assert secret not in repr(settings) and secret not in repr(reader.store)
