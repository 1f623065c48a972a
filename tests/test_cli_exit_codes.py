"""Exit codes a script can trust, for every command: 0 done, 2 a user's mistake (one line), 130 Ctrl-C (SIGINT),
143 SIGTERM, and 2 with the extra named where an optional package is missing (issue 31, item 1).

``deltasync follow URL --server S --until 10 && start_eval`` must not start the evaluation after a kill: every
command here is run through the real entry point, in this process (seconds, not an interpreter each), and
interrupted by a real signal sent to this process at a moment it is working (its first store call, its first
checkpoint read, ...). tests/test_cleanup.py interrupts commands in processes of their own, as a terminal does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch

from deltasync import DeltaPublisher
from deltasync.store.retries import Retrier
from deltasync_cli import main
from tests.conftest import perturb
from tests.test_cli_errors import assert_one_line_error
from tests.test_vllm_client import fake_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def world(tmp_path, small_state, gen) -> dict[str, str]:
    """What the commands work on: a stream of three steps, two checkpoints, paths for outputs (and, with the
    ``server`` fixture, a fake vLLM server that takes updates: tests/test_vllm_client.py)."""
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, small_state, on_backlog="block") as pub:
        for step in range(3):
            for v in small_state.values():
                v.copy_(perturb(v, 0.05, gen))
            pub.publish(step)
    base, target = tmp_path / "base.safetensors", tmp_path / "target.safetensors"
    state = {k: v.clone() for k, v in small_state.items()}  # the stream's last step
    safetensors.torch.save_file(state, str(base))
    safetensors.torch.save_file({k: perturb(v, 0.05, gen) for k, v in state.items()}, str(target))
    return {"url": url, "base": str(base), "target": str(target), "delta": str(tmp_path / "base.delta"),
            "out": str(tmp_path / "out"), "key": str(tmp_path / "keys" / "trainer.key"),
            "nowhere": str(tmp_path / "nowhere"), "dst": str(tmp_path / "copy")}


@pytest.fixture
def server() -> Iterator[str]:
    with fake_server() as (_, url):
        yield url


def run(args: list[str], world: dict[str, str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``deltasync ARGS`` ({name} filled from ``world``) through the real entry point: (exit code, out, err)."""
    monkeypatch.setattr("sys.argv", ["deltasync", *(a.format(**world) for a in args)])
    try:
        with pytest.raises(SystemExit) as e:
            main()
    except KeyboardInterrupt:  # escaped the command: it would end this test session, not just fail the test
        pytest.fail(f"KeyboardInterrupt escaped deltasync {args[0]}")
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def _prepare(name: str, world: dict[str, str], monkeypatch, capsys, request) -> None:
    """What a command needs before it runs: follow a server; patch a delta that diff wrote; keygen a folder."""
    if name == "follow":
        world["server"] = request.getfixturevalue("server")
    if name == "patch":
        assert run(["diff", "{base}", "{target}", "-o", "{delta}"], world, monkeypatch, capsys)[0] == 0
    Path(world["key"]).parent.mkdir(exist_ok=True)


