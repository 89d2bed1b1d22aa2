"""``gdsckpt`` / ``python -m gdsckpt``: thin subcommands over the library.

Exit codes: 0 success, 1 the operation failed (e.g. a corrupt checkpoint), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ..errors import CheckpointError


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    figures = run_demo(width=args.width, depth=args.depth, directory=args.dir, device=args.device)
    return 0 if figures["bit_exact"] else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .. import inspect

    info = inspect(args.path)
    if args.json:
        print(json.dumps({
            "path": info.path, "format_version": list(info.format_version), "writer": info.writer,
            "file_bytes": info.file_bytes, "logical_bytes": info.logical_bytes, "ratio": info.ratio,
            "codecs": info.codecs,
            "tensors": [{"key": t.key, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
                         "device": t.device, "nbytes": t.nbytes, "stored_bytes": t.stored_bytes,
                         "codecs": list(t.codecs), "alias_of": t.alias_of} for t in info.tensors],
        }, indent=2))
        return 0
    print(f"{info.path}: format {info.format_version[0]}.{info.format_version[1]}, written by {info.writer}")
    print(f"{len(info.tensors)} arrays, {info.logical_bytes} logical bytes, {info.file_bytes} bytes on disk, "
          f"ratio {info.ratio:.3f}")
    for t in info.tensors:
        ratio = t.nbytes / t.stored_bytes if t.stored_bytes else 0.0
        codecs = ",".join(t.codecs) or (f"alias of {t.alias_of}" if t.alias_of else "-")
        print(f"  {t.key:50} {t.dtype:10} {str(list(t.shape)):20} {ratio:6.3f}  {codecs}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .. import verify

    report = verify(args.path)
    print(f"{report.path}: OK, {report.chunks} chunks, {report.logical_bytes} logical bytes verified")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gdsckpt`` command."""
    parser = argparse.ArgumentParser(prog="gdsckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="save, restore and verify a small transformer + AdamW state")
    demo.add_argument("--width", type=int, default=512)
    demo.add_argument("--depth", type=int, default=6)
    demo.add_argument("--dir", default=None, help="directory for the temporary files")
    demo.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    demo.set_defaults(run=_cmd_demo)
    inspect = sub.add_parser("inspect", help="list a checkpoint's arrays, codecs and ratios")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(run=_cmd_inspect)
    verify = sub.add_parser("verify", help="read every chunk and check every checksum")
    verify.add_argument("path")
    verify.set_defaults(run=_cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (CheckpointError, FileNotFoundError, IsADirectoryError, PermissionError) as err:
        print(f"gdsckpt {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
