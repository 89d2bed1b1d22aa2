"""Parent side of the reliability tests: child processes of ``worker.py`` spoken to over pipes
with a timeout on every wait, and the figures the tests reach (for docs/reliability.md)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker.py")

FIGURES: dict[str, str] = {}
"""Test name -> the figure it reached; printed in the terminal summary (``conftest.py``)."""


def record_figure(name: str, text: str) -> None:
    FIGURES[name] = text
    print(f"\n[reliability] {name}: {text}")


class Child:
    """A ``worker.py`` process (spawned with ``sys.executable``, never forked). Its JSON events are
    read from the raw pipe with ``select``, so every wait has a timeout."""

    def __init__(self, env: dict[str, str], log: Path, *args: str):
        self.log = log
        with log.open("w") as stderr:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, env=env)
        self.events: list[dict[str, Any]] = []
        self._buffer = b""
        self._eof = False

    def _pump(self, timeout: float) -> bool:
        """Read what the child wrote within ``timeout`` s; False once its output has ended."""
        assert self.proc.stdout is not None
        if self._eof:
            return False
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if ready:
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not data:
                self._eof = True
            self._buffer += data
            *lines, self._buffer = self._buffer.split(b"\n")
            self.events.extend(json.loads(line) for line in lines if line.strip())
        return not self._eof

    def expect(self, kind: str, timeout: float = 60) -> dict[str, Any]:
        """The first event of ``kind`` not yet taken, waiting up to ``timeout`` s for it."""
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event["event"] == kind:
                    return self.events.pop(i)
            if not self._pump(deadline - time.monotonic()) and not self.events:
                raise AssertionError(f"child ended without {kind!r}:\n{self.stderr()}")
            assert time.monotonic() < deadline, f"no {kind!r} event within {timeout} s:\n{self.stderr()}"

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self, timeout: float = 30) -> list[dict[str, Any]]:
        """SIGKILL; returns every event the child wrote and nobody took yet (read to its end)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout) == -signal.SIGKILL, f"the child had exited:\n{self.stderr()}"
        deadline = time.monotonic() + timeout
        while self._pump(deadline - time.monotonic()):
            assert time.monotonic() < deadline, "the output of a killed child did not end"
        events, self.events = self.events, []
        self.close()
        return events

    def stderr(self) -> str:
        return self.log.read_text()[-3000:]

    def close(self, timeout: float = 30) -> None:
        """End the child: close its stdin (a waiting child exits), else kill it."""
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