# command: (arguments that succeed, arguments that are a mistake with a word its one line must hold)
COMMANDS: dict[str, tuple[list[str], list[str], str]] = {
    "diff": (["diff", "{base}", "{target}", "-o", "{delta}"], ["diff", "{nowhere}", "{target}", "-o", "{delta}"],
             "does not exist"),
    "patch": (["patch", "{base}", "{delta}", "-o", "{out}.safetensors"],
              ["patch", "{target}", "{delta}", "-o", "{out}.safetensors"], "ChecksumMismatchError"),
    "ls": (["ls", "{url}"], ["ls", "{nowhere}"], "StreamNotFoundError"),
    "show": (["show", "{url}", "1"], ["show", "{url}", "9"], "step 9 is not committed"),
    "status": (["status", "{url}"], ["status", "{url}", "--json", "--prometheus"], "--json"),
    "follow": (["follow", "{url}", "--server", "{server}", "--until", "2"],
               ["follow", "{url}", "--server", "localhost:1"], "expected http://host:port"),
    "mirror": (["mirror", "{url}", "{dst}", "--once"], ["mirror", "{nowhere}", "{dst}", "--once"],
               "StreamNotFoundError"),
    "replay": (["replay", "{url}", "--step", "2", "-o", "{out}"], ["replay", "{url}", "--step", "7", "-o", "{out}2"],
               "step 7"),
    "push": (["push", "{url}", "{target}", "--step", "3"], ["push", "{url}", "{target}", "--step", "1"], "step"),
    "compare": (["compare", "{url}", "0", "2"], ["compare", "{url}", "0", "8"], "step 8"),
    "stats": (["stats", "{url}"], ["stats", "{nowhere}"], "StreamNotFoundError"),
    "verify": (["verify", "{url}"], ["verify", "{nowhere}"], "StreamNotFoundError"),
    "gc": (["gc", "{url}", "--keep-last", "2", "--yes"], ["gc", "{url}", "--keep-last", "0", "--yes"],
           "keep_last"),
    "keygen": (["keygen", "{key}"], ["keygen", "{base}"], "never overwritten"),
    "warm": (["warm"], ["warm", "--bogus"], "No such option: --bogus"),
    "env": (["env", "{url}"], ["env", "{url}", "--bogus"], "No such option: --bogus"),
    "demo": (["demo", "--engine", "torch", "--steps", "2", "--hidden-size", "64", "--layers", "1"],
             ["demo", "--engine", "sglang"], "--engine"),
    "catchup": (["catchup", "{url}", "--distances", "2"], ["catchup", "{url}", "--distances", "1"], "at least 2"),
    # its success starts a vLLM engine (tests/integration/test_vllm_fingerprint.py runs the command for its reference
    # and reads back what it stored): here its help;
    # the mistake is found before any engine starts
    "fingerprint": (["fingerprint", "--help"], ["fingerprint", "{url}", "--step", "9"], "step 9 is not committed"),
}


