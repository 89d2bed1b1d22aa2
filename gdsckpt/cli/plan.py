"""``gdsckpt plan``: the GPU time, money and storage a training job spends on checkpoints a month,
without gdsckpt, with ``gdsckpt.save``, with DCP ``async_save`` (the asynchronous baseline) and with
gdsckpt's ``save_async`` (model: ``gdsckpt.tools.costmodel``).

The checkpoint is described by a model size (``--params`` with dtypes and optimizer), with the
per-part ratios gdsckpt measured on a GPU (docs/performance.md), or taken from a real checkpoint (``--from PATH``:
its ratios for the ``--params`` model, or with ``--params`` left out its own sizes too).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from decimal import Decimal
from typing import Any

from ..config import Config
from ..errors import CheckpointError
from ..tools import costmodel
from .common import nonempty_path

log = logging.getLogger("gdsckpt")

#: Storage speed when neither ``--storage-gbps`` nor ``Config.storage_gbps`` gives one: about what
#: the local disk of docs/performance.md's GPU figures writes (its raw writes run at 1-2 GB/s),
#: a modest disk, so a plan without a measured speed does not assume fast storage.
DEFAULT_STORAGE_GBPS = 2.0

_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(e[+-]?\d+)?\s*([kmbgt]?)\s*$", re.IGNORECASE)
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h|d)?\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


MAX_COUNT = 10**18
"""The largest parameter count ``plan`` takes (a million times today's largest models)."""
MAX_FIGURE = 1e12
"""The largest price, speed or count the plan takes: its products stay far from overflowing."""
MIN_FIGURE = 1e-6
"""The smallest speed or ratio the plan takes: a speed of 1e-300 GB/s made its times ``inf`` and
its savings ``nan`` (and ``Infinity`` in ``--json``, which is no JSON)."""


def parse_count(text: str) -> int:
    """A positive whole count: ``7000000000``, ``7e9``, ``7B``, ``70M``, ``1.5T``, ``125k``
    (decimal suffixes; B and G both mean 1e9)."""
    match = _COUNT.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (examples: 7e9, 7B, 70M, 125k)")
    try:
        value = Decimal(match.group(1) + (match.group(2) or "")) * _COUNT_UNITS[match.group(3).lower()]
    except ArithmeticError as err:  # decimal.Overflow: an exponent past the context's (1e1000000)
        raise argparse.ArgumentTypeError(f"a count of at most {MAX_COUNT:.0e} is planned, got {text!r}") from err
    if value <= 0 or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a positive whole count: {text!r}")
    if value > MAX_COUNT:  # the plan's arithmetic is in floats: 1e400 would overflow it
        raise argparse.ArgumentTypeError(f"a count of at most {MAX_COUNT:.0e} is planned, got {text!r}")
    return int(value)


MIN_DURATION_S = 1e-3
MAX_DURATION_S = 1e12
"""Durations a plan takes (a millisecond to about 30,000 years)."""


def parse_duration(text: str) -> float:
    """Seconds from ``1800``, ``1800s``, ``30m``, ``2h``, ``1.5h``, ``1d`` (> 0)."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 30m, 2h, 1800s)")
    seconds = float(match.group(1)) * _SECONDS[(match.group(2) or "").lower()]
    # the plan divides and multiplies by it in floats: a 400-digit or 1e-400 interval printed
    # "every inf h" and wrote Infinity into the JSON
    if not MIN_DURATION_S <= seconds <= MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"a duration from {MIN_DURATION_S:g} s to {MAX_DURATION_S:.0e} s "
                                         f"is planned, got {text!r}")
    return seconds


def _number(text: str, cast: type[float | int], noun: str) -> float:
    """``text`` as a finite ``cast`` of at most ``MAX_FIGURE`` (argparse's error naming ``noun``
    otherwise): the plan multiplies these figures in floats, and a price of 1e308 printed
    ``$inf`` and ``NaN`` (JSON no parser accepts)."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    if abs(value) > MAX_FIGURE:
        raise argparse.ArgumentTypeError(f"a figure of at most {MAX_FIGURE:.0e} is planned, got {text!r}")
    return value


def _job_count(text: str) -> int:
    """A positive whole number of GPUs, writers or checkpoints, at most ``MAX_FIGURE``."""
    value = _number(text, float, "a whole number")
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(value)


def _positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    if value < MIN_FIGURE:
        raise argparse.ArgumentTypeError(f"a figure of at least {MIN_FIGURE:.0e} is planned, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _ratio(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected PART=RATIO (e.g. exp_avg=1.19), got {text!r}")
    return name.strip(), _positive_float(value)


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to ``subparsers`` (its ``run`` is ``run_plan``)."""
    ratios = ", ".join(f"{name} {ratio}" for name, ratio in costmodel.MEASURED_RATIOS.items())
    parser = subparsers.add_parser(
        "plan", help="GPU time, money and storage spent on checkpoints a month, with and without gdsckpt",
        description="The GPU time, money and storage a training job spends on checkpoints a month: without "
                    "gdsckpt, with gdsckpt.save, with torch.distributed.checkpoint's async_save (the "
                    "asynchronous baseline) and with gdsckpt's save_async. The checkpoint is described "
                    "by a model size (--params), or taken from a real checkpoint (--from).",
        epilog=f"Measured defaults (docs/performance.md): ratios {ratios}; compression "
               f"{costmodel.PIPELINE_GBPS_PER_GPU} GB/s per GPU; snapshot GB/s "
               f"{costmodel.SNAPSHOT_GBPS}; background slowdown {costmodel.BACKGROUND_SLOWDOWN}; DCP "
               f"async_save staging GB/s {costmodel.DCP_STAGING_GBPS}, its background slowdown "
               f"{costmodel.DCP_BACKGROUND_SLOWDOWN}. "
               f"A month is {costmodel.HOURS_PER_MONTH:.0f} hours.")
    model = parser.add_argument_group("the checkpoint")
    model.add_argument("--params", type=parse_count, help="parameter count (7e9, 7B, 70M)")
    model.add_argument("--weights", choices=("bf16", "fp16", "fp32"), help="dtype of the weights (default bf16)")
    model.add_argument("--master", choices=("fp32", "none"),
                       help="fp32 master copy kept by mixed precision (default: fp32 for bf16/fp16 "
                            "weights, none for fp32 weights)")
    model.add_argument("--optimizer", choices=tuple(costmodel.OPTIMIZER_MOMENTS),
                       help="adamw: 2 fp32 moments, sgd: 1 fp32 momentum buffer (default adamw)")
    model.add_argument("--grads", choices=("none", "bf16", "fp16", "fp32"),
                       help="gradients saved with the state (default none)")
    model.add_argument("--from", dest="from_path", metavar="PATH", type=nonempty_path,
                       help="a gdsckpt checkpoint: its per-part ratios (and, without --params, its sizes)")
    model.add_argument("--ratio", type=_ratio, action="append", default=[], metavar="PART=RATIO",
                       help="override one part's ratio (repeatable), e.g. --ratio exp_avg=1.19")
    job = parser.add_argument_group("the job")
    job.add_argument("--interval", type=parse_duration, default=1800.0,
                     help="time between checkpoints: 30m, 2h, 1800s (default 30m)")
    job.add_argument("--gpus", type=_job_count, default=8, help="GPUs of the job (default 8)")
    job.add_argument("--writers", type=_job_count,
                     help="GPUs that each save a shard (default: all, as DCP/FSDP; 1 for rank 0 only)")
    job.add_argument("--storage-gbps", type=_positive_float,
                     help=f"storage write speed, GB/s, all writers together (default: the config's "
                          f"storage_gbps, else {DEFAULT_STORAGE_GBPS})")
    job.add_argument("--torch-save-gbps", type=_positive_float,
                     help="observed speed of the current save, GB/s (default: the storage's speed)")
    job.add_argument("--gpu-hour-price", type=_non_negative_float, metavar="USD",
                     help="price of one GPU-hour (without it: no money figures)")
    job.add_argument("--keep-last", type=_job_count, default=3, help="checkpoints kept (default 3)")
    figures = parser.add_argument_group("gdsckpt's figures (defaults measured on a GPU: docs/performance.md)")
    figures.add_argument("--snapshot", choices=costmodel.SNAPSHOTS, default="auto",
                                  help="where save_async copies the state (auto: GPU when a shard fits "
                                       "the config's snapshot_gpu_bytes, else pinned host memory)")
    figures.add_argument("--snapshot-gbps", type=_positive_float, help="snapshot copy speed, GB/s")
    figures.add_argument("--pipeline-gbps", type=_positive_float,
                                  default=costmodel.PIPELINE_GBPS_PER_GPU,
                                  help="compression speed of one GPU, GB/s")
    figures.add_argument("--background-slowdown", type=_non_negative_float,
                                  default=costmodel.BACKGROUND_SLOWDOWN,
                                  help="seconds of training lost per second an async save runs behind it")
    figures.add_argument("--dcp-staging", choices=costmodel.DCP_STAGINGS, default="pinned",
                         help="how the DCP async_save baseline stages the state: pinned (pinned memory, "
                              "its fastest measured setup; default) or pageable (DCP's default staging)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run_plan)


class _BadArguments(ValueError):
    """Arguments that parse but do not make a plan (exit code 2)."""


def _parts(args: argparse.Namespace, config: Config) -> tuple[list[costmodel.Part], str]:
    """The checkpoint's parts and a line describing where they come from."""
    model_flags = [flag for flag, value in (("--weights", args.weights), ("--master", args.master),
                                            ("--optimizer", args.optimizer), ("--grads", args.grads))
                   if value is not None]
    if args.params is None and args.from_path is None:
        raise _BadArguments("give --params (the model's parameter count) or --from PATH (a checkpoint)")
    if args.params is None and model_flags:
        raise _BadArguments(f"{', '.join(model_flags)} describe a model given by --params; with --from alone "
                            f"the checkpoint's own parts are used")
    try:
        groups = costmodel.group_sizes(args.from_path, config=config) if args.from_path is not None else None
    except ValueError as err:  # a delta checkpoint: plan from a full one (exit 1, as an unusable file)
        raise CheckpointError(str(err)) from None
    if groups is not None and not any(group.nbytes for group in groups.values()):
        raise _BadArguments(f"checkpoint {args.from_path!r} holds no array bytes to plan with")
    if args.params is None:
        assert groups is not None
        parts = costmodel.parts_from_groups(groups, "measured in this checkpoint")
        described = f"checkpoint {args.from_path} (its own parts and ratios)"
    else:
        weights = args.weights or "bf16"
        # Weights trained in fp32 need no separate master copy; 16-bit ones under mixed precision do.
        master = args.master or ("none" if weights == "fp32" else "fp32")
        try:
            spec = costmodel.ModelSpec(args.params, weights=weights, master=None if master == "none" else master,
                                       optimizer=args.optimizer or "adamw",
                                       grads=None if args.grads in (None, "none") else args.grads)
        except ValueError as err:
            raise _BadArguments(str(err)) from err
        from_checkpoint = costmodel.ratios_from_groups(groups, f"from {args.from_path}") if groups else {}
        if groups is not None and not from_checkpoint:
            expected = sorted(name for names in costmodel.PART_GROUPS.values() for name in names)
            log.warning("no group of %s names a part (its groups: %s; expected: %s): the default ratios "
                        "apply", args.from_path, ", ".join(sorted(groups)), ", ".join(expected))
        parts = costmodel.checkpoint_parts(spec, from_checkpoint)
        optimizer = {"adamw": "AdamW", "sgd": "SGD with momentum", "none": "no optimizer"}[spec.optimizer]
        described = (f"{_count(spec.params)} parameters: {spec.weights} weights, "
                     f"{'fp32 master copy, ' if spec.master else ''}{optimizer}"
                     f"{f', {spec.grads} gradients' if spec.grads else ''}")
    try:
        parts = costmodel.with_ratios(parts, dict(args.ratio), "--ratio")
    except ValueError as err:
        raise _BadArguments(str(err)) from err
    return parts, described


def _job(args: argparse.Namespace, config: Config) -> costmodel.Job:
    storage = args.storage_gbps or config.storage_gbps or DEFAULT_STORAGE_GBPS
    if storage < MIN_FIGURE:  # from the configuration (GDSCKPT_STORAGE_GBPS), not checked by argparse
        raise _BadArguments(f"storage_gbps of the configuration: a figure of at least {MIN_FIGURE:.0e} is "
                            f"planned, got {storage!r}")
    try:
        return costmodel.Job(
            interval_s=args.interval, gpus=args.gpus, storage_gbps=storage, gpu_hour_price=args.gpu_hour_price,
            keep_last=args.keep_last, writers=args.writers, torch_save_gbps=args.torch_save_gbps,
            pipeline_gbps_per_gpu=args.pipeline_gbps, snapshot=args.snapshot, snapshot_gbps=args.snapshot_gbps,
            snapshot_gpu_bytes=config.snapshot_gpu_bytes, background_slowdown=args.background_slowdown,
            dcp_staging=args.dcp_staging)
    except ValueError as err:
        raise _BadArguments(str(err)) from err


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan of ``args`` (a table, or JSON with ``--json``); 0 done, 1 the checkpoint of
    ``--from`` could not be read, 2 arguments that make no plan."""
    config = getattr(args, "config", None) or Config.from_env()
    try:
        parts, described = _parts(args, config)
        result = costmodel.plan(parts, _job(args, config))
    except _BadArguments as err:
        log.error("%s", err)
        return 2
    except (CheckpointError, OSError) as err:
        log.error("%s", err)
        return 1
    for scenario in result.scenarios:
        if scenario.lost_fraction >= 1:
            log.warning("%s: a checkpoint costs %.0f s, more than the %.0f s interval: the job would do "
                        "nothing but checkpoint", scenario.name, scenario.lost_s, result.job.interval_s)
    if args.json:
        doc = result.to_json() | {"checkpoint": described, "from": args.from_path}
        print(json.dumps(doc, indent=2))
    else:
        print(render(result, described, quiet=bool(getattr(args, "quiet", False))))
    return 0


# ---------------------------------------------------------------------------------------------
# the table

def _count(value: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


def _bytes(value: float) -> str:
    if value < 0:
        return f"-{_bytes(-value)}"
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{_sig3(value / scale)} {unit}"
    return f"{value:.0f} B"


def _sig3(value: float) -> str:
    """Three significant figures, without the trailing dot ``#.3g`` leaves on 100-999."""
    return f"{value:.0f}" if value >= 100 else f"{value:#.3g}"


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{_sig3(value / 3600)} h"
    if value >= 60:
        return f"{_sig3(value / 60)} min"
    return f"{_sig3(value)} s" if value >= 0.001 else f"{value * 1000:.2g} ms" if value else "0 s"


def _hours(value: float) -> str:
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:,.0f}" if abs(value) >= 100 else f"${value:,.2f}"


