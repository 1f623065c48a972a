"""``deltasync env`` and ``deltasync warm`` (issue 31, items 2 and 5): a report of the environment like ``hf env``
(versions, extras, the kernel cache, the variables deltasync reads, a store's reachability), and a warm-up that
says what it does instead of warning the user to run itself."""

from __future__ import annotations

import json
import logging
from importlib.metadata import version

import pytest

from deltasync import DeltaPublisher
from deltasync.format import _kernels, _simd
from deltasync_cli import main
from tests.test_publisher import train


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.argv", ["deltasync", *args])
    with pytest.raises(SystemExit) as e:
        main()
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def test_env_reports_versions_extras_the_kernel_cache_and_variables(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    monkeypatch.setenv("DELTASYNC_RDMA_SECRET", "a-secret-that-is-never-printed")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another-secret-never-printed")
    code, out, err = run(monkeypatch, capsys, "env", "--json")
    assert code == 0 and err == "", err
    report = json.loads(out)
    assert report["deltasync"]["version"] == version("deltasync")
    assert report["deltasync"]["torch"] == version("torch") and "numba" in report["deltasync"]
    extras = report["extras"]
    assert {"s3", "hf", "sign", "metrics", "plot", "demo", "rdma"} <= set(extras)  # the extras pyproject.toml lists
    assert "dev" not in extras
    assert all(set(e) == {"packages", "missing"} for e in extras.values())
    assert extras["s3"]["missing"] == [] and extras["s3"]["packages"]["s3fs"] == version("s3fs")
    cache = report["kernel_cache"]
    assert cache["dir"] == _kernels.kernel_cache_dir() and cache["dir"].startswith(str(tmp_path / "numba"))
    assert cache["cached_kernels"] == 0 and cache["writable"]  # a new folder: the next first use compiles
    assert cache["vector_diff"] == _simd.COMPRESS16
    assert report["environment"]["NUMBA_CACHE_DIR"] == str(tmp_path / "numba")
    assert report["environment"]["DELTASYNC_RDMA_SECRET"] == report["environment"]["AWS_SECRET_ACCESS_KEY"] == "(set)"
    assert "never-printed" not in out and "store" not in report
    code, text, _ = run(monkeypatch, capsys, "env")
    assert code == 0 and f"- version: {version('deltasync')}" in text and "- extra s3: installed" in text
    assert "- kernel cache: " in text and "empty for this version: the first use compiles" in text
    assert ("- bf16/fp16 diff: AVX-512 (VBMI2)" if _simd.COMPRESS16 else "- bf16/fp16 diff: portable kernel") in text
    assert "never-printed" not in text


def test_env_says_whether_a_store_answers(monkeypatch, capsys, tmp_path, small_state, gen):
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, small_state, on_backlog="block") as pub:
        for s in range(2):
            train(small_state, gen)
            pub.publish(s)
    code, out, _ = run(monkeypatch, capsys, "env", url, "--json")
    store = json.loads(out)["store"]
    assert code == 0 and store["ok"] and store["stream"] and store["steps"] == 2 and store["newest_step"] == 1
    code, text, _ = run(monkeypatch, capsys, "env", url)
    assert code == 0 and f"- store {url}: answers in " in text and "2 committed steps, newest 1" in text
    pytest.importorskip("s3fs")
    from tests.test_cli_errors import closed_port

    endpoint = f"http://127.0.0.1:{closed_port()}"  # nothing listens: reported, not an error
    code, out, err = run(monkeypatch, capsys, "env", "s3://bucket/run", "-S", f"endpoint_url={endpoint}", "-S",
                         "key=k", "-S", "secret=s", "--json")
    store = json.loads(out)["store"]
    assert code == 0 and not store["ok"] and store["error"].startswith("StoreUnreachableError: "), store
    assert "\n" not in store["error"]


def test_warm_says_what_it_does_and_never_tells_the_user_to_run_itself(monkeypatch, capsys, caplog):
    """It logged the first-use warning ("`deltasync warm` does it ahead of time") while the user ran it."""
    _kernels.warm_kernels()  # this process: loaded already (the cache itself is tests/test_kernels.py's)
    monkeypatch.setattr(_kernels, "_warmed", set())
    monkeypatch.setattr(_kernels, "SAY_AFTER_S", 0.0)  # any wait would be explained, were it to explain
    with caplog.at_level(logging.WARNING):
        code, out, err = run(monkeypatch, capsys, "warm")
    assert code == 0 and err == "", err
    assert not [r for r in caplog.records if "deltasync warm" in r.getMessage()]
    lines = out.splitlines()
    assert lines[0].startswith(f"loading or compiling deltasync's CPU kernels (cache: {_kernels.kernel_cache_dir()}")
    assert [line.split(":")[0].strip() for line in lines[1:6]] == [
        "kernels for 1-byte elements", "kernels for 2-byte elements", "kernels for 4-byte elements",
        "kernels for 8-byte elements", "kernels for positions"]
    assert lines[-1].startswith("kernels ready in ") and lines[-1].endswith("loaded from the cache")
