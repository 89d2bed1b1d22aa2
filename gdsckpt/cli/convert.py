"""``gdsckpt convert SRC DST``: convert between torch pickles, safetensors and gdsckpt.

Formats come from the extensions (``.pt``/``.pth``/``.bin``, ``.safetensors``, ``.gdsckpt``) or
from ``--from`` / ``--to``. Exit codes: 0 converted, 1 the conversion failed (unreadable or unsafe
source, content the destination cannot hold, existing destination without ``--overwrite``, a
destination that deltas use as their base without ``--force``), 2 bad
arguments. What each format keeps is described in ``gdsckpt.convert``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CheckpointError
from ..integrations.convert import FORMATS, ConvertReport, check_codec, convert, detect_format
from .common import CommandError, nonempty_path, print_error


def register(subparsers: Any) -> None:
    """Add the ``convert`` subcommand to the ``gdsckpt`` parser's subparsers."""
    parser = subparsers.add_parser(
        "convert", help="convert between .pt/.pth/.bin, .safetensors and .gdsckpt, bit-exact",
        description="Convert a checkpoint between torch pickles (.pt/.pth/.bin, read only with "
                    "torch.load(weights_only=True)), safetensors and gdsckpt, bit-exact.")
    parser.add_argument("src", type=nonempty_path, help="the checkpoint to read")
    parser.add_argument("dst", type=nonempty_path,
                        help="the file to write (refused if it exists, unless --overwrite)")
    parser.add_argument("--from", dest="src_format", choices=FORMATS, default=None,
                        help="format of SRC (default: from its extension)")
    parser.add_argument("--to", dest="dst_format", choices=FORMATS, default=None,
                        help="format of DST (default: from its extension)")
    parser.add_argument("--codec", default="auto",
                        help="codec of a gdsckpt DST: auto, zstd, lz4, deflate, none, ... (default: auto)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--force", action="store_true",
                        help="with --overwrite: replace DST even where delta checkpoints use it as "
                             "their base (they become unloadable)")
    parser.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """Run ``gdsckpt convert``; returns the exit code."""
    try:
        dst_format = detect_format(args.dst, args.dst_format)
        detect_format(args.src, args.src_format)
        check_codec(args.codec, dst_format)
    except ValueError as err:
        _error(str(err))
        return 2
    quiet = bool(getattr(args, "quiet", False))
    with _progress(quiet) as progress:
        try:
            report = convert(args.src, args.dst, codec=args.codec, config=getattr(args, "config", None),
                             src_format=args.src_format, dst_format=args.dst_format,
                             overwrite=args.overwrite, progress=progress, force=args.force)
        except (CheckpointError, OSError, ValueError, TypeError) as err:
            # one line from ``main``, after the traceback under --verbose
            raise CommandError(str(err)) from err
    if not quiet:
        print(_summary(report))
    return 0


def _summary(report: ConvertReport) -> str:
    """The one line a successful conversion prints."""
    codec = f", codec {report.codec}" if report.codec else ""
    cloned = f", {report.cloned} shared tensor(s) written as copies" if report.cloned else ""
    ratio = report.logical_bytes / report.dst_bytes if report.dst_bytes else 0.0
    return (f"{report.src} ({report.src_format}) -> {report.dst} ({report.dst_format}): "
            f"{report.tensors} tensors, {report.logical_bytes} logical bytes, {report.dst_bytes} bytes "
            f"on disk (ratio {ratio:.3f}){codec}{cloned}, {report.seconds:.2f} s")


def _error(message: str) -> None:
    print_error("convert", message)


@contextlib.contextmanager
def _progress(quiet: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing the shared progress bar (its total is known
    only once the source is read); None where this build has no progress helper."""
    try:
        from .progress import byte_progress, progress_bar
    except ImportError:  # an older build without the helper
        yield None
        return
    with progress_bar(None, "converting", quiet=quiet) as advance:
        yield byte_progress(advance)
