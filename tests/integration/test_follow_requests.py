"""What a follower costs a real S3 server (SeaweedFS on loopback), counted request by request at a proxy in
front of it: an idle poll is one GET of ``latest.json`` and nothing else; a new step adds only what applying
it needs; a throttling store (503 SlowDown) slows the poller down instead of being hammered, and the follower
still ends bit-exact."""

from __future__ import annotations

import time

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.signing import keygen
from deltasync.trust import TrustedKeys
from rollout_loader import Follower, PollPolicy, StateDictTarget
from tests.conftest import states_equal
from tests.integration.counting_proxy import Request, counting_proxy
from tests.integration.seaweedfs import s3_server  # noqa: F401 - fixture

pytestmark = pytest.mark.s3


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(50_000, generator=g).bfloat16(), "b": torch.randn(64, generator=g).bfloat16()}


def _through(options: dict, proxy_url: str) -> dict:
    return {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": proxy_url}}


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_an_idle_follower_makes_one_request_per_poll(s3_server, signed, tmp_path):  # noqa: F811
    """Signed (docs/FORMAT.md 5e): the idle poll is the same single GET; a new step adds one GET of its
    signature, and stream.json is read once, at the start."""
    url = s3_server.new_url()
    opts = s3_server.storage_options
    private, public = keygen(tmp_path / "trainer.key") if signed else (None, None)
    with DeltaPublisher(url, _state(0), on_backlog="block", storage_options=opts, signing_key=private,
                        stream_id="run-7") as pub:
        for s in range(3):
            pub.source = _state(s)
            pub.publish(s)
    with counting_proxy(opts["client_kwargs"]["endpoint_url"]) as proxy:
        target = StateDictTarget()
        follower = Follower(url, target, policy=PollPolicy(fast_s=0.05, idle_max_s=0.4),
                            storage_options=_through(opts, proxy.url),
                            trusted_keys=TrustedKeys.load([public], stream_id="run-7") if signed else None)
        follower.start()
        try:
            follower.wait_for(2, timeout_s=60)
            time.sleep(0.5)  # the first poll's listing and the chain are done
            proxy.take()
            polls = follower.watch.polls
            time.sleep(4.0)  # idle
            idle = proxy.take()
            idle_polls = follower.watch.polls - polls
            assert idle_polls >= 5  # it did poll, backing off from 0.05 s towards 0.4 s
            counts = proxy.count(idle)
            # every request of the idle path is one GET of latest.json: no HEAD, no LIST, no manifest
            assert set(counts) == {("GET", "latest.json")}, counts
            # one request per poll. The proxy and the poll counter are read one after the other, not at once,
            # and a poll counts itself just before its request: the poll in flight at the first edge can reach
            # the proxy's count but not the counter's, the one at the second edge the counter's but not the
            # proxy's (polls run one at a time): at most one apart, whatever the load
            assert idle_polls - 1 <= len(idle) <= idle_polls + 1, (len(idle), idle_polls)

            # a new step: noticed with one read of latest.json, then only its manifest and its object. The
            # trainer talks to S3 directly, so the proxy counts the follower alone from the last take() on,
            # however early it sees the step (a take() after the commit raced with that)
            with DeltaPublisher(url, _state(2), on_backlog="block", storage_options=opts,
                                signing_key=private) as pub:  # a restarted trainer
                pub.source = _state(3)
                pub.publish(3)
            follower.wait_for(3, timeout_s=60)
            applied = proxy.count(proxy.take())
            assert ("GET", "LIST") not in applied and ("HEAD", "LIST") not in applied, applied
            assert applied[("GET", "manifest.json")] == 1, applied
            assert applied.get(("GET", "signature.json"), 0) == (1 if signed else 0), applied
            assert ("GET", "stream.json") not in applied, applied  # the stream id was read once, at the start
            assert states_equal(target.state_dict(), _state(3))
        finally:
            follower.close()


def test_a_throttling_store_is_not_hammered_and_the_follower_ends_exact(s3_server):  # noqa: F811
    url = s3_server.new_url()
    opts = s3_server.storage_options
    with DeltaPublisher(url, _state(0), on_backlog="block", storage_options=opts) as pub:
        pub.publish(0)
    slow_down = (503, {"Content-Type": "application/xml", "Retry-After": "1"},
                 b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                 b"<Message>Please reduce your request rate.</Message></Error>")
    with counting_proxy(opts["client_kwargs"]["endpoint_url"]) as proxy:
        target = StateDictTarget()
        follower = Follower(url, target, policy=PollPolicy(fast_s=0.05, idle_max_s=0.2),
                            storage_options=_through(opts, proxy.url))
        follower.sync()
        proxy.take()
        throttled = {"on": True}
        proxy.fail = lambda r: slow_down if throttled["on"] and r.path.endswith("latest.json") else None
        follower.start()
        time.sleep(4.0)
        during = proxy.take()
        if not 1 <= len(during) <= 8:
            follower.close()
        # with Retry-After: 1 the poller waits about a second between tries (polling at 0.05-0.2 s it
        # would have made 20 or more), each try one request (botocore's and s3fs's own retries are off)
        assert 1 <= len(during) <= 8, proxy.count(during)
        assert set(proxy.count(during)) == {("GET", "latest.json")}  # each a refused poll, nothing else
        throttled["on"] = False
        with DeltaPublisher(url, _state(0), on_backlog="block", storage_options=opts) as pub:
            pub.source = _state(1)
            pub.publish(1)
        follower.wait_for(1, timeout_s=60)
        assert states_equal(target.state_dict(), _state(1))
        follower.close()
    assert StreamReader(url, storage_options=opts).latest_step() == 1


def test_requests_are_counted_by_kind() -> None:
    """The proxy's own bookkeeping, so the counts above mean what they say."""
    from tests.integration.counting_proxy import CountingProxy

    p = CountingProxy(url="")
    reqs = [Request("GET", "/bucket", "list-type=2&prefix=run/steps/"), Request("GET", "/bucket/run/latest.json", ""),
            Request("HEAD", "/bucket/run/steps/000000000001/manifest.json", "")]
    assert p.count(reqs) == {("GET", "LIST"): 1, ("GET", "latest.json"): 1, ("HEAD", "manifest.json"): 1}


def test_a_mirror_of_a_signed_stream_reads_each_step_once_and_idles_on_one_request(s3_server, tmp_path):  # noqa: F811
    """What a mirror costs its source: an idle poll is one GET of latest.json; a step copied is its manifest,
    its signature (checked with the trusted key, copied with the step) and its object, one GET each."""
    import threading

    from deltasync.history.mirror import mirror_follow

    url = s3_server.new_url()
    opts = s3_server.storage_options
    private, public = keygen(tmp_path / "trainer.key")
    with DeltaPublisher(url, _state(0), on_backlog="block", storage_options=opts, signing_key=private,
                        stream_id="run-7") as pub:
        for s in range(3):
            pub.source = _state(s)
            pub.publish(s)
    copy = str(tmp_path / "copy")

    def copied(step: int) -> bool:
        try:
            return step in StreamReader(copy).steps()
        except Exception:  # noqa: BLE001 - not created yet
            return False

    with counting_proxy(opts["client_kwargs"]["endpoint_url"]) as proxy:
        stop = threading.Event()
        thread = threading.Thread(target=mirror_follow, args=(url, copy), daemon=True, kwargs=dict(
            src_options=_through(opts, proxy.url), policy=PollPolicy(fast_s=0.05, idle_max_s=0.4), stop=stop,
            trusted_keys=TrustedKeys.load([public], stream_id="run-7")))
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while not copied(2):
                assert time.monotonic() < deadline and thread.is_alive()
                time.sleep(0.05)
            time.sleep(0.5)
            proxy.take()
            time.sleep(3.0)  # idle
            idle = proxy.count(proxy.take())
            assert set(idle) == {("GET", "latest.json")} and idle[("GET", "latest.json")] >= 5, idle
            # the publisher talks to S3 directly: from here the proxy counts the mirror's requests alone, the
            # step's included however early the mirror sees it (a take() after the commit raced with that)
            with DeltaPublisher(url, _state(2), on_backlog="block", storage_options=opts, signing_key=private,
                                stream_id="run-7") as pub:
                pub.source = _state(3)
                pub.publish(3)
            while not copied(3):
                assert time.monotonic() < deadline + 60 and thread.is_alive()
                time.sleep(0.05)
            step = proxy.count(proxy.take())
            objects = {k: n for k, n in step.items() if k[1].endswith(".safetensors")}
            assert step[("GET", "manifest.json")] == 1 and step[("GET", "signature.json")] == 1, step
            assert list(objects.values()) == [1] and ("GET", "LIST") not in step, step
        finally:
            stop.set()
            thread.join(timeout=30)
    with StreamReader(copy, trusted_keys=TrustedKeys.load([public], stream_id="run-7")) as reader:  # same key
        assert states_equal(reader.state_dict(3), _state(3))
