"""Signed streams (docs/FORMAT.md section 5e): a signed stream is followed bit-exactly; an attacker who can write
the store but holds no trusted key cannot get a step applied, whatever they write; keys rotate; the CLI says
what it checked. The reference for the weights is the trainer's own state at each step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import ConfigError, SignatureError, UnsignedStepError, UntrustedKeyError
from deltasync.signing import SIGNATURE, keygen
from deltasync.trust import TrustedKeys
from rollout_loader import Follower, PollPolicy, StateDictTarget

ROOT = Path(__file__).resolve().parent.parent
STREAM = "run-7"  # the stream id the trainers here are told, and followers pin beside the key


def trust(*keys: Path, stream_id: str = STREAM, **kw) -> TrustedKeys:
    return TrustedKeys.load(list(keys), stream_id=stream_id, **kw)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def _train(state: dict[str, torch.Tensor], step: int) -> None:
    state["w"][step % 64, : 5 + step] += 0.5
    state["b"][step % 32] -= 1.0


def _publish(url: str, key: Path | None, steps: range, state: dict[str, torch.Tensor], **kw) -> dict[int, dict]:
    truth = {}
    kw.setdefault("stream_id", STREAM)
    kw.setdefault("anchor_every", 4)
    with DeltaPublisher(url, state, signing_key=key, on_backlog="block", **kw) as pub:
        for s in steps:
            if s:
                _train(state, s)
            pub.publish(s)
            truth[s] = {n: t.clone() for n, t in state.items()}
    return truth


def _step_dir(stream: Path, step: int) -> Path:
    return stream / "steps" / f"{step:012d}"


@pytest.fixture
def keys(tmp_path):
    return keygen(tmp_path / "trainer.key")


@pytest.fixture
def signed(tmp_path, keys):
    stream = tmp_path / "stream"
    state = _state()
    truth = _publish(str(stream), keys[0], range(6), state)
    return stream, truth, state


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_signed_stream_is_followed_bit_exactly(signed, keys):
    stream, truth, _ = signed
    for s in range(6):
        assert (_step_dir(stream, s) / SIGNATURE).exists()
    target = StateDictTarget(verify="full")
    with Follower(str(stream), target, trusted_keys=trust(keys[1])) as follower:
        assert follower.wait_for(5, timeout_s=30) == 5
    assert _same(target.state_dict(), truth[5])
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        assert _same(reader.state_dict(2), truth[2])


def _refused_at(stream: Path, pub: Path, step: int, error: type, match: str) -> None:
    """A follower that holds step 5 refuses ``step``, names why, and keeps step 5's weights."""
    target = StateDictTarget(verify="full")
    follower = Follower(str(stream), target, trusted_keys=trust(pub))
    try:
        follower.sync(5)
        held = {n: t.clone() for n, t in target.state_dict().items()}
        with pytest.raises(error, match=match):
            follower.sync(step)
        assert target.step == 5 and _same(target.state_dict(), held)
    finally:
        follower.close()


def test_a_step_forged_by_someone_with_write_access_is_refused(signed, keys, tmp_path):
    stream, _, state = signed
    # no key: correct checksums, every object sound, but nobody trusted signed it
    _publish(str(stream), None, range(6, 7), state, take_over=True)
    _refused_at(stream, keys[1], 6, UnsignedStepError, "step 6 is not signed")
    # signed by the attacker's own key, which they also leave in the store: keys are never read from the store
    evil = keygen(tmp_path / "evil.key")
    shutil.copy(evil[1], stream / "trainer.key.pub")
    _publish(str(stream), evil[0], range(7, 8), state, take_over=True)
    _refused_at(stream, keys[1], 7, UntrustedKeyError, "step 7 is signed by key [0-9a-f]{16}, which is not trusted")


def test_an_old_signed_step_replayed_under_a_new_number_is_refused(signed, keys):
    stream, _, _ = signed
    old, new = _step_dir(stream, 5), _step_dir(stream, 9)
    shutil.copytree(old, new)  # the attacker copies step 5 (a delta on 4) to step 9 and fixes the manifest's number
    manifest = json.loads((new / "manifest.json").read_text())
    manifest.update(step=9, base_step=5)
    (new / "manifest.json").write_text(json.dumps(manifest))
    _refused_at(stream, keys[1], 9, SignatureError, r"signed, but for other contents: .*base_step=4 where the stream "
                                                     r"has 5; .*step=5 where the stream has 9")


