"""Fleet status (deltasync/history/fleet.py, `deltasync status`) from real followers' heartbeats, and the
heartbeat's bounded cadence."""

from __future__ import annotations

import json
import time

import pytest
import torch

from deltasync import DeltaPublisher
from deltasync.follow.consumers import read_heartbeats
from deltasync.format.documents import ConsumerPosition, encode
from deltasync.history.fleet import fleet_status, prometheus_text
from deltasync.store import Store
from rollout_loader import Follower, StateDictTarget
from tests.test_cli_errors import assert_one_line_error, run_main


def _stream(url: str, steps: range) -> None:
    state = {"w": torch.zeros(32)}
    with DeltaPublisher(url, state, on_backlog="block") as pub:
        for s in steps:
            state["w"][s % 32] += 1.0
            pub.publish(s)


def test_status_shows_each_consumer_its_lag_and_the_stale_ones(tmp_path, monkeypatch, capsys):
    url = str(tmp_path / "stream")
    _stream(url, range(6))
    a = Follower(url, StateDictTarget(), consumer_id="rollout-a")
    a.sync()  # the newest: 5
    a.close()
    b = Follower(url, StateDictTarget(), consumer_id="rollout-b")
    b.sync(2)
    b.close()
    store = Store(url)
    old = ConsumerPosition(consumer_id="rollout-gone", step=1, updated_unix_s=time.time() - 7200)
    store.write_bytes("consumers/rollout-gone.json", encode(old))

    fleet = fleet_status(store, stale_after_s=900)
    assert fleet.newest_step == 5
    rows = {c.consumer_id: c for c in fleet.consumers}
    assert [c.consumer_id for c in fleet.consumers] == ["rollout-gone", "rollout-b", "rollout-a"]  # oldest step first
    assert (rows["rollout-a"].step, rows["rollout-a"].lag_steps, rows["rollout-a"].stale) == (5, 0, False)
    assert rows["rollout-a"].newest_seen == 5
    assert (rows["rollout-b"].step, rows["rollout-b"].lag_steps, rows["rollout-b"].newest_seen) == (2, 3, 2)
    assert rows["rollout-b"].errors == 0
    assert rows["rollout-gone"].stale and rows["rollout-gone"].lag_steps == 4 and rows["rollout-gone"].age_s > 7000
    assert [c.consumer_id for c in fleet.stale] == ["rollout-gone"]

    code, out, _ = run_main(monkeypatch, capsys, "status", url, "--json")
    assert code == 0 and json.loads(out)["consumers"][0]["consumer_id"] == "rollout-gone"
    code, out, _ = run_main(monkeypatch, capsys, "status", url)
    assert code == 0 and "rollout-a" in out and "1 stale" in out and "newest committed step 5" in out
    code, out, _ = run_main(monkeypatch, capsys, "status", url, "--prometheus")
    assert code == 0
    assert f'deltasync_fleet_consumer_lag_steps{{stream="{url}",consumer="rollout-b"}} 3' in out
    assert f'deltasync_fleet_stale_consumers{{stream="{url}"}} 1' in out
    def steady(text: str) -> list[str]:  # the heartbeat ages move on between two reads
        return [line for line in text.splitlines() if "age_seconds{" not in line]

    assert steady(out) == steady(prometheus_text(fleet_status(store)))  # the same text as the library's


def test_one_bad_heartbeat_is_reported_on_its_own_line_and_the_fleet_is_shown(tmp_path, monkeypatch, capsys):
    """Issue 30 item 14: an unparsable heartbeat (or one naming another consumer) costs that consumer only: status
    shows every other consumer and one line per bad file, exit 0; gc goes on and does not respect it."""
    url = str(tmp_path / "stream")
    _stream(url, range(4))
    store = Store(url)
    store.write_bytes("consumers/x.json", b'{"consumer_id": "y", "step": 1, "updated_unix_s": 1.0}')
    store.write_bytes("consumers/broken.json", b"{not json")
    store.write_bytes("consumers/ok.json", encode(ConsumerPosition(consumer_id="ok", step=2,
                                                                   updated_unix_s=time.time())))
    fleet = fleet_status(store)
    assert [c.consumer_id for c in fleet.consumers] == ["ok"]
    assert sorted(u.file for u in fleet.unreadable) == ["consumers/broken.json", "consumers/x.json"]
    code, out, _ = run_main(monkeypatch, capsys, "status", url)
    assert code == 0 and "ok" in out, out
    lines = [line for line in out.splitlines() if "unreadable heartbeat" in line]
    assert len(lines) == 2 and "consumers/x.json" in lines[1] and "heartbeat names consumer 'y'" in lines[1], out
    code, out, _ = run_main(monkeypatch, capsys, "status", url, "--json")
    assert code == 0 and len(json.loads(out)["unreadable"]) == 2
    from deltasync.history.gc import collect_garbage

    plan = collect_garbage(url, keep_last=1, dry_run=True)
    assert [c.consumer_id for c in plan.live_consumers] == ["ok"] and len(plan.unreadable) == 2
    code, _, err = run_main(monkeypatch, capsys, "status", str(tmp_path / "nothing"))
    assert_one_line_error(code, err, "StreamNotFoundError")


