"""Object storage under misuse and faults (``gdsckpt.io.s3``, the manager's remote tier) against a
real S3 server: SeaweedFS started on 127.0.0.1 for this module (``tests/seaweed.py``). Faults on
the wire come from ``_Relay``, a TCP relay between the client and the server that can slow or
freeze what the client sends; the server itself is never mocked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from seaweed import serving_bucket

import gdsckpt
from gdsckpt.errors import CheckpointError, CorruptCheckpointError, RemoteUploadError, RemoteUploadWarning

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's endpoint, with the AWS environment pointing at it for the module."""
    with serving_bucket(tmp_path_factory.mktemp("seaweedfs"), BUCKET) as server:
        yield server.endpoint


def _state(seed: int, size: int = 300 * 257) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(size, generator=g), "n": torch.arange(size) * seed}, "step": seed}


def _open_uploads(endpoint: str, key: str) -> bool:
    """Whether the server holds a multipart upload of ``key`` that was neither completed nor aborted."""
    with urllib.request.urlopen(f"{endpoint}/{BUCKET}?uploads&prefix={key}", timeout=10) as reply:
        return f"<Key>{key}</Key>" in reply.read().decode()


class _Relay:
    """A TCP relay from a local port to ``127.0.0.1:target``: each connection the client opens is
    forwarded to the server, the client's bytes at most ``rate`` bytes per second in all (None:
    as fast as they come). Once ``freeze_after`` bytes of the client's went through (None: never)
    it forwards none more, the connections staying open, as a server that stops reading would."""

    def __init__(self, target: int, rate: float | None = None, freeze_after: int | None = None):
        self.target, self.rate, self.freeze_after = target, rate, freeze_after
        self._lock = threading.Lock()
        self._next_free = time.monotonic()
        self._forwarded = 0
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Stop relaying and close every connection."""
        self._closed.set()
        with self._lock:
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _address = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                return
            with self._lock:
                self._sockets += [client, server]
            if self._closed.is_set():  # close() ran while this connection was being made
                self.close()
                return
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if from_client:
                    with self._lock:
                        self._forwarded += len(data)
                        if self.freeze_after is not None and self._forwarded > self.freeze_after:
                            self._frozen.set()
                    while self._frozen.is_set() and not self._closed.is_set():
                        time.sleep(0.05)
                    if self.rate:
                        self._throttle(len(data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):  # the other direction's thread then ends too
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _throttle(self, size: int) -> None:
        """Sleep until ``size`` more bytes fit the rate shared by every connection."""
        assert self.rate is not None
        with self._lock:
            start = max(self._next_free, time.monotonic())
            self._next_free = start + size / self.rate
        time.sleep(max(0.0, self._next_free - time.monotonic()))


@pytest.fixture
def relay(s3: str) -> Iterator[Any]:
    """Makes ``_Relay`` objects in front of the server; each is closed after the test."""
    made: list[_Relay] = []

    def make(rate: float | None = None, freeze_after: int | None = None) -> _Relay:
        made.append(_Relay(int(s3.rsplit(":", 1)[1]), rate, freeze_after))
        return made[-1]

    yield make
    for one in made:
        one.close()


# --- malformed URLs and endpoints: clear errors, never obstore's Rust panic -----------------------

@pytest.mark.parametrize("url", ["s3://my bucket/x.gdsckpt", "s3://bucket:9000/x.gdsckpt", "s3://a@b/x.gdsckpt",
                                 "s3://ab/x.gdsckpt", "s3://-bucket/x.gdsckpt"])
def test_a_malformed_bucket_name_is_a_value_error_naming_the_url(s3: str, tmp_path: Path, url: str) -> None:
    """A bucket name obstore cannot put in a request URI made its signing code panic
    (``pyo3_runtime.PanicException``, not an ``Exception``) in every entry point."""
    bucket = url[len("s3://"):].partition("/")[0]
    calls = [lambda: gdsckpt.load(url), lambda: gdsckpt.save(_state(0), url), lambda: gdsckpt.inspect(url),
             lambda: gdsckpt.verify(url), lambda: gdsckpt.CheckpointManager(url.rpartition("/")[0]).restore_latest(),
             lambda: gdsckpt.CheckpointManager(tmp_path, remote=url.rpartition("/")[0])]
    for call in calls:
        with pytest.raises(ValueError, match=f"{bucket!r}.*not a valid bucket name"):
            call()


@pytest.mark.parametrize("url", ["s3://bucket//lead.gdsckpt", "s3://bucket/a//b.gdsckpt"])
def test_a_key_with_an_empty_segment_is_refused(s3: str, url: str) -> None:
    """``s3://bucket//lead.gdsckpt`` was written, and replaced, ``s3://bucket/lead.gdsckpt``:
    obstore drops the empty segment (on AWS the two are different keys)."""
    url = url.replace("bucket", BUCKET, 1)
    for call in (lambda: gdsckpt.save(_state(0), url), lambda: gdsckpt.load(url)):
        with pytest.raises(ValueError, match="empty path segment"):
            call()


def test_the_command_line_reports_a_malformed_bucket_name_in_one_line(s3: str, h: Any) -> None:
    done = h.run_python("-m", "gdsckpt", "verify", "s3://my bucket/x.gdsckpt", timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "'my bucket'" in done.stderr and "Panic" not in done.stderr


def test_bucket_names_of_s3_compatible_servers_are_taken(s3: str) -> None:
    """Names outside AWS's rules that other servers accept (upper case, underscores, long ones)
    reach the server, which answers for itself."""
    from gdsckpt.io.s3 import split_prefix, split_url

    assert split_url("s3://Legacy_Bucket/a/b.gdsckpt") == ("Legacy_Bucket", "a/b.gdsckpt")
    assert split_prefix("s3://" + "b" * 200 + "/run") == ("b" * 200, "run/")
    with pytest.raises(CheckpointError, match="no-such-bucket"):
        gdsckpt.save(_state(0), "s3://no-such-bucket/x.gdsckpt")


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:99999", "minio host:9000", "localhost:9000", "http://",
                                      "http://127.0.0.1:0", "ftp://127.0.0.1:21", "http://key:secret@127.0.0.1:9000"])
def test_a_malformed_endpoint_is_a_value_error_naming_it(s3: str, endpoint: str, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/endpoint.gdsckpt"
    config = gdsckpt.Config(s3_endpoint=endpoint)
    for call in (lambda: gdsckpt.load(url, config=config), lambda: gdsckpt.save(_state(0), url, config=config),
                 lambda: gdsckpt.CheckpointManager(tmp_path, remote=f"s3://{BUCKET}/run", config=config)):
        with pytest.raises(ValueError, match=f"Config.s3_endpoint.*{endpoint!r}.*not a usable S3 endpoint"):
            call()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(ValueError, match=f"AWS_ENDPOINT_URL {endpoint!r} is not a usable S3 endpoint"):
        gdsckpt.load(url)


def test_a_panic_inside_obstore_is_a_checkpoint_error(s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever else makes obstore's Rust code panic, the caller gets a ``CheckpointError`` naming
    the object, not a ``BaseException`` that ``except Exception`` lets through."""
    import obstore

    class PanicException(BaseException):  # pyo3's panic type: a BaseException, known by its name
        pass

    def panic(*_args: Any, **_kwargs: Any) -> Any:
        raise PanicException("request valid: InvalidUri(InvalidUriChar)")

    url = f"s3://{BUCKET}/panic.gdsckpt"
    gdsckpt.save(_state(1), url)
    for name in ("head", "get", "put", "list"):
        monkeypatch.setattr(obstore, name, panic)
    with pytest.raises(CheckpointError, match=f"{url}: obstore panicked: request valid"):
        gdsckpt.load(url)
    with pytest.raises(CheckpointError, match=f"{url}: obstore panicked"):
        gdsckpt.save(_state(2), url)
    with pytest.raises(CheckpointError, match="obstore panicked"):
        gdsckpt.CheckpointManager(f"s3://{BUCKET}/panic-run").restore_latest()