def render(result: costmodel.Plan, described: str, quiet: bool = False) -> str:
    """The plan as text: the checkpoint's parts and the job (left out when ``quiet``), then the
    scenarios side by side, what gdsckpt saves, and what its async save gains over DCP's."""
    job, base = result.job, result.baseline
    logical = costmodel.logical_bytes(result.parts)
    compressed = costmodel.compressed_bytes(result.parts)
    lines = []
    if not quiet:
        lines.append(f"checkpoint of {described}: {_bytes(logical)}, {_bytes(compressed)} compressed "
                     f"(ratio {logical / compressed:.3f})")
        lines.append(f"  {'part':22}{'dtype':>6}{'size':>11}{'ratio':>8}{'stored':>11}  ratio from")
        for part in result.parts:
            lines.append(f"  {part.name:22}{part.dtype:>6}{_bytes(part.nbytes):>11}{part.ratio:>8.3f}"
                         f"{_bytes(part.stored_bytes):>11}  {part.ratio_source}")
        if job.gpus == 1:
            gpus = "1 GPU"
        elif job.shard_writers == job.gpus:
            gpus = f"{job.gpus} GPUs writing a shard each"
        elif job.shard_writers == 1:
            gpus = f"{job.gpus} GPUs (one writing the whole checkpoint)"
        else:
            gpus = f"{job.gpus} GPUs ({job.shard_writers} writing a shard each)"
        lines.append(f"job: a checkpoint every {_seconds(job.interval_s)} ({job.checkpoints_per_month:,.0f} a "
                     f"month of {job.hours_per_month:.0f} h), {gpus}, storage "
                     f"{job.storage_gbps:g} GB/s, {job.keep_last} kept"
                     + ("" if job.torch_save_gbps is None else f", current save {job.torch_save_gbps:g} GB/s")
                     + ("" if job.gpu_hour_price is None else f", ${job.gpu_hour_price:g} a GPU-hour"))
        lines.append("")

    def blocked(s: costmodel.Scenario) -> str:
        if s.snapshot is None:
            return _seconds(s.blocked_s)
        how = "staging" if s.name == costmodel.DCP_ASYNC else "snapshot"
        return f"{_seconds(s.blocked_s)} ({s.snapshot} {how})"

    scenarios = result.scenarios
    rows = [
        ("", *(s.name for s in scenarios)),
        ("stored per checkpoint", *(_bytes(s.stored_bytes) for s in scenarios)),
        ("write time (bound by)", *(f"{_seconds(s.write_s)} ({s.bound})" for s in scenarios)),
        ("training blocked", *(blocked(s) for s in scenarios)),
        ("slowed by the save behind", *(_seconds(s.background_s) if s.snapshot else "-" for s in scenarios)),
        ("share of GPU time lost", *(f"{s.lost_fraction:.2%}" for s in scenarios)),
        ("GPU-hours lost a month", *(_hours(s.gpu_hours_per_month) for s in scenarios)),
        ("cost a month", *(_money(s.cost_per_month) for s in scenarios)),
        (f"storage for {job.keep_last} kept", *(_bytes(s.storage_bytes) for s in scenarios)),
        ("written a month", *(_bytes(s.written_bytes_per_month) for s in scenarios)),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append(f"{row[0]:{widths[0]}}" + "".join(f"  {cell:>{widths[i + 1]}}"
                                                        for i, cell in enumerate(row[1:])))
    for scenario in scenarios:
        if scenario.backlog_s:
            lines.append(f"note: a {scenario.name} save takes longer than the interval; each call waits "
                         f"{_seconds(scenario.backlog_s)} for the previous one")
    for scenario in scenarios:
        if scenario.name.startswith("gdsckpt"):
            lines.append(f"{scenario.name}: {_less(costmodel.spent_less(base, scenario))} than without gdsckpt")
    lines.append(f"gdsckpt async against DCP async_save ({job.dcp_staging} staging), the gain of gdsckpt "
                 f"itself: {_less(result.async_gain())}")
    return "\n".join(lines)


def _less(saved: dict[str, float | None]) -> str:
    """``4.48 GPU-hours ($11.20) a month and 8.40 GB of storage less`` (``more`` where negative)."""
    hours = saved["gpu_hours_per_month"] or 0.0
    cost = saved["cost_per_month"]
    money = "" if cost is None else f" ({_money(abs(cost))})"
    storage = saved["storage_bytes"] or 0.0
    time_text, storage_text = f"{_hours(abs(hours))} GPU-hours{money} a month", f"{_bytes(abs(storage))} of storage"
    if hours >= 0 and storage >= 0:
        return f"{time_text} and {storage_text} less"
    return f"{time_text} {'less' if hours >= 0 else 'more'} and {storage_text} {'less' if storage >= 0 else 'more'}"
