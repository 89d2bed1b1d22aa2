"""``gdsckpt bench``: the storage-throughput benchmark, for the storage a checkpoint will live on.

Argument parsing and printing over ``gdsckpt.tools.storagebench`` (which measures). Exit codes: 0
every configuration that ran loaded bit-exact (skipped ones are listed with why); 1 a
configuration failed, none ran at all, or a target is missing or not writable; 2 bad arguments (a
target without room for ``--size`` included); 130 interrupted (every file the benchmark wrote is
removed first).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..codecs import known_codec_names
from ..config import MAX_THREADS, Config, parse_size
from ..io.posix import write_atomically
from ..tools import storagebench as sb
from .common import nonempty_path, require_module, signals_interrupt
from .progress import progress_bar

logger = logging.getLogger("gdsckpt")

DESCRIPTION = """\
Measure what a storage target does with checkpoints, on the same synthetic training state (bf16 +
fp32 weights and AdamW moments) for every side: raw writes and reads through gdsckpt's I/O
backends (host memory with POSIX / O_DIRECT; with CUDA also GPU memory with kvikio), gdsckpt save
and load for each codec x chunk size x thread count x depth, the pipeline alone (gdsckpt-null: the
first codec into a null sink and from a null source, storage taken out), and torch.save / safetensors. Saves
are durable (fsync inside the timing), loads cold (the file is dropped from the page cache first;
a remote or virtual disk may still cache) and then warm (the same load again, from the page cache),
each figure the median of --repeats round-robin runs, every load checked bit for bit. Prints a
table with each gdsckpt figure over ratio x raw I/O of the same target (give /dev/shm as a
--target for a tmpfs tier); writes JSON and PNG plots to --out; --recommend writes the fastest
lossless configuration as a gdsckpt.Config preset (TOML) and notes any baseline that was faster."""


# ---------------------------------------------------------------------------------------------
# argument types (argparse turns their errors into exit code 2)

def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _chunk_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(dict.fromkeys(_size(item) for item in _items(text)))  # "1MiB,1024KiB" is one size
    for size in sizes:
        if size % 4096 or size > 1 << 30:
            raise argparse.ArgumentTypeError(f"chunk size {sb.format_size(size)} is invalid (expected a "
                                             f"multiple of 4096 between 4KiB and 1GiB)")
    return sizes


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(item) for item in _items(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return tuple(dict.fromkeys(values))  # a value given twice is one configuration, measured once


def _thread_counts(text: str) -> tuple[int, ...]:
    counts = _counts(text)
    if any(count > MAX_THREADS for count in counts):
        raise argparse.ArgumentTypeError(f"thread counts must be at most {MAX_THREADS}, got {text!r}")
    return counts


def _depths(text: str) -> tuple[int | None, ...]:
    return tuple(dict.fromkeys(None if item == "default" else _counts(item)[0] for item in _items(text)))


def _codecs(text: str) -> tuple[str, ...]:
    codecs = tuple(dict.fromkeys(_items(text)))
    for codec in codecs:
        if codec not in known_codec_names():
            raise argparse.ArgumentTypeError(f"codec {codec!r} is invalid (expected one of: "
                                             f"{', '.join(known_codec_names())})")
    return codecs


def _baselines(text: str) -> tuple[str, ...]:
    if text.strip() == "none":
        return ()
    names = tuple(dict.fromkeys(_items(text)))
    for name in names:
        if name not in sb.BASELINES:
            raise argparse.ArgumentTypeError(f"baseline {name!r} is invalid (expected one of: "
                                             f"{', '.join(sb.BASELINES)}, or none)")
    return names


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < math.inf:  # inf would be written to bench.json as Infinity, which is no JSON
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _repeats(text: str) -> int:
    return _counts(text)[0]


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to ``subparsers`` (``parser.add_subparsers()``)."""
    parser = subparsers.add_parser("bench", description=DESCRIPTION,
                                   help="measure storage throughput: raw I/O, gdsckpt, torch, safetensors",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", required=True, metavar="DIR", type=nonempty_path,
                        help="directory on the storage to measure (repeatable: local NVMe, a shared "
                             "filesystem, tmpfs, ...)")
    parser.add_argument("--size", type=_size, default=sb.GIB, metavar="SIZE",
                        help="bytes of training state per measurement (default 1GiB)")
    parser.add_argument("--codecs", type=_codecs, default=sb.DEFAULT_CODECS, metavar="LIST",
                        help=f"gdsckpt codecs (default {','.join(sb.DEFAULT_CODECS)}; known: "
                             f"{', '.join(known_codec_names())}; GPU-only ones run with CUDA only)")
    parser.add_argument("--chunk-sizes", type=_chunk_sizes, default=(4 << 20, 16 << 20), metavar="LIST",
                        help="chunk sizes of gdsckpt and block sizes of raw I/O (default 4MiB,16MiB; "
                             "the GPU engine takes at most 16MiB)")
    parser.add_argument("--threads", type=_thread_counts, default=sb.default_thread_counts(), metavar="LIST",
                        help="I/O threads: io_threads, and kvikio_threads on the GPU (default: "
                             "min(8, cores),16)")
    parser.add_argument("--depth", type=_depths, default=(None,), metavar="LIST",
                        help="chunks in flight: max_inflight_bytes (CPU) / max_staging_bytes (GPU) = depth x "
                             "chunk size; 'default' keeps the config's budgets (default: default)")
    parser.add_argument("--repeats", type=_repeats, default=3, metavar="N",
                        help="runs of each configuration; the median is reported (default 3)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                        help="cpu: host memory only; cuda: also GPU memory (kvikio, GPU engine); auto: cuda "
                             "when usable (default)")
    parser.add_argument("--baselines", type=_baselines, default=sb.BASELINES, metavar="LIST",
                        help="torch,safetensors (default) or none")
    parser.add_argument("--max-seconds", type=_seconds, default=None, metavar="S",
                        help="time budget for the measurements, shared over the targets: what is not "
                             "measured by then is skipped, partial repeats are kept (default: none)")
    parser.add_argument("--out", type=nonempty_path, default=None, metavar="DIR",
                        help="directory for bench.json and the PNG plots (default ./gdsckpt-bench-<time>)")
    parser.add_argument("--recommend", action="store_true",
                        help="print the fastest lossless configuration of each target and write it as a "
                             "config preset")
    parser.add_argument("--preset-out", type=nonempty_path, default=None, metavar="PATH",
                        help="where --recommend writes the TOML preset (default <out>/preset-{target}.toml; "
                             "{target} is replaced by the target's name, needed with several targets)")
    parser.set_defaults(run=run)