# --- the manager's remote tier: a round that dies does not hang wait() -----------------------------

def test_wait_raises_promptly_after_an_upload_round_dies_of_a_base_exception(s3: str, tmp_path: Path) -> None:
    """An upload round ended by a ``BaseException`` that is no interpreter exit (a native
    library's panic) left the uploader thread gone but a round requested, so ``wait()`` waited
    for ever; it now reports the checkpoint the remote tier lacks, and the next round uploads it."""

    class NativeCrash(BaseException):
        pass

    manager = gdsckpt.CheckpointManager(tmp_path, remote=f"s3://{BUCKET}/crash", config=gdsckpt.Config(timeout=5))
    assert manager.remote is not None
    upload = manager.remote.upload

    def crash(*_args: Any, **_kwargs: Any) -> None:
        raise NativeCrash("native code failed")

    manager.remote.upload = crash
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            manager.wait()
            outcome.append(None)
        except BaseException as err:  # whatever wait() raises is the outcome checked below
            outcome.append(err)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteUploadWarning)
        manager.save(1, _state(1))
        waiter = threading.Thread(target=wait, daemon=True)
        started = time.monotonic()
        waiter.start()
        waiter.join(15)
        assert not waiter.is_alive(), "wait() still blocked 15 s after the upload round died"
        assert time.monotonic() - started < 10
    assert isinstance(outcome[0], RemoteUploadError) and "native code failed" in str(outcome[0])
    manager.remote.upload = upload
    manager.wait()
    assert manager.remote_steps() == [1]


