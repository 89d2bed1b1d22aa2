"""``gdsckpt`` / ``python -m gdsckpt``: thin subcommands over the library.

Exit codes: 0 success, 1 the operation failed (e.g. a corrupt checkpoint), 2 bad arguments.
Global options (before the subcommand): ``--quiet`` (no progress bars, warnings only),
``--verbose`` (the library's INFO log), ``--config PATH`` (a TOML preset, see
docs/configuration.md). Long operations draw a progress bar on a terminal only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ..codecs import CONVERT_TO_PORTABLE
from ..config import Config, resolve_config
from ..errors import CheckpointError
from ..tools.costmodel import group_of
from .progress import byte_progress, progress_bar

_SUBCOMMAND_MODULES: tuple[str, ...] = ("bench", "convert", "plan")
"""Modules of ``gdsckpt.cli`` that add a subcommand through ``register(subparsers)``."""


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..tools.demo import run_demo

    figures = run_demo(width=args.width, depth=args.depth, directory=args.dir, device=args.device)
    return 0 if figures["bit_exact"] else 1


def group_totals(tensors: Any) -> dict[str, dict[str, Any]]:
    """Per group (``gdsckpt.tools.costmodel.group_of``): arrays, logical bytes, stored bytes and ratio."""
    groups: dict[str, dict[str, Any]] = {}
    for t in tensors:
        if t.alias_of is not None:
            continue
        group = groups.setdefault(group_of(t.key), {"arrays": 0, "logical_bytes": 0, "stored_bytes": 0})
        group["arrays"] += 1
        group["logical_bytes"] += t.nbytes
        group["stored_bytes"] += t.stored_bytes
    for group in groups.values():
        group["ratio"] = group["logical_bytes"] / group["stored_bytes"] if group["stored_bytes"] else 0.0
    return groups


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..api import inspect

    info = inspect(args.path, config=args.config)
    groups = group_totals(info.tensors)
    if args.json:
        print(json.dumps({
            "path": info.path, "format_version": list(info.format_version), "writer": info.writer,
            "file_bytes": info.file_bytes, "logical_bytes": info.logical_bytes, "ratio": info.ratio,
            "codecs": info.codecs, "portable": info.portable, "gpu_only": list(info.gpu_only),
            "groups": groups, "base": info.base,
            "tensors": [{"key": t.key, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
                         "device": t.device, "nbytes": t.nbytes, "stored_bytes": t.stored_bytes,
                         "codecs": list(t.codecs), "alias_of": t.alias_of, "lossy": t.lossy,
                         "delta": t.delta}
                        for t in info.tensors],
        }, indent=2))
        return 0
    print(f"{info.path}: format {info.format_version[0]}.{info.format_version[1]}, written by {info.writer}")
    print(f"{len(info.tensors)} arrays, {info.logical_bytes} logical bytes, {info.file_bytes} bytes on disk, "
          f"ratio {info.ratio:.3f}")
    if info.portable:
        print("portable: every chunk decodes without a GPU")
    else:
        print(f"not portable: {', '.join(info.gpu_only)} decode only on an NVIDIA GPU with nvCOMP; "
              f"{CONVERT_TO_PORTABLE}")
    if info.base is not None:
        deltas = sum(t.delta for t in info.tensors)
        print(f"delta checkpoint: {deltas} arrays stored as the XOR with base {info.base['path']!r} "
              f"(chain depth {info.base['depth']}; 'gdsckpt rebase' writes it in full)")
    print(f"  {'key':50} {'dtype':10} {'shape':20} {'stored':>12} {'ratio':>6}  codecs")
    for t in info.tensors:
        ratio = t.nbytes / t.stored_bytes if t.stored_bytes else 0.0
        codecs = ",".join(t.codecs) or (f"alias of {t.alias_of}" if t.alias_of else "-")
        print(f"  {t.key:50} {t.dtype:10} {list(t.shape)!s:20} {t.stored_bytes:12} {ratio:6.3f}  {codecs}")
    print(f"  {'group':30} {'arrays':>7} {'logical bytes':>15} {'stored bytes':>15} {'ratio':>6}")
    for name, group in groups.items():
        print(f"  {name:30} {group['arrays']:7} {group['logical_bytes']:15} {group['stored_bytes']:15} "
              f"{group['ratio']:6.3f}")
    print(f"  {'total':30} {sum(g['arrays'] for g in groups.values()):7} {info.logical_bytes:15} "
          f"{info.file_bytes:15} {info.ratio:6.3f}")
    lossy = [t for t in info.tensors if t.lossy is not None]
    if lossy:
        print(f"{len(lossy)} lossy arrays (saved with lossy=..., within abs bound of the saved values):")
        print(f"  {'key':50} {'mode':6} {'rel bound':>10} {'abs bound':>12} {'max error':>12}")
        for t in lossy:
            assert t.lossy is not None
            print(f"  {t.key:50} {t.lossy['mode']:6} {t.lossy['rel_bound']:10.3g} "
                  f"{t.lossy['abs_bound']:12.4g} {t.lossy['max_error']:12.4g}")
    return 0


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

    report = rebase(args.path, args.output, codec=args.codec, config=args.config, force=args.force)
    print(f"{report.path}: full checkpoint, {report.tensors} arrays, {report.stored_bytes} bytes, "
          f"ratio {report.ratio:.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gdsckpt`` command."""
    parser = argparse.ArgumentParser(prog="gdsckpt", description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bars; warnings and errors only")
    parser.add_argument("--verbose", "-v", action="store_true", help="log what the library does (INFO)")
    parser.add_argument("--config", metavar="PATH", default=None,
                        help="TOML preset (configs/*.toml); arguments > this file > GDSCKPT_* > defaults")
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
    verify.add_argument("--chain", action="store_true",
                        help="for a delta checkpoint, verify every base's chunks too (they are always "
                             "checked to be present and unchanged)")
    verify.set_defaults(run=_cmd_verify)
    rebase = sub.add_parser("rebase", help="turn a delta checkpoint into a full one (resolving its bases)")
    rebase.add_argument("path")
    rebase.add_argument("--output", "-o", default=None, help="write here instead of replacing PATH")
    rebase.add_argument("--codec", default="auto", help="codec of the full checkpoint (default: auto)")
    rebase.add_argument("--force", action="store_true",
                        help="replace PATH even when other checkpoints beside it are deltas on it")
    rebase.set_defaults(run=_cmd_rebase)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def _resolve_config(parser: argparse.ArgumentParser, path: str | None) -> Config:
    """The ``Config`` for ``--config`` (over the environment); a bad file is a usage error."""
    try:
        return resolve_config(path)
    except (OSError, ValueError) as err:
        parser.error(f"--config: {err}")
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="gdsckpt: %(levelname)s: %(message)s", stream=sys.stderr,
                        level=logging.INFO if args.verbose and not args.quiet else logging.WARNING)
    args.config = _resolve_config(parser, args.config)
    try:
        return int(args.run(args))
    except (CheckpointError, FileNotFoundError, IsADirectoryError, PermissionError) as err:
        print(f"gdsckpt {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
