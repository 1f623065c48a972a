"""Least privilege on a real S3 server (SeaweedFS on loopback, per-identity credentials): the trainer writes its
stream; a follower that may only read follows a signed stream bit-exactly (its heartbeats are refused
cleanly: logged, never a crash loop), cannot commit or delete, and its secret appears in no log, error,
metric or stored document (docs/SECURITY.md)."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import StoreAuthError
from deltasync.history.gc import collect_garbage
from deltasync.signing import keygen
from deltasync.store import Store
from deltasync.trust import TrustedKeys
from rollout_loader import Follower, PollPolicy, StateDictTarget
from tests.integration.seaweedfs import _server
from tests.integration.test_cli_errors_s3 import KEY, SECRET, _require_credentials

pytestmark = pytest.mark.s3

READER_KEY, READER_SECRET = "follower-7", "follower-secret-Zq8vR2kLmN4p"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A SeaweedFS of this module's own with two identities: the trainer (read, write, list) and a follower
    (read and list only)."""
    servers = _server(tmp_path_factory.mktemp("seaweedfs-least-privilege"))
    server = next(servers)
    try:
        server.new_url()  # the bucket, while any request is still accepted
        _require_credentials(server)  # the trainer's identity: KEY/SECRET
        command = (f"s3.configure -access_key={READER_KEY} -secret_key={READER_SECRET} -user=follower "
                   "-actions=Read,List -apply")
        subprocess.run([server.binary, "shell", f"-master=127.0.0.1:{server.ports['master']}"],
                       input=f"{command}\nexit\n", capture_output=True, text=True, timeout=60, check=True)
        yield server
    finally:
        servers.close()


def _reader_options(s3) -> dict:
    return {**s3.storage_options, "key": READER_KEY, "secret": READER_SECRET}


def _wait_until_reads_work(url: str, options: dict, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with Store(url, storage_options=options) as store:
                store.steps()
                return
        except StoreAuthError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_a_read_only_follower_follows_and_can_neither_commit_nor_delete(s3, tmp_path, caplog):
    assert s3.storage_options["key"] == KEY and s3.storage_options["secret"] == SECRET
    url = s3.new_url()
    private, public = keygen(tmp_path / "trainer.key")
    state = {"w": torch.randn(128, 64), "b": torch.randn(64)}
    truth = {}
    with DeltaPublisher(url, state, storage_options=s3.storage_options, signing_key=private, anchor_every=3,
                        on_backlog="block", stream_id="run-7") as pub:
        for step in range(5):
            state["w"][step, :9] += 1.0
            pub.publish(step)
            truth[step] = {n: t.clone() for n, t in state.items()}
    options = _reader_options(s3)
    _wait_until_reads_work(url, options)

    caplog.set_level(logging.DEBUG)
    target = StateDictTarget(verify="full")
    with Follower(url, target, storage_options=options, trusted_keys=TrustedKeys.load([public], stream_id="run-7"),
                  consumer_id="rollout-7",
                  heartbeat_s=0.05, policy=PollPolicy(fast_s=0.02)) as follower:
        assert follower.wait_for(4, timeout_s=60) == 4
        time.sleep(0.5)  # several heartbeats due: each refused, logged, and the follower goes on
        assert follower.running and follower.last_error is None and follower.stopped_by is None
        status = follower.status()
    assert all(torch.equal(target.state_dict()[n], truth[4][n]) for n in state)
    refused = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert refused and all("failed" in m for m in refused)

    errors = []
    with pytest.raises(StoreAuthError) as e:  # it cannot commit
        with DeltaPublisher(url, state, storage_options=options, take_over=True) as forger:
            forger.publish(5)
    errors.append(str(e.value))
    with pytest.raises(StoreAuthError) as e:  # nor delete
        collect_garbage(url, keep_last=1, storage_options=options)
    errors.append(str(e.value))
    with StreamReader(url, storage_options=s3.storage_options) as reader:
        assert reader.steps() == [0, 1, 2, 3, 4]  # nothing was added or removed
        stream_json = reader.store.read_bytes("stream.json").decode()

    # the follower's secret is nowhere: logs, errors, metrics, stored documents
    seen = "\n".join([*(r.getMessage() for r in caplog.records), *errors, repr(status), stream_json])
    assert READER_SECRET not in seen