# --- an object replaced while it is read: not damage ------------------------------------------------

def _replaced_after_open(monkeypatch: pytest.MonkeyPatch, url: str, state: dict[str, Any], opening: int = 1,
                         every: bool = False) -> None:
    """Save ``state`` to ``url`` (a complete, valid checkpoint) right after the ``opening``-th
    ``S3Reader`` of ``url`` took its HEAD (``every``: and after each later one): as a save by
    another process would land mid-read."""
    from gdsckpt.io.s3 import S3Reader

    opened = S3Reader.__init__
    count = [0]

    saving = [False]  # the save opens readers of ``url`` too (its base guard): not counted

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        opened(self, *args, **kwargs)
        if self.url == url and not saving[0]:
            count[0] += 1
            if count[0] == opening or (every and count[0] > opening):
                saving[0] = True
                try:  # a state of its own each time: a save of identical bytes keeps the ETag
                    gdsckpt.save({**state, "replacement": np.int64(count[0])}, url)
                finally:
                    saving[0] = False

    monkeypatch.setattr(S3Reader, "__init__", init)


def test_an_object_replaced_while_it_is_read_is_not_reported_damaged(s3: str, monkeypatch: pytest.MonkeyPatch,
                                                                     h: Any) -> None:
    """The reader's GETs ask for the version its HEAD saw (If-Match): a replaced object is an
    ``ObjectChangedError`` (load again), not the checksum or truncation error that reading on
    across two versions gave."""
    url = f"s3://{BUCKET}/replaced.gdsckpt"
    gdsckpt.save(_state(1), url)
    _replaced_after_open(monkeypatch, url, _state(2, size=400 * 257))
    with pytest.raises(CheckpointError) as caught:
        gdsckpt.load(url)
    assert not isinstance(caught.value, CorruptCheckpointError), caught.value
    from gdsckpt import ObjectChangedError

    assert isinstance(caught.value, ObjectChangedError)
    assert f"{url} was replaced while it was read" in str(caught.value) and "load it again" in str(caught.value)
    h.assert_same({**_state(2, size=400 * 257), "replacement": np.int64(1)}, gdsckpt.load(url))
    monkeypatch.undo()
    with gdsckpt.open(url) as checkpoint:
        gdsckpt.save(_state(3, size=200 * 257), url)
        with pytest.raises(ObjectChangedError):
            checkpoint.get("model/w")


