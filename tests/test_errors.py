"""Errors as data across process boundaries (deltasync/errors.py): an error's class and whether retrying can help
travel inside its text from the engine to the client. That text passes through other processes (vLLM's relays, a
server's HTTP body, a Ray actor), so the tests here play a hostile or broken one: a record inside other words,
control characters meant for a terminal, texts too large or too deep to parse."""

from __future__ import annotations

import json

import pytest

import deltasync.errors as errors
from deltasync.errors import (
    ConfigError,
    CorruptObjectError,
    DeltaSyncError,
    EngineError,
    HeldStepError,
    StoreError,
    can_retry,
    from_record,
    in_text,
    to_text,
)

# how vLLM 0.32 relays a worker's error: the engine core's words, the multiprocess executor's, and the HTTP body
_CORE = "Call to update_weights method failed: {}"
_WORKER = "Worker failed with error '{}', please check the stack trace above for the root cause"


def _body(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}})


CLASSES = [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_comes_back_from_every_relay_with_its_retry_answer(cls):
    error = cls("step 3: what was expected, what arrived")
    for text in (to_text(error), "  " + to_text(error), _CORE.format(to_text(error)), _WORKER.format(to_text(error)),
                 _CORE.format(_WORKER.format(to_text(error))), _body(_CORE.format(_WORKER.format(to_text(error))))):
        back = in_text(text, where="http://h/update_weights")
        assert type(back) is cls and can_retry(back) == can_retry(error), text
        assert str(back) == "http://h/update_weights: step 3: what was expected, what arrived"


def test_a_record_inside_other_words_is_not_believed():
    """Someone else's words (a tensor name from a manifest, a path, a server's reply quoted in another error) that
    hold a record must not decide the relayed error's class: a forged "permanent" record would stop a follower for
    ever, a forged "retryable" one would retry a wrong setting for ever."""
    forged = to_text(ConfigError("stop following"))
    for text in (f"ValueError: tensor {forged} has a bad shape",
                 _WORKER.format(f"KeyError: '{forged}'"),
                 _CORE.format(f"tensor {forged!r} is missing"),
                 _body(_CORE.format(_WORKER.format(f"RuntimeError: bad name {forged}"))),
                 _body(f"upstream said: {forged}")):
        assert in_text(text) is None, text
    # a deltasync error whose own message starts with someone's record: the record in front is its own
    outer = StoreError(f"{forged} (the store's reply)")
    back = in_text(_WORKER.format(to_text(outer)))
    assert type(back) is StoreError and can_retry(back)
    assert to_text(in_text(to_text(outer))) == to_text(outer)  # and one that crossed before is not wrapped again
    crossed = HeldStepError(to_text(HeldStepError("step 3")))
    assert to_text(crossed) == str(crossed)


def test_control_characters_from_another_process_are_shown_escaped():
    """A hostile server's message must not drive the terminal the CLI prints it on (or a log viewer): no ESC, BEL,
    C1 codes or bidirectional overrides survive; each is shown as its escape."""
    nasty = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202egnp.exe step 3\nsecond line\x00"
    for record in ({"type": "ConfigError", "kind": "ConfigError", "retryable": False, "message": nasty},
                   {"type": "Weird\x1b[31mError", "kind": None, "retryable": True, "message": nasty}):
        back = from_record(record, where="http://h")
        assert str(back).isprintable(), repr(str(back))
        assert "\\x1b]0;owned\\x07" in str(back) and "\\u202e" in str(back) and "step 3 second line" in str(back)
    assert type(in_text(f"deltasync-error:{{\"type\":\"ConfigError\",\"retryable\":false}} {nasty}")) is ConfigError


def test_texts_too_large_or_too_deep_are_bounded():
    """A relayed text is another process's: a deep or huge one is no error record, never a crash, and a rebuilt
    message is at most a few thousand characters."""
    assert in_text("deltasync-error:" + "[" * 200_000) is None
    assert in_text("{\"a\": " * 200_000 + "\"deltasync-error:\"") is None
    assert in_text(_body("x" * (2 << 20) + to_text(ConfigError("late")))) is None
    huge = in_text(to_text(CorruptObjectError("y" * (8 << 20))))
    assert type(huge) is CorruptObjectError and len(str(huge)) <= errors.MAX_MESSAGE_CHARS
    assert type(in_text(to_text(ConfigError("z")) + " " + "w" * (4 << 20))) is ConfigError


def test_a_record_that_is_not_one_is_an_engine_error():
    for record in (None, [], {"type": 1}, {"type": "ConfigError", "retryable": "no", "message": "m"}):
        assert type(from_record(record)) is EngineError
    # a name this module does not know, or a known one whose retry answer differs: the generic class of that answer
    assert can_retry(from_record({"type": "PatchError", "kind": None, "retryable": True, "message": "m"}))
    back = from_record({"type": "ConfigError", "kind": None, "retryable": True, "message": "m"})
    assert type(back) is EngineError and isinstance(back, DeltaSyncError)


# --- what an error is about, as attributes (issue 32, item 8) ---


def _published(url: str, steps: int) -> dict[int, dict]:
    """A real local stream of ``steps`` steps (anchor at 0, deltas after); each step's state as published."""
    import torch

    from deltasync import DeltaPublisher

    state, truth = {"w": torch.zeros(64), "b": torch.ones(8)}, {}
    with DeltaPublisher(url, state, anchor_every=100, on_backlog="block") as pub:
        for s in range(steps):
            state["w"][(5 * s) % 64] += 1.0
            pub.publish(s)
            truth[s] = {n: t.clone() for n, t in state.items()}
    return truth


def test_errors_from_real_operations_say_what_they_are_about(tmp_path):
    """A missing step, a corrupted object and a delta on the wrong base each carry the url, step, key, expected and
    found that their message names, so that a program need not parse the message."""
    from pathlib import Path

    import torch

    from deltasync import StreamReader
    from deltasync.engine import Replica
    from deltasync.errors import BaseStepMismatchError, StepNotFoundError
    from deltasync.store import Store

    url = str(tmp_path / "s")
    _published(url, 3)
    with StreamReader(url) as reader:
        with pytest.raises(StepNotFoundError) as missing:
            reader.manifest(7)
        assert (missing.value.url, missing.value.step) == (url, 7)
        assert missing.value.context() == {"url": url, "step": 7}

        # a delta on the wrong base: the replica holds step 0, the delta to step 2 is based on step 1
        with reader.open(0) as anchor:
            replica = Replica.from_anchor(anchor, device=torch.device("cpu"))
        with reader.open(2) as delta, pytest.raises(BaseStepMismatchError) as wrong:
            replica.apply(delta)
        assert (wrong.value.step, wrong.value.expected, wrong.value.found) == (2, 1, 0)

        m = reader.manifest(1)
    obj = next(Path(url).rglob(m.objects[0].object))
    data = bytearray(obj.read_bytes())
    data[-1] ^= 1
    obj.write_bytes(bytes(data))
    with Store(url) as store, pytest.raises(CorruptObjectError) as corrupt:
        store.read_object(m)
    e = corrupt.value
    import blake3

    assert (e.key, e.expected, e.found) == (m.objects[0].object, m.objects[0].digest,
                                             "blake3:" + blake3.blake3(bytes(data)).hexdigest())


def test_context_crosses_process_boundaries_and_pickles():
    import pickle

    from deltasync.errors import ChecksumMismatchError, error_record

    error = ChecksumMismatchError("bad", url="s3://b/run", step=4, tensor="w", expected="0x01", found="0x02")
    want = {"url": "s3://b/run", "step": 4, "tensor": "w", "expected": "0x01", "found": "0x02"}
    assert error.context() == want
    assert from_record(error_record(error)).context() == want
    assert in_text(_WORKER.format(to_text(error))).context() == want
    back = pickle.loads(pickle.dumps(error))  # a Ray actor's error
    assert type(back) is ChecksumMismatchError and back.context() == want and str(back) == "bad"


def test_a_hostile_records_context_is_checked_field_by_field():
    """Another process's context: control characters shown escaped, wrong types, a step that is no step number,
    unknown fields and values too large are left out, never raised or believed."""
    record = {"type": "ChecksumMismatchError", "kind": "ChecksumMismatchError", "retryable": True, "message": "m",
              "context": {"url": "s3://x\x1b]52;c;ZXZpbA==\x07", "step": -1, "tensor": ["not", "a", "name"],
                          "expected": "e" * 5000, "found": float("nan"), "key": True, "evil": "x"}}
    back = from_record(record)
    assert back.context() == {"url": "s3://x\\x1b]52;c;ZXZpbA==\\x07"}
    for context in ("not a dict", None, [1, 2], {"step": 10**13}, {"step": True}, {"step": 1.0}):
        assert from_record({**record, "context": context}).context() == {}


def test_a_records_numbers_are_finite_and_bounded():
    """Numbers from another process: an infinity (Python's JSON reads ``Infinity``) or an integer of thousands of
    digits is no size, step or checksum any error names (every one fits 64 bits): left out, like a NaN."""
    import json

    from deltasync.errors import ChecksumMismatchError, error_record

    record = {"type": "ChecksumMismatchError", "kind": "ChecksumMismatchError", "retryable": True, "message": "m"}
    for value in (float("inf"), float("-inf"), 10**4000, -(2**64), 2**64):
        assert from_record({**record, "context": {"expected": value, "found": value}}).context() == {}, value
    for value in (2**64 - 1, -(2**63), 0.5, 1 << 50):  # what errors name: kept
        assert from_record({**record, "context": {"found": value}}).context() == {"found": value}
    head = to_text(ChecksumMismatchError("bad")).split(" ", 1)[0].removeprefix("deltasync-error:")
    crafted = "deltasync-error:" + json.dumps(json.loads(head) | {"context": {"found": "F"}}).replace(
        '"F"', "Infinity") + " bad"  # as a worker's relayed text
    back = in_text(crafted)
    assert type(back) is ChecksumMismatchError and back.context() == {}
    assert json.dumps(error_record(from_record({**record, "context": {"found": 1.5}}))["context"]) == '{"found": 1.5}'
