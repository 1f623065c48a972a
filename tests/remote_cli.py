"""``testremote://`` URLs: local folders that deltasync treats as a remote store, so that objects are
downloaded into its cache, and a CLI runner that pauses after the first download so that a test can
interrupt a command at that moment.

    python -m tests.remote_cli MARKER PAUSE_S deltasync-arguments...

writes MARKER once the first object is downloaded, then sleeps PAUSE_S seconds (in whichever thread
downloaded it) before going on.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "testremote"


class RemoteFolder(LocalFileSystem):
    """A local folder behind a protocol that deltasync does not read in place (not ``file``/``local``)."""

    protocol = (PROTOCOL,)

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("auto_mkdir", True)  # like an object store: no folders to make before a write
        super().__init__(*args, **kwargs)


def register() -> None:
    fsspec.register_implementation(PROTOCOL, RemoteFolder, clobber=True)


def remote_url(path: str | Path) -> str:
    return f"{PROTOCOL}://{Path(path).resolve()}"


def pause_after_first_download(marker: Path, pause_s: float) -> None:
    from deltasync.transports import FsspecTransport

    get_file = FsspecTransport.get_file

    def paused(self: FsspecTransport, path: str, local: Path, *, max_bytes: int | None = None) -> None:
        get_file(self, path, local, max_bytes=max_bytes)
        if not marker.exists():
            marker.write_text(path)
            time.sleep(pause_s)

    FsspecTransport.get_file = paused  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    marker, pause_s, args = Path(argv[0]), float(argv[1]), argv[2:]
    register()
    pause_after_first_download(marker, pause_s)
    from deltasync_cli import main as cli_main

    sys.argv = ["deltasync", *args]
    cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])