def test_a_deleted_signature_or_a_signature_over_other_bytes_is_refused(signed, keys):
    stream, _, _ = signed
    (_step_dir(stream, 3) / SIGNATURE).unlink()
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        with pytest.raises(UnsignedStepError, match="step 3 is not signed"):
            reader.manifest(3)
    doc = json.loads((_step_dir(stream, 4) / SIGNATURE).read_text())
    doc["statement"] = doc["statement"].replace('"step":4', '"step":40')
    (_step_dir(stream, 4) / SIGNATURE).write_text(json.dumps(doc))
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        with pytest.raises(SignatureError, match="does not verify over its statement"):
            reader.manifest(4)


def test_a_latest_pointing_back_never_moves_a_follower_back(signed, keys):
    stream, truth, _ = signed
    target = StateDictTarget(verify="full")
    with Follower(str(stream), target, trusted_keys=trust(keys[1]), policy=PollPolicy(fast_s=0.01)) as follower:
        follower.wait_for(5, timeout_s=30)
        (stream / "latest.json").write_text(json.dumps({"step": 1}))  # validly signed step 1, older
        follower.watch.distrust()
        follower.sync()
        assert target.step == 5 and _same(target.state_dict(), truth[5])


def test_keys_rotate_mid_stream_and_the_old_key_retires(tmp_path, keys):
    stream = tmp_path / "stream"
    state = _state()
    truth = _publish(str(stream), keys[0], range(4), state)
    new = keygen(tmp_path / "next.key", endorsed_by=keys[0], from_step=4)
    truth |= _publish(str(stream), new[0], range(4, 8), state)
    target = StateDictTarget(verify="full")
    follower = Follower(str(stream), target, trusted_keys=trust(keys[1]))  # followers know only the first key
    try:
        for s in range(8):  # step by step: history verifies against the key of its time
            follower.sync(s)
            assert _same(target.state_dict(), truth[s])
        # the retired key signs a step past the hand-over (a leaked old key): refused once the hand-over was seen
        _publish(str(stream), keys[0], range(8, 9), state, take_over=True)
        with pytest.raises(UntrustedKeyError, match="handed signing over to another key from step 4"):
            follower.sync(8)
        assert target.step == 7
    finally:
        follower.close()
    with StreamReader(str(stream), trusted_keys=trust(keys[1]), ) as reader:  # a fresh reader replays old history
        assert _same(reader.state_dict(2), truth[2])


def test_revoked_keys_sign_nothing(signed, keys):
    stream, _, _ = signed
    revoked = TrustedKeys.load([keys[1]], revoked=[keys[1]], stream_id=STREAM)
    with StreamReader(str(stream), trusted_keys=revoked) as reader:
        with pytest.raises(UntrustedKeyError, match="revoked"):
            reader.manifest(0)


def test_key_files_are_guarded(tmp_path, keys):
    private, public = keys
    assert private.stat().st_mode & 0o777 == 0o600 and public.exists()
    with pytest.raises(ConfigError, match="never overwritten"):
        keygen(private)
    os.chmod(private, 0o644)
    with pytest.raises(ConfigError, match="mode 0644 lets others read it; chmod 600"):
        DeltaPublisher(str(tmp_path / "s"), _state(), signing_key=private)
    assert not (tmp_path / "s").exists()  # checked before anything is written
    with pytest.raises(ConfigError, match="not a PEM public key"):  # the private half given by mistake
        Follower(str(tmp_path), StateDictTarget(), trusted_keys=trust(private))


def test_a_mirror_copies_signatures_and_its_followers_check_them(signed, keys, tmp_path):
    from deltasync.history.mirror import mirror

    stream, truth, _ = signed
    copy = tmp_path / "copy"
    report = mirror(str(stream), str(copy), trusted_keys=trust(keys[1]))
    assert report.copied == (0, 1, 2, 3, 4, 5)
    with StreamReader(str(copy), trusted_keys=trust(keys[1])) as reader:
        assert _same(reader.state_dict(5), truth[5])
    (_step_dir(stream, 5) / SIGNATURE).unlink()  # a mirror that checks origin copies nothing unsigned
    shutil.rmtree(copy)
    report = mirror(str(stream), str(copy), trusted_keys=trust(keys[1]))
    assert report.copied == (0, 1, 2, 3, 4) and report.refused == (5,)
    assert not _step_dir(copy, 5).exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync_cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_cli_makes_keys_and_verify_says_what_it_checked(tmp_path):
    r = _cli("keygen", str(tmp_path / "k"))
    assert r.returncode == 0 and "mode 0600" in r.stdout, r.stderr
    stream = tmp_path / "stream"
    _publish(str(stream), tmp_path / "k", range(3), _state())
    r = _cli("verify", str(stream))
    assert r.returncode == 0 and "origin unchecked" in r.stdout, r.stdout + r.stderr
    r = _cli("verify", str(stream), "--trusted-key", str(tmp_path / "k.pub"), "--stream-id", STREAM)
    assert r.returncode == 0 and "every step signed by a trusted key for stream run-7" in r.stdout, r.stdout + r.stderr
    assert "a head signed" in r.stdout and "names step 2 the newest, closed by its publisher" in r.stdout, r.stdout
    (_step_dir(stream, 2) / SIGNATURE).unlink()
    r = _cli("verify", str(stream), "--trusted-key", str(tmp_path / "k.pub"), "--stream-id", STREAM)
    assert r.returncode == 1 and "step 2: signature: " in r.stdout and "not signed" in r.stdout, r.stdout + r.stderr
    r = _cli("replay", str(stream), "--step", "2", "-o", str(tmp_path / "out"), "--trusted-key",
             str(tmp_path / "k.pub"), "--stream-id", STREAM)
    assert r.returncode == 2 and r.stderr.startswith("error: UnsignedStepError"), r.stderr
    assert not (tmp_path / "out").exists()