def test_every_command_is_in_the_table():
    from typer.main import get_command

    from deltasync_cli import app

    assert set(get_command(app).commands) == set(COMMANDS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_success_is_0_and_a_mistake_is_2_in_one_line(name, world, monkeypatch, capsys, request):
    _prepare(name, world, monkeypatch, capsys, request)
    ok, mistake, needle = COMMANDS[name]
    code, out, err = run(ok, world, monkeypatch, capsys)
    assert code == 0, (out, err)
    if name == "keygen":
        world["key"] = world["key"] + ".2"  # (the mistake: a path that exists)
    code, out, err = run(mistake, world, monkeypatch, capsys)
    assert_one_line_error(code, err, needle)


class Interrupter:
    """Sends ``sig`` to this process from inside the command, the ``at``-th time it calls the patched function (in
    whichever thread): a real signal, delivered while the command works, handled by the command's own handlers."""

    def __init__(self, sig: int, at: int = 1) -> None:
        self.sig, self.at, self.calls, self.sent = sig, at, 0, False
        self.lock = threading.Lock()

    def wrap(self, fn):
        def patched(*args, **kwargs):
            with self.lock:
                self.calls += 1
                fire = self.calls == self.at and not self.sent
                self.sent = self.sent or fire
            if fire:
                handler = signal.getsignal(self.sig)
                assert handler not in (signal.SIG_DFL, signal.SIG_IGN), f"no handler for {self.sig}: would kill pytest"
                os.kill(os.getpid(), self.sig)
            return fn(*args, **kwargs)

        return patched


# where each command is interrupted: its first store call (and so on), or the function named
WHERE = {"diff": ("safetensors.torch.load_file", 1), "patch": ("safetensors.torch.load_file", 1),
         "keygen": ("deltasync.signing.keygen", 1), "warm": ("deltasync.format._kernels.warm_kernels", 1),
         "follow": ("store", 4), "mirror": ("store", 12), "demo": ("store", 3)}
INTERRUPTED = {  # arguments that would run on (follow and mirror: for ever) unless interrupted
    "follow": ["follow", "{url}", "--server", "{server}", "--until", "99", "--timeout-s", "60", "--poll-s", "0.05"],
    "mirror": ["mirror", "{url}", "{dst}", "--until", "99", "--poll-s", "0.05"],
    "fingerprint": ["fingerprint", "{url}", "--step", "2"],  # interrupted while it replays, before an engine starts
}


@pytest.fixture
def signals_as_a_terminal_sends_them():
    """SIGINT raises KeyboardInterrupt (a test run started in the background of a shell inherits it ignored) and
    SIGTERM is left to the command to handle, as in a fresh process; both restored afterwards."""
    previous = {sig: signal.signal(sig, handler)
                for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(previous))
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_signal_ends_every_command_with_128_plus_its_number(name, sig, world, monkeypatch, capsys, request,
                                                              signals_as_a_terminal_sends_them):
    _prepare(name, world, monkeypatch, capsys, request)
    where, at = WHERE.get(name, ("store", 1))
    interrupter = Interrupter(sig, at)
    if where == "store":
        monkeypatch.setattr(Retrier, "call", interrupter.wrap(Retrier.call))
    else:
        module, attr = where.rsplit(".", 1)
        __import__(module)
        monkeypatch.setattr(sys.modules[module], attr, interrupter.wrap(getattr(sys.modules[module], attr)))
    code, out, err = run(INTERRUPTED.get(name, COMMANDS[name][0]), world, monkeypatch, capsys)
    assert interrupter.sent, f"deltasync {name} never reached the point where it is interrupted"
    assert code == 128 + sig, (code, out, err)
    assert "Traceback" not in err, err
    if name == "keygen":
        assert not Path(world["key"]).exists()  # interrupted before it wrote a key


# --- a missing extra: named, exit 2, in a fresh interpreter where the packages cannot be imported ------------

MISSING = """
import json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # `import name` (and its submodules) fails, as where it is not installed
from deltasync_cli import main
results = []
for args in json.loads(sys.argv[2]):
    sys.argv = ["deltasync", *args]
    try:
        main()
    except SystemExit as e:
        results.append(e.code)
print("RESULTS", json.dumps(results))
"""


def test_a_missing_extra_is_named_in_one_line(world, server, tmp_path):
    """Where the sign, plot, metrics, s3 and hf extras are not installed, each command that needs one says which
    (``pip install 'deltasync[EXTRA]'``) in one line and exits 2: it was ``ModuleNotFoundError`` and exit 3 for
    ``keygen`` and ``--trusted-key``, and a traceback after the whole replay for ``replay --sign``."""
    key = tmp_path / "k.pub"
    key.write_text("-----BEGIN PUBLIC KEY-----\n")
    cases = [
        (["keygen", str(tmp_path / "new.key")], "sign"),
        (["verify", world["url"], "--trusted-key", str(key), "--stream-id", "run-7"], "sign"),
        (["replay", world["url"], "--step", "2", "-o", str(tmp_path / "out"), "--sign", str(key)], "sign"),
        (["stats", world["url"], "--plot", str(tmp_path / "p.png")], "plot"),
        (["follow", world["url"], "--server", server, "--metrics-port", "0", "--until", "0"], "metrics"),
        (["ls", "s3://bucket/run"], "s3"),
        (["ls", "hf://buckets/someone/bucket/run"], "hf"),
    ]
    blocked = "cryptography,model_signing,matplotlib,prometheus_client,s3fs,huggingface_hub"
    r = subprocess.run([sys.executable, "-c", MISSING, blocked, json.dumps([args for args, _ in cases])], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    codes = json.loads(r.stdout.split("RESULTS", 1)[1])
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == len(cases) and "Traceback" not in r.stderr, r.stderr
    for (args, extra), code, line in zip(cases, codes, lines, strict=True):
        assert code == 2, (args, code, line)
        assert f"pip install 'deltasync[{extra}]'" in line, (args, line)
        assert not (tmp_path / "out").exists() and not (tmp_path / "p.png").exists()


def test_replay_sign_with_a_step_key_says_which_key_it_needs(world, tmp_path, monkeypatch, capsys):
    """``deltasync keygen`` makes an Ed25519 key (steps); an export is signed with ECDSA (``keygen --ecdsa``), which
    OpenSSF model_signing verifies: the wrong one is named before the replay runs (it was an AttributeError, exit
    3, after the replay)."""
    pytest.importorskip("model_signing")
    code, _, _ = run(["keygen", str(tmp_path / "step.key")], world, monkeypatch, capsys)
    assert code == 0
    code, _, err = run(["replay", "{url}", "--step", "2", "-o", "{out}", "--sign", str(tmp_path / "step.key")], world,
                       monkeypatch, capsys)
    assert_one_line_error(code, err, "ConfigError", "expected an ECDSA private key", "keygen --ecdsa", "Ed25519")
    assert not Path(world["out"]).exists()
    code, _, _ = run(["keygen", str(tmp_path / "export.key"), "--ecdsa"], world, monkeypatch, capsys)
    code, out, err = run(["replay", "{url}", "--step", "2", "-o", "{out}", "--sign", str(tmp_path / "export.key")],
                         world, monkeypatch, capsys)
    assert code == 0 and (Path(world["out"]) / "model.sig").exists(), err
