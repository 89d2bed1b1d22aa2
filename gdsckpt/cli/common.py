"""What every ``gdsckpt`` subcommand shares: the parser class, the error line and exit codes, and
argument types.

Every error the command prints is one line on stderr, ``gdsckpt <command>: error: <message>``
(``gdsckpt: error: ...`` before a subcommand is known), and ends the command with exit code 2 for
bad arguments (usage errors) or 1 for an operation that failed. A subcommand raises
``CommandError`` (or ``UsageError``) and ``gdsckpt.cli.main`` prints it, or logs the error to the
``gdsckpt`` logger and returns the exit code (``main`` formats the record the same way,
``LineFormatter``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

EXIT_FAILED = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """A subcommand failed: ``main`` prints the message as the one error line and exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


class UsageError(CommandError):
    """Arguments that parse but cannot be acted on (exit code 2)."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


def _prog(command: str | None) -> str:
    return f"gdsckpt {command}" if command else "gdsckpt"


def _one_line(message: object) -> str:
    # A message carrying a newline (a wrapped library error) must not start a second line.
    return " ".join(str(message).split())


def print_error(command: str | None, message: object) -> None:
    """Print the one error line every command uses: ``gdsckpt <command>: error: <message>``."""
    print(f"{_prog(command)}: error: {_one_line(message)}", file=sys.stderr)


class LineFormatter(logging.Formatter):
    """Log records as ``gdsckpt <command>: <level>: <message>``, so that an error a subcommand logs
    (``logging.getLogger("gdsckpt").error(message)``) reads like every other error line, and a
    warning like ``gdsckpt <command>: warning: ...``."""

    def __init__(self, command: str | None):
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        """The record as one prefixed line (errors are always one line; a traceback, if any, follows)."""
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            message = _one_line(message)
        line = f"{_prog(self.command)}: {record.levelname.lower()}: {message}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def show_warning(command: str | None) -> Callable[..., None]:
    """A ``warnings.showwarning`` printing ``gdsckpt <command>: warning: <message>`` (no source line)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        print(f"{_prog(command)}: warning: {_one_line(message)}", file=file or sys.stderr)
    return show


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line (exit code 2), and which reads
    ``--size -1MiB`` as the option's value, so that the value's own check says what is wrong."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # argparse takes "-1MiB" or "-5e3" for an option (only "-5" and "-.5" count as numbers) and
        # reports "expected one argument" instead of the range check of the option's type. No
        # option of gdsckpt starts with a digit, so any "-<digit>..." is a value.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def _print_message(self, message: str, file: Any = None) -> None:
        """Write ``--help`` / ``--version`` output, letting a failed write raise: argparse's own
        method ignores ``OSError``, so that output lost to a full disk exited 0 (``main`` reports
        it instead)."""
        if message:
            (file or sys.stderr).write(message)

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message> (see '<prog> --help')`` and exit with code 2."""
        print(f"{self.prog}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def nonempty_path(text: str) -> str:
    """An argparse type for a path argument: an empty string is refused (it would name the
    current directory to some calls and nothing to others), and so is ``-``, which command-line
    tools read as standard input or output: taken as a file name, ``convert x -`` wrote a file
    named ``-``, which a later ``convert - y`` read instead of its input."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty")
    if text == "-":
        raise argparse.ArgumentTypeError("'-' (standard input or output) is not supported: give a file path "
                                         "(./- for a file named '-')")
    return text


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def require_module(name: str, *, extra: str, needed_by: str) -> Any:
    """Import the optional module ``name`` or raise ``CommandError`` naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != name.split(".")[0]:
            raise  # the module is there but something it imports is broken: not a missing extra
        raise CommandError(f"{needed_by} needs {name}, which is not installed here: "
                           f"python3 -m pip install 'gdsckpt[{extra}]'") from err



@contextmanager
def signals_interrupt(seen: threading.Event | None = None) -> Iterator[threading.Event]:
    """While the block runs (in the main thread), SIGTERM raises ``KeyboardInterrupt`` as SIGINT
    does, so that the ``finally`` blocks that remove a command's files run for ``kill`` as they do
    for Ctrl-C. Either first sets ``seen`` (a new event by default; yielded): a library that turns
    the interrupt into an error of its own (torch.save's zip writer raises ``RuntimeError ...
    unexpected pos`` for one inside its write) can still be told from a failure. The handlers
    before are restored and ``seen`` cleared on exit."""
    seen = threading.Event() if seen is None else seen
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def interrupt(_signum: int, _frame: Any) -> None:
        seen.set()
        raise KeyboardInterrupt

    seen.clear()
    previous = {number: signal.signal(number, interrupt) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield seen
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        seen.clear()  # this block's: a later one in the process starts without it
