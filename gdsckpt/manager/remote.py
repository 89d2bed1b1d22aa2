"""The manager's remote tier: checkpoint files copied, as they are, to object storage.

``CheckpointManager(directory, remote="s3://bucket/prefix")`` saves to ``directory`` (node-local
NVMe, fast) and then uploads each completed file under its own name below the prefix, with a
``latest`` object naming the newest one there, so that a replacement node restores from the
remote tier when its local one is empty. The file is uploaded, not re-encoded: the bytes sent are
the compressed ones, and the object is byte-identical to the file, so its delta links (relative
names) resolve beside it (``gdsckpt.state.delta.base_location_of``).

One background thread per manager (``Uploader``) runs upload rounds: each round uploads the
checkpoints the remote tier lacks (oldest first, so that a delta's base is there before the delta),
then moves the remote ``latest``, then prunes the remote tier. Rounds run one at a time, so the
remote tier has one writer per manager. A failed round is reported (``RemoteUploadWarning``) and
leaves its checkpoints pending; the next save and ``wait`` run another round. This module holds
the thread and the round's bookkeeping that does not need the manager's directory invariants;
which steps to upload, keep and point at is the manager's (``gdsckpt.manager``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable

from ..errors import RemoteUploadWarning

POLL_SECONDS = 1.0
"""How often ``Uploader.wait_idle`` looks whether the thread is still alive."""
_STOPPING = (KeyboardInterrupt, SystemExit, GeneratorExit)
"""What ends the uploader's thread rather than fail one round: the interpreter is stopping."""


class Uploader:
    """Runs ``round_`` on its own thread whenever ``request`` is called (requests made while a
    round runs fold into one more round); ``wait_idle`` waits for the rounds to run out."""

    def __init__(self, round_: Callable[[], None], name: str):
        self._round = round_
        self._name = name
        self._condition = threading.Condition()
        self._requested = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """The failure of the last round, None after a round that succeeded."""

    def after_fork_in_child(self) -> None:
        """In a forked child: the condition free (the parent's thread may have held it) and no
        thread (the parent's does not exist here; the next ``request`` starts one)."""
        self._condition = threading.Condition()
        self._thread = None
        self._requested = False

    def request(self) -> None:
        """Ask for a round (starts the thread on first use)."""
        with self._condition:
            self._requested = True
            if self._thread is None or not self._thread.is_alive():
                # daemon: an interpreter that exits without ``wait`` must not hang on a slow
                # upload; the multipart upload is then left for the bucket's lifecycle rule
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def _loop(self) -> None:
        try:
            while True:
                with self._condition:
                    if not self._requested:
                        self._thread = None
                        self._condition.notify_all()
                        return
                    self._requested = False
                try:
                    self._round()
                    self.error = None
                except BaseException as err:  # reported, and retried by the next round
                    self.error = err
                    self._report(err)
                    # An interpreter exit ends the rounds; any other failure (a panic in a native
                    # library is a BaseException too) is one failed round like an Exception.
                    if isinstance(err, _STOPPING):
                        raise
        finally:
            with self._condition:
                if self._thread is threading.current_thread():
                    # Ended by an exception: ``wait_idle`` must hear of it. A request this
                    # thread will never serve is dropped (its checkpoints stay pending, which
                    # ``wait`` reports); the next ``request`` starts a new thread.
                    self._thread = None
                    self._requested = False
                    self._condition.notify_all()

    @staticmethod
    def _report(err: BaseException) -> None:
        """Warn of a failed round. A warning filter that turns it into an error (``-W error``)
        must not end the thread before ``wait_idle`` hears of it: the error is logged instead."""
        try:
            warnings.warn(f"{err} (the next save or wait() retries)", RemoteUploadWarning, stacklevel=1)
        except Exception:  # noqa: BLE001 - see the docstring
            logging.getLogger("gdsckpt").error("remote tier: %s (the next save or wait() retries)", err)

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no round runs or is requested; False if ``timeout`` ran out first. A thread
        that died without saying so (``_loop``'s ``finally`` did not run: the interpreter is
        shutting down) counts as idle too: it is checked every ``POLL_SECONDS``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._thread is not None and self._thread.is_alive():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._condition.wait(POLL_SECONDS if remaining is None else min(remaining, POLL_SECONDS))
            self._thread = None
            self._requested = False
            return True
