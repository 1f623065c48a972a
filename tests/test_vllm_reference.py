"""``deltasync fingerprint``'s reference maker (rollout_loader/vllm/reference.py) as a signer: a signed reference
vouches for a step's weights in one stream, so the maker reads only signed steps and signs for the pinned stream,
never for whatever ``stream.json`` a bucket writer left (docs/SECURITY.md). Both refusals come before any engine
starts; the engine itself is tested in tests/integration/test_vllm_fingerprint.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher
from deltasync.errors import ConfigError, SignatureError
from deltasync.signing import keygen
from deltasync.trust import TrustedKeys
from rollout_loader.vllm.reference import reference_for_step


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("an engine was started for a reference that cannot be signed")


@pytest.fixture
def signed(tmp_path):
    url = str(tmp_path / "stream")
    private, public = keygen(str(tmp_path / "trainer.key"))
    with DeltaPublisher(url, {"w": torch.zeros(8)}, signing_key=private, stream_id="run-7") as pub:
        pub.publish(0)
    return url, private, public


def test_signing_a_reference_needs_trusted_keys(signed):
    """Without trusted keys the replay would read whatever the bucket holds (an unsigned or forged step) and the
    signature would vouch for it: every honest follower of the stream would then undo its step."""
    url, private, _ = signed
    with pytest.raises(ConfigError, match="trusted keys"):
        reference_for_step(url, 0, signing_key=private, start=_never)
    assert not (Path(url) / "fingerprints").exists()


def test_a_reference_is_signed_for_the_pinned_stream_never_for_stream_json(signed):
    """A bucket writer rewrote ``stream.json`` to name another stream the same key signs (run-8): a reference signed
    for what it names could be copied into run-8, where followers would compare with another stream's weights."""
    url, private, public = signed
    info = Path(url) / "stream.json"
    info.write_text(json.dumps(json.loads(info.read_text()) | {"stream_id": "run-8"}))
    trust = TrustedKeys.load([public], stream_id="run-7")
    with pytest.raises(SignatureError, match="run-8.*run-7"):
        reference_for_step(url, 0, signing_key=private, trusted_keys=trust, start=_never)
    assert not (Path(url) / "fingerprints").exists()
