"""The environment: ``deltasync warm`` prepares it ahead of time (a container image, a fresh machine);
``deltasync env`` reports it (versions, extras, the kernel cache, a store's reachability), like ``hf env``."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from deltasync_cli.app import StorageOpt, _location, _print_json, command, inert, out


@command(summary="Compile the CPU kernels now (for image builds).",
         examples=["deltasync warm", "NUMBA_CACHE_DIR=/opt/deltasync/kernels deltasync warm"])
def warm() -> None:
    """Compile deltasync's CPU kernels now (first use: up to a minute on 2 cores) into their cache, so that no
    trainer, follower or engine start waits for it; run it when building an image. The cache is a user cache
    folder that survives reinstalling deltasync (NUMBA_CACHE_DIR moves it, e.g. where a read-only image has a
    writable folder); a line per element width says what it took."""
    from deltasync.format import _kernels

    out.print(f"loading or compiling deltasync's CPU kernels (cache: {_kernels.kernel_cache_dir()}; compiling "
              "takes up to a minute, once)", markup=False, soft_wrap=True)

    def report(width: int, seconds: float) -> None:
        what = f"{width}-byte elements" if width else "positions"
        out.print(f"  kernels for {what}: {seconds:.1f}s", markup=False)

    t0 = time.perf_counter()
    _kernels.warm_kernels(explain=False, on_width=report)  # (it must not tell the user to run `deltasync warm`)
    compiled, loaded = _kernel_counts(_kernels.dispatchers())
    out.print(f"kernels ready in {time.perf_counter() - t0:.1f}s: {compiled} compiled, {loaded} loaded from the "
              "cache", markup=False, soft_wrap=True)


def _kernel_counts(dispatchers: dict[str, Any]) -> tuple[int, int]:
    """(signatures compiled, signatures loaded from the disk cache) in this process."""
    compiled = sum(sum(d.stats.cache_misses.values()) for d in dispatchers.values())
    loaded = sum(sum(d.stats.cache_hits.values()) for d in dispatchers.values())
    return compiled, loaded


# environment variables worth reporting; values of those that may hold secrets are shown as "(set)"
_ENV_VARS = ("NUMBA_CACHE_DIR", "NUMBA_NUM_THREADS", "XDG_CACHE_HOME", "DELTASYNC_NODE_CACHE",
             "DELTASYNC_NODE_CACHE_BYTES", "DELTASYNC_TRUSTED_KEYS", "DELTASYNC_REVOKED_KEYS", "DELTASYNC_STREAM_ID",
             "DELTASYNC_MAX_AGE_S", "DELTASYNC_CONSUMER_ID", "DELTASYNC_LOG_LEVEL", "DELTASYNC_DEBUG",
             "DELTASYNC_CPU_LIVE_WEIGHTS", "DELTASYNC_RDMA_SECRET", "VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE",
             "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "HF_TOKEN",
             "HF_ENDPOINT")
_SECRET_WORDS = ("SECRET", "TOKEN", "KEY_ID", "PASSWORD")


@command(summary="Versions, extras, the kernel cache, a store's reach.",
         examples=["deltasync env", "deltasync env s3://bucket/run-7 -S endpoint_url=http://127.0.0.1:8333",
                   "deltasync env --json"])
def env(
    url: Annotated[str | None, typer.Argument(metavar="URL", help="A stream URL to try: whether the store answers, "
                                                              "and what it holds.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (stable keys) instead of lines.")] = False,
    storage_option: StorageOpt = None,
) -> None:
    """Report this environment, to paste into an issue or to check a machine: versions of deltasync, Python and
    the packages it builds on; which extras are installed (and what each one lacks); the kernel cache (where,
    whether this version's kernels are compiled); the variables deltasync reads (secrets shown as "(set)"); with
    URL, whether the store answers and what it holds. Exit 0 whatever it finds (a store that does not answer
    is reported, not an error)."""
    report: dict[str, Any] = {"deltasync": _versions(), "extras": _extras(), "kernel_cache": _kernel_cache(),
              "environment": _environment()}
    if url is not None:
        report["store"] = _store(_location(url, storage_option))
    if as_json:
        _print_json(report)
        return
    lines = [f"- {key}: {value}" for key, value in report["deltasync"].items()]
    for name, extra in report["extras"].items():
        lines.append(f"- extra {name}: " + ("installed" if not extra["missing"] else
                                            f"missing {', '.join(extra['missing'])}"))
    cache = report["kernel_cache"]
    state = (f"{cache['cached_kernels']} kernels compiled for this version" if cache["cached_kernels"]
             else "empty for this version: the first use compiles (or run `deltasync warm`)")
    lines.append(f"- kernel cache: {cache['dir']} ({state}{'' if cache['writable'] else '; NOT writable'})")
    lines.append("- bf16/fp16 diff: " + ("AVX-512 (VBMI2)" if cache["vector_diff"]
                                         else "portable kernel (no AVX-512 VBMI2)"))
    lines += [f"- {name}: {value}" for name, value in report["environment"].items()]
    if "store" in report:
        store = report["store"]
        lines.append(f"- store {inert(url)}: " + (
            f"answers in {store['seconds']:.2f}s; {store['steps']} committed steps"
            + (f", newest {store['newest_step']}" if store["newest_step"] is not None else "")
            + ("" if store["stream"] else " (no stream there yet)")
            if store["ok"] else f"does not answer as a stream: {inert(store['error'])}"))
    out.print("\n".join(lines), markup=False, soft_wrap=True)


def _versions() -> dict[str, str]:
    import platform
    import sys
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    import deltasync

    info = {"version": of("deltasync"), "location": str(deltasync.__file__).removesuffix("/__init__.py"),
            "python": f"{platform.python_version()} ({sys.executable})", "platform": platform.platform()}
    for name in ("torch", "numpy", "numba", "safetensors", "fsspec", "msgspec", "zstandard", "typer", "vllm",
                 "vllm-cpu", "transformers"):
        info[name] = of(name)
    import torch

    info["torch devices"] = (f"cuda x{torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu only")
    return info


def _extras() -> dict[str, dict[str, Any]]:
    """Each extra of the installed distribution: its packages, which are missing."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution, version

    try:
        requires = distribution("deltasync").requires or []
    except PackageNotFoundError:  # a source tree that was never installed: nothing to say
        return {}
    extras: dict[str, dict[str, Any]] = {}
    for line in requires:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]", line)
        if m is None:
            continue
        package, extra = m.groups()
        if extra == "dev":
            continue
        entry = extras.setdefault(extra, {"packages": {}, "missing": []})
        for name in (package, *_SAME_MODULE.get(package, ())):
            try:
                entry["packages"][package] = f"{version(name)}{'' if name == package else f' ({name})'}"
                break
            except PackageNotFoundError:
                continue
        else:
            entry["packages"][package] = None
            entry["missing"].append(package)
    return extras