def test_a_heartbeat_from_the_future_is_suspect_never_live_and_holds_nothing_back(tmp_path, monkeypatch, capsys):
    url = str(tmp_path / "stream")
    _stream(url, range(6))
    store = Store(url)
    ahead = time.time() + 10 * 365 * 86400
    store.write_bytes("consumers/liar.json", encode(ConsumerPosition(consumer_id="liar", step=0,
                                                                     updated_unix_s=ahead)))
    store.write_bytes("consumers/skewed.json", encode(ConsumerPosition(consumer_id="skewed", step=5,
                                                                       updated_unix_s=time.time() + 5)))
    rows = {c.consumer_id: c for c in fleet_status(store).consumers}
    assert rows["liar"].suspect and not rows["liar"].stale and rows["liar"].age_s < 0
    assert not rows["skewed"].suspect and rows["skewed"].age_s == 0.0  # a clock a few seconds ahead is fine
    code, out, _ = run_main(monkeypatch, capsys, "status", url)
    assert code == 0 and "suspect" in out and "live, 0 s" not in out, out
    code, out, _ = run_main(monkeypatch, capsys, "status", url, "--prometheus")
    assert f'deltasync_fleet_suspect_consumers{{stream="{url}"}} 1' in out
    from deltasync.history.gc import collect_garbage

    plan = collect_garbage(url, keep_last=1, dry_run=True)
    assert [c.consumer_id for c in plan.live_consumers] == ["skewed"]
    assert not any("liar" in why for why in plan.keep.values())
    assert [c.consumer_id for c in plan.stale_consumers] == ["liar"]


def test_heartbeats_are_bounded_and_the_last_step_is_recorded(tmp_path):
    """After steps a follower reports at most every heartbeat_s / 10; closing it records the step it holds."""
    url = str(tmp_path / "stream")
    _stream(url, range(1))
    store = Store(url)
    writes: list[str] = []
    follower = Follower(url, StateDictTarget(), consumer_id="r0", heartbeat_s=600.0)
    put = follower.reader.store.transport.put

    def counted(key, data, **kw):
        if key.startswith("consumers/"):
            writes.append(key)
        return put(key, data, **kw)

    follower.reader.store.transport.put = counted  # type: ignore[method-assign]
    follower.sync()
    assert len(writes) == 1 and read_heartbeats(store)[0].step == 0
    with DeltaPublisher(url, {"w": torch.ones(32)}, on_backlog="block") as pub:
        for s in range(1, 6):
            pub.publish(s)
            pub.flush()
            follower.sync()
    assert len(writes) == 1 and read_heartbeats(store)[0].step == 0  # within 60 s of the last: not written
    follower.close()
    assert len(writes) == 2 and read_heartbeats(store)[0].step == 5  # the step it holds, on close
    with pytest.raises(Exception, match="heartbeat_s must be a positive number"):
        Follower(url, StateDictTarget(), consumer_id="r1", heartbeat_s=0)


HOSTILE = "\x1b]52;c;ZXZpbA==\x07\x1b[2J[red]x[/red]\u202e"  # a clipboard write, a screen clear, markup, bidi


def test_what_a_heartbeat_says_is_shown_inert(tmp_path, monkeypatch, capsys):
    """Issue 30 item 13: escape sequences and markup in a heartbeat's fields reach no terminal: every byte read from
    the store is shown as visible escapes, markup as written (table, JSON, Prometheus, the error line)."""
    url = str(tmp_path / "stream")
    _stream(url, range(2))
    store = Store(url)
    store.write_bytes("consumers/evil.json", encode(ConsumerPosition(consumer_id="evil", step=1,
                                                                     updated_unix_s=time.time(),
                                                                     weight_version=HOSTILE)))
    for args in ((), ("--json",), ("--prometheus",)):
        code, out, err = run_main(monkeypatch, capsys, "status", url, *args)
        assert code == 0, err
        assert not any(c in out + err for c in "\x1b\x07\u202e"), repr(out)
    code, out, _ = run_main(monkeypatch, capsys, "status", url)
    # the weight version's cell, folded over lines at 80 columns: joined, every character shown as a visible escape
    # and the markup as written, whole
    header = next(line for line in out.splitlines() if "version" in line)
    column = [c.strip() for c in header.split("┃")].index("version")
    cells = [line.split("│")[column].strip() for line in out.splitlines() if line.count("│") == header.count("┃")]
    assert "".join(cells) == "\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J[red]x[/red]\\u202e", out


def test_a_heartbeat_cannot_write_lines_of_the_report(tmp_path, monkeypatch, capsys):
    """A consumer's own text (its last error; a heartbeat file's name, which a bucket writer chooses) holding line
    breaks cannot add lines under the table that speak for others: that an honest replica differs from its reference,
    that replicas disagree. Each note stays on its line, the breaks shown as escapes."""
    url = str(tmp_path / "stream")
    _stream(url, range(2))
    store = Store(url)
    forged = ("\nhonest: its runtime fingerprint at step 1 differs from the reference"
              "\u2028replicas of configuration 0123456789abcdef disagree at step 1: honest")
    store.write_bytes("consumers/honest.json", encode(ConsumerPosition(consumer_id="honest", step=1,
                                                                       updated_unix_s=time.time())))
    store.write_bytes("consumers/evil.json", encode(ConsumerPosition(consumer_id="evil", step=1,
                                                                     updated_unix_s=time.time(), last_error=forged)))
    store.write_bytes("consumers/bad\nhonest: unreadable heartbeat (forged).json", b"{}")
    code, out, _ = run_main(monkeypatch, capsys, "status", url)
    assert code == 0, out
    lines = out.splitlines()
    assert not any(line.startswith(("honest:", "replicas of configuration")) for line in lines), out
    evil = [line for line in lines if line.startswith("evil:")]
    assert len(evil) == 1 and "\\x0ahonest: its runtime fingerprint" in evil[0] and "\\u2028replicas" in evil[0], out