def test_the_manager_does_not_pass_over_a_step_replaced_while_it_restores_it(
        s3: str, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    """A manager of objects only restoring its newest step while that object is saved again:
    no proof of damage, so the step is not passed over for an older one; it is read once more
    (the new version, complete), and a step replaced again meanwhile raises the error that says
    to load again."""
    prefix = f"s3://{BUCKET}/restore-replaced"
    manager = gdsckpt.CheckpointManager(prefix, keep_last=3)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    # the restore opens step 2 to check it, then to load it: the save lands between the two
    _replaced_after_open(monkeypatch, manager.path(2), _state(7), opening=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a SkippedCheckpointWarning would fail the test
        restored = gdsckpt.CheckpointManager(prefix, keep_last=3).restore_latest()
    assert restored is not None and restored[0] == 2
    h.assert_same({**_state(7), "replacement": np.int64(2)}, restored[1])
    monkeypatch.undo()
    _replaced_after_open(monkeypatch, manager.path(2), _state(8), opening=1, every=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match="was replaced while it was read") as caught:
            gdsckpt.CheckpointManager(prefix, keep_last=3).restore_latest()
    assert not isinstance(caught.value, CorruptCheckpointError)


# --- a process that dies leaves no upload open where it can help it -------------------------------------

_DYING_TRAINER = """
import sys, time
import numpy as np, gdsckpt
state = {"w": np.random.default_rng(0).random(8 << 20, dtype=np.float32)}  # 32 MiB: seconds at the relay's rate
config = gdsckpt.Config(async_worker="process", codec="none", max_inflight_bytes=16 << 20, s3_endpoint=sys.argv[2])
gdsckpt.save_async(state, sys.argv[1], config=config)
print("submitted", flush=True)
time.sleep(120)
"""


def test_a_background_worker_whose_training_process_dies_aborts_its_upload(s3: str, relay: Any) -> None:
    """The training process killed while its worker process uploads a ``save_async``: the worker
    used to exit at once, leaving the multipart upload's parts on the server, which no later save
    knows of; it now aborts the upload before it exits. No object appears."""
    key = "dying/step-1.gdsckpt"
    slow = relay(rate=4 << 20)
    trainer = subprocess.Popen([sys.executable, "-c", _DYING_TRAINER, f"s3://{BUCKET}/{key}", slow.endpoint],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "submitted"
        deadline = time.monotonic() + 60
        while not _open_uploads(s3, key):
            assert time.monotonic() < deadline and trainer.poll() is None, "the upload never started"
            time.sleep(0.05)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        if trainer.stdout is not None:
            trainer.stdout.close()
    deadline = time.monotonic() + 30  # the worker notices within a second, then aborts
    while _open_uploads(s3, key) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _open_uploads(s3, key), "the dead trainer's upload is left open on the server"
    with pytest.raises(FileNotFoundError):
        gdsckpt.inspect(f"s3://{BUCKET}/{key}")


# --- a save that reports failure leaves the object as it was -----------------------------------------

def test_a_save_over_a_slow_link_either_replaces_the_object_or_reports_failure(s3: str, relay: Any) -> None:
    """Over a slow but working link (each request within ``timeout``, the whole upload not),
    ``commit`` used to give up after ``timeout`` and raise while obstore went on to complete the
    upload: the save failed, yet the object was replaced. A save now reports what happened to
    the object: returned, it holds the new checkpoint; raised, the old one, with no upload left
    open."""
    key = "slow.gdsckpt"
    url = f"s3://{BUCKET}/{key}"
    old = {"w": np.zeros(1000, dtype=np.float32)}
    new = {"w": np.random.default_rng(0).random(10 << 20, dtype=np.float32)}  # 40 MiB
    gdsckpt.save(old, url)
    slow = relay(rate=7 << 20)
    config = gdsckpt.Config(timeout=3, max_inflight_bytes=16 << 20, codec="none", s3_endpoint=slow.endpoint)
    started = time.monotonic()
    try:
        gdsckpt.save(new, url, config=config)
        failure: BaseException | None = None
    except (CheckpointError, TimeoutError) as err:
        failure = err
    took = time.monotonic() - started
    deadline = time.monotonic() + 10  # an upload the save left running ends (completed or aborted)
    while _open_uploads(s3, key) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _open_uploads(s3, key)
    after = gdsckpt.load(url)["w"]
    if failure is None:
        assert after.size == new["w"].size, "the save returned but the object is not the new checkpoint"
    else:
        assert after.size == old["w"].size, f"the save raised ({failure}) but the object was replaced"
    assert took < 20, took


def test_a_save_to_a_server_that_stops_reading_fails_within_about_the_timeout(s3: str, relay: Any) -> None:
    """A server that stops taking the upload's bytes: the save fails once the upload took no data
    for ``timeout`` (not after a further timeout in ``abort``), and the object stays as it was."""
    url = f"s3://{BUCKET}/frozen.gdsckpt"
    old = {"w": np.zeros(1000, dtype=np.float32)}
    gdsckpt.save(old, url)
    frozen = relay(freeze_after=8 << 20)  # the requests before the upload pass, then part of it
    config = gdsckpt.Config(timeout=2, max_inflight_bytes=16 << 20, codec="none", s3_endpoint=frozen.endpoint)
    started = time.monotonic()
    with pytest.raises((CheckpointError, TimeoutError)):
        gdsckpt.save({"w": np.ones(6 << 20, dtype=np.float32)}, url, config=config)
    assert time.monotonic() - started < 8
    assert gdsckpt.load(url)["w"].size == old["w"].size


@pytest.mark.parametrize("url", ["s3://bucket/pre\x01fix", "s3://bucket/run\t7/", "s3://bucket/a\x7fb"])
def test_control_characters_in_a_key_are_refused_where_it_is_given(url: str, tmp_path: Path) -> None:
    """The client cannot address a key with a control character: a manager took such a
    ``remote=`` (or a prefix that puts one in every object name) and its uploads failed at
    ``wait()``; a save or load failed at the first request. All are refused where given."""
    with pytest.raises(ValueError, match="control character"):
        gdsckpt.CheckpointManager(tmp_path / "run", remote=url)
    with pytest.raises(ValueError, match="control character"):
        gdsckpt.save(_state(0), url.rstrip("/") + "/x.gdsckpt")
    with pytest.raises(ValueError, match="control character"):
        gdsckpt.load(url.rstrip("/") + "/x.gdsckpt")
    with pytest.raises(ValueError, match="control character"):
        gdsckpt.CheckpointManager(tmp_path / "run", remote="s3://bucket/run", prefix="st\tep")