_SAME_MODULE = {"vllm": ("vllm-cpu",)}  # distributions that install the same module under another name


def _kernel_cache() -> dict[str, Any]:
    from deltasync.engine import kernel_cache_state

    return kernel_cache_state()


def _environment() -> dict[str, str]:
    import os

    shown = {}
    for name in _ENV_VARS:
        value = os.environ.get(name)
        if value is not None:
            secret = any(word in name for word in _SECRET_WORDS)
            shown[name] = "(set)" if secret else inert(value)
    return shown


def _store(where: Any) -> dict[str, Any]:
    """Whether the store ``where`` (a URL and its options) answers (one listing, one read), and what it holds;
    its error in one line."""
    from deltasync.secrets import redact
    from deltasync.store import Store
    from deltasync_cli.app import one_line

    t0 = time.perf_counter()
    try:
        with Store(where) as store:
            steps = store.steps()
            stream = bool(steps) or store.exists("stream.json")
    except Exception as e:  # noqa: BLE001 - reported, not raised: `env` describes what it finds
        return {"ok": False, "error": one_line(redact(f"{type(e).__name__}: {e}")),
                "seconds": time.perf_counter() - t0}
    return {"ok": True, "seconds": time.perf_counter() - t0, "stream": stream, "steps": len(steps),
            "newest_step": steps[-1] if steps else None}