# ---------------------------------------------------------------------------------------------
# running

def _writable_destination(path: Path) -> bool:
    """``path`` can be created (its nearest existing ancestor is a writable directory) or written.
    A dangling symlink on the way counts as existing (lexists): ``mkdir`` cannot create it."""
    probe = path
    while not os.path.lexists(probe):
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def _sigterm_as_interrupt() -> Any:
    """``signals_interrupt`` marking ``storagebench.INTERRUPTED``, which the runner reads when a
    configuration fails (an interrupt a library turned into its own error ends the run)."""
    return signals_interrupt(sb.INTERRUPTED)


def _progress(total: int, quiet: bool) -> Any:
    if progress_bar is None:
        return nullcontext(lambda _n: None)
    return progress_bar(total, "bench", quiet=quiet)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed ``args`` describe; returns the exit code (errors are logged to
    the ``gdsckpt`` logger, one line each). Raises ``CommandError`` where PyTorch is not installed."""
    # The synthetic training state and the torch/safetensors baselines are torch tensors.
    require_module("torch", extra="bench", needed_by="the benchmark")
    base = getattr(args, "config", None) or Config.from_env()
    try:
        settings = sb.BenchSettings(size_bytes=args.size, codecs=tuple(args.codecs),
                                    chunk_sizes=tuple(args.chunk_sizes), threads=tuple(args.threads),
                                    depths=tuple(args.depth), repeats=args.repeats,
                                    device=sb.resolve_device(args.device), baselines=tuple(args.baselines),
                                    config=base, max_seconds=args.max_seconds)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    out = Path(args.out) if args.out else Path(f"gdsckpt-bench-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    preset_pattern = args.preset_out or str(out / "preset-{target}.toml")
    problem = None
    if not _writable_destination(out):
        problem = f"--out {str(out)!r} cannot be created here"
    elif args.recommend and len(args.target) > 1 and "{target}" not in preset_pattern:
        problem = "with several targets, --preset-out needs '{target}' in it (one preset per target)"
    elif args.recommend and (not _writable_destination(Path(preset_pattern).parent)
                             or Path(preset_pattern.replace("{target}", "x")).is_dir()):
        problem = f"--preset-out {preset_pattern!r} cannot be written (a directory, or no writable parent)"
    if problem:
        logger.error("%s", problem)
        return 2

    quiet = bool(getattr(args, "quiet", False))
    try:
        total = sb.progress_total(settings, len(args.target))
        with _sigterm_as_interrupt(), _progress(total, quiet) as advance:
            report = sb.run_benchmark(settings, args.target, advance=advance)
    except sb.InsufficientSpaceError as err:
        logger.error("%s", err)
        return 2
    except (FileNotFoundError, NotADirectoryError, PermissionError) as err:
        logger.error("%s", err)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted; every file the benchmark wrote has been removed")
        return 130

    recommendations = [sb.recommend(target) for target in report.targets] if args.recommend else []
    for target, recommendation in zip(report.targets, recommendations):
        target.recommendation = recommendation
    # The table first: what the run measured is printed even where --out cannot take the files.
    print(format_report(report), flush=True)
    json_path = out / "bench.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        # default=str: a figure of a library (a NumPy scalar in a report) must not lose the whole
        # run; written whole or not at all (a full disk left an empty bench.json)
        write_atomically(json_path, (json.dumps(report.to_json(), indent=1, default=str) + "\n").encode(),
                         fsync=False)
        plots = sb.write_plots(report, out)
    except OSError as err:
        logger.error("cannot write the results to %s: %s", out, getattr(err, "strerror", None) or err)
        return 1
    print(f"wrote {json_path}" + "".join(f"\nwrote {plot}" for plot in plots))
    status = 0 if report.all_ok else 1
    if not any(m.status == "ok" for target in report.targets for m in target.measurements):
        # every configuration skipped (the time budget, codecs this machine lacks): no figure to read
        logger.error("no configuration was measured (each skipped: see the table's reasons)")
        status = 1
    for number, (target, recommendation) in enumerate(zip(report.targets, recommendations), 1):
        if recommendation is None:
            logger.error("no lossless gdsckpt configuration ran on %s: nothing to recommend",
                         target.path)
            status = 1
            continue
        preset = Path(preset_pattern.replace("{target}", sb.target_slug(number, target.path)))
        try:
            preset.parent.mkdir(parents=True, exist_ok=True)
            # whole or not at all, like bench.json: a full disk left an empty preset, which
            # Config.from_toml reads as no settings
            write_atomically(preset, sb.preset_toml(recommendation, report).encode(), fsync=False)
        except OSError as err:
            logger.error("cannot write the preset %s: %s", preset, getattr(err, "strerror", None) or err)
            status = 1
            continue
        print(format_recommendation(recommendation, preset))
    return status


# ---------------------------------------------------------------------------------------------
# printing

def _figure(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(report: sb.BenchReport) -> str:
    """The results as a table per target, with how they were measured."""
    settings = report.settings
    lines = [(f"gdsckpt bench: {sb.human_size(report.data['logical_bytes'])} synthetic training state "
              f"({report.data['tensors']} tensors, bf16 + fp32), device {settings.device}, median of "
              f"{settings.repeats}, {report.seconds:.0f} s")]
    header = (f"  {'what':12}{'engine':>7}{'codec':>7}{'chunk':>8}{'thr':>5}{'depth':>8}{'ratio':>8}"
              f"{'save GB/s':>11}{'load GB/s':>11}{'warm GB/s':>11}  notes")
    for target in report.targets:
        fs = target.filesystem
        lines += ["", (f"{target.path}: {fs['type']} on {fs['device']} (mounted at {fs['mount_point']}), "
                       f"{sb.human_size(target.free_bytes)} free"), header]
        for m in target.measurements:
            depth = "-" if m.kind != "gdsckpt" else ("default" if m.depth is None else str(m.depth))
            notes = m.backend or ""
            if m.status != "ok":
                notes = f"{m.status}: {m.reason}"
            elif m.reason:  # measured fewer times than the header's median says
                notes += f" {m.reason}"
            elif m.bit_exact is False:
                notes += " NOT BIT-EXACT"
            fractions = sb.limit_fractions(target, m) if m.status == "ok" else None
            if fractions:
                notes += " x limit " + "/".join(f"{fractions.get(what, float('nan')):.2f}"
                                                for what in ("save", "load", "warm_load"))
            lines.append(f"  {m.path:12}{m.engine or '-':>7}{m.codec or '-':>7}"
                         f"{sb.format_size(m.chunk_bytes) if m.chunk_bytes else '-':>8}{m.threads or '-':>5}"
                         f"{depth:>8}{_figure(m.ratio):>8}{_figure(m.save_gbps):>11}"
                         f"{_figure(m.load_gbps):>11}{_figure(m.warm_load_gbps):>11}"
                         f"  {notes}")
    ran = report.ran()
    lines += ["", "ran: " + ", ".join(name for name, done in ran.items() if done)
              + ("; not run: " + ", ".join(name for name, done in ran.items() if not done)
                 if not all(ran.values()) else ""),
              (f"GB/s: 10^9 logical tensor bytes per second; saves durable (fsync in the timing); "
               f"loads cold: {sb.COLD_READ_NOTE}; warm: the same load again, the file in the page cache."),
              ("x limit: save/cold/warm as a fraction of ratio x raw I/O on the same target (1.00: as "
               "fast as reading or writing the compressed bytes at the storage's raw speed).")]
    return "\n".join(lines)


def format_recommendation(recommendation: sb.Recommendation, preset: Path) -> str:
    """What ``--recommend`` prints for one target."""
    m = recommendation.measurement
    settings = ", ".join(f"{name} = {sb.format_size(value) if name.endswith('_bytes') else value}"
                         for name, value in recommendation.fields.items())
    beaten = "".join(f"\n  note: {statement}" for statement in recommendation.baselines_faster)
    return (f"\nrecommended for {recommendation.target} ({recommendation.engine} engine): {settings}\n"
            f"  save {m.save_gbps:.3f} GB/s, load {m.load_gbps:.3f} GB/s, ratio {m.ratio:.3f}\n"
            f"  why: {recommendation.reason}{beaten}\n"
            f"  preset written to {preset} (gdsckpt.Config.from_toml)")