def test_an_exported_checkpoint_is_signed_for_openssf_model_signing(signed, tmp_path):
    """``replay --sign`` with an ECDSA key: the OpenSSF ``model_signing`` command (another project's tool)
    verifies the folder, and refuses it once a byte of the weights changed."""
    stream, truth, _ = signed
    r = _cli("keygen", "--ecdsa", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "step-5"
    r = _cli("replay", str(stream), "--step", "5", "-o", str(out), "--sign", str(tmp_path / "export"))
    assert r.returncode == 0, r.stdout + r.stderr
    tool = [str(Path(sys.executable).parent / "model_signing"), "verify", "key", str(out), "--signature",
            str(out / "model.sig"), "--public_key", str(tmp_path / "export.pub")]
    r = subprocess.run(tool, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    from safetensors.torch import load_file

    assert _same(load_file(out / "model.safetensors"), truth[5])
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (out / "model.safetensors").write_bytes(bytes(data))
    r = subprocess.run(tool, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "mismatch" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr


def test_a_pushed_checkpoint_is_signed_like_a_published_step(signed, keys, tmp_path):
    from safetensors.torch import save_file

    from deltasync.history.push import push_checkpoint

    stream, truth, _ = signed
    new = {n: t.clone() for n, t in truth[5].items()}
    new["w"][0, :4] += 3.0
    save_file(new, tmp_path / "ckpt.safetensors")
    push_checkpoint(str(stream), 6, tmp_path / "ckpt.safetensors", signing_key=keys[0])
    with StreamReader(str(stream), trusted_keys=trust(keys[1])) as reader:
        assert _same(reader.state_dict(6), new)


def test_signature_json_is_what_format_md_says(signed, keys):
    """An independent reading of docs/FORMAT.md section 5e, not TrustedKeys: the statement is the sorted,
    space-free JSON naming the stream, the step, its base, kind, state checksum, every stored object's SHA-256,
    the SHA-256 of manifest.json and of files.json as stored (null: none), and the Ed25519 signature over its bytes
    verifies with the trainer's public key, read with cryptography directly. tests/test_reference_trust.py reads
    whole streams this way."""
    import base64
    import hashlib

    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    stream, _, _ = signed
    public = load_pem_public_key(keys[1].read_bytes())
    stream_id = json.loads((stream / "stream.json").read_text())["stream_id"]
    assert stream_id == STREAM
    for step in (0, 4, 5):  # anchors carry their own delta (section 5): it is a stored object too
        raw = (_step_dir(stream, step) / "manifest.json").read_bytes()
        m = json.loads(raw)
        # written by this version: format version 3, BLAKE3 (section 1b), signed by a step/3 statement whose every
        # digest names its algorithm
        assert (m["format_version"], m["digest"]) == (3, "blake3") and "object_sha256" not in m
        objects = {m["object"]: m["object_digest"]}
        if m.get("delta"):
            objects[m["delta"]["object"]] = m["delta"]["object_digest"]
        assert all(d.startswith("blake3:") and len(d) == 7 + 64 for d in objects.values())
        want = json.dumps({"type": "deltasync.step/3", "stream_id": stream_id, "step": step, "digest": "blake3",
                           "base_step": m["base_step"], "kind": m["kind"], "state_checksum": m["state_checksum"],
                           "objects": objects, "manifest": "sha256:" + hashlib.sha256(raw).hexdigest(),
                           "files": None},
                          sort_keys=True, separators=(",", ":"))
        doc = json.loads((_step_dir(stream, step) / SIGNATURE).read_text())
        assert (doc["format_version"], doc["algorithm"]) == (1, "ed25519")
        assert doc["statement"] == want
        assert base64.b64decode(doc["public_key"]) == public.public_bytes_raw()
        public.verify(base64.b64decode(doc["signature"]), want.encode())  # raises if it does not verify
    assert json.loads((_step_dir(stream, 4) / "manifest.json").read_text()).get("delta")  # the case was covered
