"""``gdsckpt`` / ``python -m gdsckpt``: thin subcommands over the library.

Exit codes: 0 success, 1 the operation failed (e.g. a corrupt checkpoint), 2 bad arguments, 130
interrupted, 141 stdout closed early (``gdsckpt inspect f | head``, quietly, as ``cat`` would).
Every error is one line on stderr, ``gdsckpt <command>: error: <message>`` (``gdsckpt.cli.common``);
a traceback follows only with ``--verbose``. Global options (before the subcommand): ``--quiet``
(no progress bars, warnings only), ``--verbose`` (the library's INFO log, tracebacks of errors),
``--config PATH|PRESET`` (a TOML file or a preset's name, see docs/configuration.md),
``--version``. Long operations draw a progress bar on a terminal only.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from ..codecs import CONVERT_TO_PORTABLE
from ..config import Config, preset_names, resolve_config
from ..errors import CheckpointError
from ..tools.costmodel import group_of
from ..version import __version__
from .common import (
    EXIT_FAILED,
    CommandError,
    LineFormatter,
    Parser,
    UsageError,
    nonempty_path,
    positive_int,
    print_error,
    require_module,
    show_warning,
    signals_interrupt,
)
from .progress import byte_progress, progress_bar

_SUBCOMMAND_MODULES: tuple[str, ...] = ("bench", "convert", "plan")
"""Modules of ``gdsckpt.cli`` that add a subcommand through ``register(subparsers)``."""


EXIT_INTERRUPTED = 130
EXIT_STDOUT_CLOSED = 141
"""128 + SIGPIPE: what a shell reports for ``cat`` or ``yes`` whose reader went away."""


def _cmd_demo(args: argparse.Namespace) -> int:
    require_module("torch", extra="demo", needed_by="the demo")
    from ..tools.demo import check_demo_options, run_demo

    try:
        device = check_demo_options(width=args.width, depth=args.depth, device=args.device, directory=args.dir)
    except ValueError as err:
        raise UsageError(str(err)) from err
    # kill as Ctrl-C: the demo's temporary directory is removed either way
    with signals_interrupt() as interrupted:
        try:
            figures = run_demo(width=args.width, depth=args.depth, directory=args.dir, device=device,
                               rounds=args.rounds, config=args.config)
        except Exception as err:
            if interrupted.is_set():  # torch.save turns an interrupt inside its write into RuntimeError
                raise KeyboardInterrupt from err
            raise
    return 0 if figures["bit_exact"] else EXIT_FAILED


def group_totals(info: Any) -> dict[str, dict[str, Any]]:
    """Per group (``gdsckpt.tools.costmodel.group_of``): arrays, logical bytes, stored bytes, ratio
    (None when nothing is stored) and whether the stored bytes are an estimate (chunks shared
    with another group), from ``CheckpointInfo.groups``."""
    return {name: {"arrays": g.arrays, "logical_bytes": g.logical_bytes, "stored_bytes": g.stored_bytes,
                   "ratio": g.ratio, "estimated": g.estimated}
            for name, g in info.groups(group_of).items()}


def _estimate(figure: str, estimated: bool) -> str:
    """A figure marked ``~`` where it is an estimate (an array's or group's share of shared chunks)."""
    return f"~{figure}" if estimated else figure


def _ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..api import inspect

    info = inspect(args.path, config=args.config)
    groups = group_totals(info)
    if args.json:
        print(json.dumps({
            "path": info.path, "format_version": list(info.format_version), "writer": info.writer,
            "file_bytes": info.file_bytes, "logical_bytes": info.logical_bytes, "ratio": info.ratio,
            "codecs": info.codecs, "portable": info.portable, "gpu_only": list(info.gpu_only),
            "groups": groups, "base": info.base,
            "tensors": [{"key": t.key, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
                         "device": t.device, "nbytes": t.nbytes, "stored_bytes": t.stored_bytes,
                         "stored_estimated": t.stored_estimated, "ratio": t.ratio,
                         "codecs": list(t.codecs), "alias_of": t.alias_of, "lossy": t.lossy,
                         "delta": t.delta}
                        for t in info.tensors],
            "chunks": [{"offset": c.offset, "stored_bytes": c.stored_bytes, "raw_bytes": c.raw_bytes,
                        "codecs": c.codecs, "arrays": [list(a) for a in c.arrays]} for c in info.chunks],
        }, indent=2))
        return 0
    print(f"{info.path}: format {info.format_version[0]}.{info.format_version[1]}, written by {info.writer}")
    aliases = sum(1 for t in info.tensors if t.alias_of)
    also = f" (+{aliases} alias{'es' if aliases > 1 else ''} of them)" if aliases else ""
    print(f"{len(info.tensors) - aliases} arrays{also}, {info.logical_bytes} logical bytes, {info.file_bytes} "
          f"bytes on disk, ratio {info.ratio:.3f}")
    if info.portable:
        print("portable: every chunk decodes without a GPU")
    else:
        print(f"not portable: {', '.join(info.gpu_only)} decode only on an NVIDIA GPU with nvCOMP; "
              f"{CONVERT_TO_PORTABLE}")
    if info.base is not None:
        deltas = sum(t.delta for t in info.tensors)
        print(f"delta checkpoint: {deltas} arrays stored as the XOR with base {_shown(repr(info.base['path']))} "
              f"(chain depth {info.base['depth']}; 'gdsckpt rebase' writes it in full)")
    print(f"  {'key':50} {'dtype':10} {'shape':20} {'stored':>12} {'ratio':>7}  codecs")
    for t in info.tensors:
        codecs = ",".join(t.codecs) or (f"alias of {_shown(t.alias_of)}" if t.alias_of else "-")
        print(f"  {_shown(t.key):50} {t.dtype:10} {list(t.shape)!s:20} "
              f"{_estimate(str(t.stored_bytes), t.stored_estimated):>12} "
              f"{_estimate(_ratio_text(t.ratio), t.stored_estimated):>7}  {codecs}")
    print(f"  {'group':30} {'arrays':>7} {'logical bytes':>15} {'stored bytes':>15} {'ratio':>7}")
    for name, group in groups.items():
        print(f"  {_shown(name):30} {group['arrays']:7} {group['logical_bytes']:15} "
              f"{_estimate(str(group['stored_bytes']), group['estimated']):>15} "
              f"{_estimate(_ratio_text(group['ratio']), group['estimated']):>7}")
    print(f"  {'total':30} {sum(g['arrays'] for g in groups.values()):7} {info.logical_bytes:15} "
          f"{info.file_bytes:15} {info.ratio:7.3f}")
    if any(t.stored_estimated for t in info.tensors):
        print(f"~: an estimate: small arrays share chunks, compressed as a whole, whose stored bytes are split "
              f"by raw bytes ({len(info.chunks)} chunks; --json lists each with its exact sizes)")
    lossy = [t for t in info.tensors if t.lossy is not None]
    if lossy:
        print(f"{len(lossy)} lossy arrays (saved with lossy=..., within abs bound of the saved values):")
        print(f"  {'key':50} {'mode':6} {'rel bound':>10} {'abs bound':>12} {'max error':>12}")
        for t in lossy:
            assert t.lossy is not None
            print(f"  {_shown(t.key):50} {t.lossy['mode']:6} {t.lossy['rel_bound']:10.3g} "
                  f"{t.lossy['abs_bound']:12.4g} {t.lossy['max_error']:12.4g}")
    return 0


def _shown(text: str) -> str:
    """``text`` for a terminal line: characters that are not printable (a newline, an escape
    sequence's ESC) escaped as Python writes them, so a key cannot forge lines or colours."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..api import verify

    with progress_bar(None, "verifying", quiet=args.quiet) as advance:
        report = verify(args.path, config=args.config, progress=byte_progress(advance), chain=args.chain)
    print(f"{report.path}: OK, {report.chunks} chunks, {report.logical_bytes} logical bytes verified")
    if report.bases:
        how = "verified" if args.chain else "present and unchanged (--chain verifies their chunks)"
        print(f"bases: {', '.join(report.bases)}: {how}")
    return 0


def _cmd_rebase(args: argparse.Namespace) -> int:
    from ..api import rebase
    from ..api.resolve import warn_foreign_extension
    from ..integrations.convert import check_codec
    from ..io.s3 import is_url

    try:
        check_codec(args.codec, "gdsckpt")  # a usage error, as for convert
    except ValueError as err:
        raise UsageError(str(err)) from err
    output = args.output
    if output is not None and not args.overwrite and not is_url(output) and os.path.lexists(output) \
            and not (os.path.exists(args.path) and os.path.exists(output) and os.path.samefile(args.path, output)):
        # as convert: an existing file (a torch.save .pt, another run's checkpoint) is kept
        raise FileExistsError(f"output {output!r} exists; pass --overwrite to replace it")
    if output is not None:
        warn_foreign_extension(output)
    report = rebase(args.path, output, codec=args.codec, config=args.config, force=args.force)
    print(f"{report.path}: full checkpoint, {report.tensors} arrays, {report.file_bytes} bytes, "
          f"ratio {report.ratio:.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gdsckpt`` command."""
    parser = Parser(prog="gdsckpt", description="gdsckpt: save, load, inspect and verify compressed "
                                                "checkpoints of training state; thin subcommands over "
                                                "the library.",
                    epilog="Exit codes: 0 success, 1 the operation failed, 2 bad arguments.")
    parser.add_argument("--version", action="version", version=f"gdsckpt {__version__}",
                        help="print the version and exit")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bars; warnings and errors only")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="log what the library does (INFO) and print the traceback of an error")
    parser.add_argument("--config", metavar="PATH|PRESET", default=None,
                        help=f"a TOML config file, or a preset shipped with gdsckpt ({', '.join(preset_names())}); "
                             f"arguments > this > GDSCKPT_* variables > defaults")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="save, restore and verify a small transformer + AdamW state",
                          description="Save a small GPT-style model and its AdamW state with gdsckpt and "
                                      "with torch.save, restore both, check the restore bit-exact, and "
                                      "print the median ratio and speed of each side over a few rounds. "
                                      "Needs PyTorch: pip install 'gdsckpt[demo]'.")
    demo.add_argument("--width", type=positive_int, default=512, metavar="N",
                      help="the model's hidden size, a multiple of 4 (default 512: about 280 MB of model "
                           "and AdamW state with --depth 6)")
    demo.add_argument("--depth", type=positive_int, default=6, metavar="N",
                      help="transformer blocks (default 6)")
    demo.add_argument("--rounds", type=positive_int, default=3, metavar="N",
                      help="save and load rounds of each side; the medians are printed (default 3)")
    demo.add_argument("--dir", type=nonempty_path, default=None, metavar="DIR",
                      help="directory for the temporary files (default: the system's temporary directory)")
    demo.add_argument("--device", default=None,
                      help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    demo.set_defaults(run=_cmd_demo)
    inspect = sub.add_parser("inspect", help="list a checkpoint's arrays, codecs and ratios",
                             description="List a checkpoint's arrays, codecs and compression ratios, "
                                         "per array and per group; reads the index only.")
    inspect.add_argument("path", type=nonempty_path, metavar="PATH", help="the checkpoint to inspect")
    inspect.add_argument("--json", action="store_true", help="print everything as one JSON document")
    inspect.set_defaults(run=_cmd_inspect)
    verify = sub.add_parser("verify", help="read every chunk and check every checksum",
                            description="Read every chunk of a checkpoint and check every checksum; "
                                        "exit code 1 names the first damaged array and chunk.")
    verify.add_argument("path", type=nonempty_path, metavar="PATH", help="the checkpoint to verify")
    verify.add_argument("--chain", action="store_true",
                        help="for a delta checkpoint, verify every base's chunks too (they are always "
                             "checked to be present and unchanged)")
    verify.set_defaults(run=_cmd_verify)
    rebase = sub.add_parser("rebase", help="turn a delta checkpoint into a full one (resolving its bases)",
                            description="Write a delta checkpoint as a full one, resolving its chain of bases.")
    rebase.add_argument("path", type=nonempty_path, metavar="PATH", help="the delta checkpoint")
    rebase.add_argument("--output", "-o", type=nonempty_path, default=None, metavar="PATH",
                        help="write here instead of replacing PATH (refused if it exists, unless --overwrite)")
    rebase.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    rebase.add_argument("--codec", default="auto", help="codec of the full checkpoint (default: auto)")
    rebase.add_argument("--force", action="store_true",
                        help="replace PATH even when other checkpoints beside it are deltas on it")
    rebase.set_defaults(run=_cmd_rebase)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def _resolve_config(value: str | None) -> Config:
    """The ``Config`` for ``--config`` (over the environment); a bad file or name is a usage error."""
    try:
        return resolve_config(value)
    except (OSError, ValueError) as err:
        # without --config the error is the environment's (a GDSCKPT_* variable names itself)
        raise UsageError(f"--config: {err}" if value is not None else str(err)) from err


def _stdout_closed() -> int:
    """The reader of stdout went away (``gdsckpt inspect f | head``): end quietly. stdout is
    pointed at /dev/null so that the interpreter's final flush does not fail a second time."""
    _discard_stdout()
    return EXIT_STDOUT_CLOSED


class _ClosedStdout(io.TextIOBase):
    """Stands for stdout where the process started with its descriptor closed (``>&-``, where
    ``sys.stdout`` is None): it keeps nothing and remembers whether anything was written, so
    that only a command whose output went nowhere fails (a ``--quiet`` one writes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.lost = self.lost or bool(text)
        return len(text)


def _flushed(command: str | None, code: int) -> int:
    """``code`` once stdout is flushed (inside the caller's error handling: a closed pipe or a
    full disk shows here rather than at the interpreter's exit, where it would be lost), or the
    failure to write it: output that was lost is never a success."""
    if isinstance(sys.stdout, _ClosedStdout):  # started with stdout closed (``main`` put it there)
        if code != 0 or not sys.stdout.lost:
            return code  # it failed and said so (stderr) already, or it wrote nothing
        print_error(command, "cannot write the output: standard output is closed")
        return EXIT_FAILED
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()
    except (OSError, ValueError) as err:  # ENOSPC (/dev/full), EIO, a closed file object
        return _output_lost(command, err)
    return code


def _output_lost(command: str | None, err: Exception) -> int:
    """Say that the output could not be written (one error line) and return ``EXIT_FAILED``."""
    print_error(command, f"cannot write the output: {getattr(err, 'strerror', None) or err}")
    _discard_stdout()
    return EXIT_FAILED


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of what could not be
    written does not fail a second time (with a traceback of its own)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0, 1 failed, 2 bad arguments, 130 interrupted, 141
    stdout closed). Errors are one line, ``gdsckpt <command>: error: <message>``."""
    parser = build_parser()
    closed = sys.stdout is None
    if closed:
        sys.stdout = _ClosedStdout()
    try:
        return _main(parser, argv)
    finally:
        if closed:
            sys.stdout = None


def _main(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """``main`` once stdout is a stream."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:
        if done.code not in (0, None):
            raise
        # --help / --version printed and argparse ends here: their output must reach stdout too
        return _flushed(None, 0)
    except BrokenPipeError:
        return _stdout_closed()
    except OSError as err:  # --help / --version output that could not be written (``Parser``)
        return _output_lost(None, err)
    # The library's records (and an error a subcommand logs) in the command's own line format,
    # for this call only: main() also runs inside other programs' processes (tests).
    logger = logging.getLogger("gdsckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter(args.command))
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if args.verbose and not args.quiet else logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning(args.command)
            return _run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; every failure becomes one error line and an exit code."""
    try:
        args.config = _resolve_config(args.config)
        return _flushed(args.command, int(args.run(args)))
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print_error(args.command, "interrupted")
        return EXIT_INTERRUPTED
    except CommandError as err:
        return _failed(args, err, str(err), err.code)
    except (CheckpointError, OSError) as err:
        return _failed(args, err, str(err), EXIT_FAILED)
    except Exception as err:  # noqa: BLE001 - any other failure is still one line (--verbose: the traceback)
        return _failed(args, err, f"{type(err).__name__}: {err}", EXIT_FAILED)


def _failed(args: argparse.Namespace, err: BaseException, message: str, code: int) -> int:
    """Print the error line (after the traceback with ``--verbose``) and return ``code``."""
    if args.verbose:
        traceback.print_exception(err, file=sys.stderr)
    print_error(args.command, message)
    return code


if __name__ == "__main__":
    sys.exit(main())
