"""From results to advice: the recommended configuration of a target, its preset, and the plots.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from ...codecs import PORTABLE_CODECS
from ...version import __version__
from .results import (
    COLD_READ_METHOD,
    RATIO_TIE,
    SAVE_TIE,
    BenchReport,
    Measurement,
    Recommendation,
    TargetResult,
    format_size,
    human_size,
)

logger = logging.getLogger("gdsckpt")



# ---------------------------------------------------------------------------------------------
# the recommendation

def recommend(result: TargetResult, engine: str | None = None) -> Recommendation | None:
    """The fastest lossless gdsckpt configuration of ``result`` by durable save throughput.

    Saves within ``SAVE_TIE`` of the fastest count as a tie (run-to-run noise); among those the
    best ratio wins (fewer bytes stored), and among ratios within ``RATIO_TIE`` the fastest cold
    load. ``engine``: ``gpu`` or ``cpu`` (default: ``gpu`` when it ran, else ``cpu``). Only
    configurations that ran in every round and loaded bit-exact qualify (where the time budget
    ended the rounds early, every round any configuration ran: one measured once is not weighed
    against medians of several); None when none did."""
    ok = [m for m in result.measurements
          if m.kind == "gdsckpt" and m.status == "ok" and m.bit_exact and m.lossless and m.save_seconds]
    if engine is None:
        engine = "gpu" if any(m.engine == "gpu" for m in ok) else "cpu"
    candidates = [m for m in ok if m.engine == engine]
    if not candidates:
        return None
    rounds = max(len(m.save_seconds) for m in candidates)
    candidates = [m for m in candidates if len(m.save_seconds) == rounds]
    fastest = max(m.save_gbps or 0.0 for m in candidates)
    tied = [m for m in candidates if (m.save_gbps or 0.0) >= fastest * (1 - SAVE_TIE)]
    best_ratio = max(m.ratio or 0.0 for m in tied)
    tied_ratio = [m for m in tied if (m.ratio or 0.0) >= best_ratio * (1 - RATIO_TIE)]
    chosen = max(tied_ratio, key=lambda m: m.load_gbps or 0.0)
    reason = (f"fastest durable save of {len(candidates)} lossless {engine}-engine configurations "
              f"({fastest:.3f} GB/s)")
    if len(tied) > 1:
        reason += (f"; {len(tied)} saved within {SAVE_TIE:.0%} of it (run-to-run noise), of which this one "
                   f"stores the fewest bytes (ratio {chosen.ratio:.3f})")
        if len(tied_ratio) > 1:
            reason += (f" and, among ratios within {RATIO_TIE:.0%}, loads fastest "
                       f"({chosen.load_gbps:.3f} GB/s)")

    raw_path = "raw-kvikio" if engine == "gpu" else "raw-posix"
    raws = [m for m in result.measurements if m.path == raw_path and m.status == "ok" and m.save_seconds]
    same = [m for m in raws if m.chunk_bytes == chosen.chunk_bytes and m.threads == chosen.threads]
    raw = same[0] if same else (max(raws, key=lambda m: m.save_gbps or 0.0) if raws else None)
    assert chosen.chunk_bytes is not None and chosen.threads is not None and chosen.codec is not None
    fields: dict[str, Any] = {"codec": chosen.codec}
    if engine == "gpu":
        fields.update(gpu_chunk_bytes=chosen.chunk_bytes, kvikio_threads=chosen.threads,
                      io_threads=chosen.threads, max_staging_bytes=chosen.inflight_bytes)
    else:
        fields.update(chunk_bytes=chosen.chunk_bytes, io_threads=chosen.threads,
                      max_inflight_bytes=chosen.inflight_bytes)
    if engine == "gpu" and chosen.codec not in PORTABLE_CODECS and chosen.codec != "auto":
        # a GPU-only codec (ANS, ...) under engine "auto" would send a state in host memory to the
        # CPU engine, which cannot encode it: with "gpu" every save compresses on the GPU
        fields["engine"] = "gpu"
    if raw is not None and raw.save_gbps:
        # what codec="auto" weighs compression against: the storage's durable write speed, as
        # measured here at the chosen block size and thread count
        # four significant figures: a slow or tiny run's speed rounded to places was 0.0, which
        # the preset's own Config then refused (storage_gbps must be > 0)
        fields["storage_gbps"] = float(f"{raw.save_gbps:.4g}")
    return Recommendation(result.path, engine, fields, chosen, raw.save_gbps if raw else None,
                          raw.load_gbps if raw else None, reason, baselines_beating(result, chosen))


def limit_fractions(result: TargetResult, m: Measurement) -> dict[str, float] | None:
    """Each figure of a gdsckpt measurement over its limit, ratio x raw I/O of the same target and
    device (the raw run of the same block size and threads, else the fastest): ``save``,
    ``load`` (cold) and ``warm_load``; None where no raw I/O ran."""
    raws = [r for r in result.measurements if r.kind == "raw" and r.device == m.device and r.status == "ok"]
    if m.kind != "gdsckpt" or not raws or not m.ratio:
        return None
    same = [r for r in raws if r.chunk_bytes == m.chunk_bytes and r.threads == m.threads]
    fractions = {}
    for what in ("save", "load", "warm_load"):
        mine = getattr(m, f"{what}_gbps")
        # the storage's speed: the bytes raw I/O moved (its file, padded to whole pages) per second,
        # not its logical bytes (a state of 100 bytes is a 4 KiB raw file)
        raw = max((getattr(r, f"{what}_gbps") or 0.0) / (r.ratio or 1.0) for r in (same or raws))
        if mine and raw:
            fractions[what] = mine / (m.ratio * raw)
    return fractions


def baselines_beating(result: TargetResult, chosen: Measurement) -> list[str]:
    """Plain statements of every baseline that saved or loaded faster than ``chosen`` on this
    target, in the same run, with the likely reason: a user must not take the recommendation for
    a claim that gdsckpt wins there."""
    statements = []
    for m in result.measurements:
        if m.kind != "baseline" or m.status != "ok":
            continue
        for what, theirs, mine in (("saved", m.save_gbps, chosen.save_gbps), ("loaded", m.load_gbps, chosen.load_gbps)):
            if theirs is None or mine is None or theirs <= mine:
                continue
            if chosen.engine == "cpu" and (chosen.ratio or 1.0) > 1.0:
                why = (f"the {chosen.codec} codec on the CPU's cores is slower than this storage, so the "
                       f"{chosen.ratio:.2f}x fewer bytes do not pay for the time spent compressing")
            elif chosen.engine == "cpu":
                why = "with no compression to gain, the pipeline's per-chunk work is pure overhead here"
            else:
                why = "the storage here is faster than the GPU pipeline's restore of this state"
            statements.append(f"{m.path} {what} faster than the recommendation ({theirs:.3f} against "
                              f"{mine:.3f} GB/s): {why}")
    return statements


def preset_toml(recommendation: Recommendation, report: BenchReport) -> str:
    """The recommendation as a TOML preset: flat top-level keys named like ``gdsckpt.Config``
    fields (sizes as ``"4MiB"`` strings), under a comment header saying where the figures came from."""
    m = recommendation.measurement
    target = next(t for t in report.targets if t.path == recommendation.target)
    fs = target.filesystem

    def clean(text: str) -> str:  # a comment ends at a newline: keep paths from starting new lines
        return text.replace("\n", " ").replace("\r", " ")

    lines = [
        "# gdsckpt configuration preset, written by `gdsckpt bench --recommend`",
        f"# date: {report.date}",
        f"# host: {clean(report.host.get('hostname') or '?')} ({clean(report.host.get('cpu_model') or '?')}, "
        f"{report.host.get('cpu_affinity') or report.host.get('cpu_count')} cores"
        + (f", {clean(report.host['gpu'])}" if report.host.get("gpu") else "") + f"), gdsckpt {__version__}",
        (f"# target: {clean(target.path)} ({fs['type']} on {clean(fs['device'])}, mounted at "
         f"{clean(fs['mount_point'])})"),
        (f"# data: {human_size(report.data['logical_bytes'])} synthetic bf16 + fp32 training state; durable "
         f"saves, cold loads, median of {report.settings.repeats}"),
        (f"# measured: {m.label}: save {m.save_gbps:.3f} GB/s, load {m.load_gbps:.3f} GB/s, "
         f"ratio {m.ratio:.3f}"),
    ]
    if recommendation.raw_write_gbps is not None:
        lines.append(f"# raw I/O on this target: write {recommendation.raw_write_gbps:.3f} GB/s, "
                     f"read {recommendation.raw_read_gbps or 0.0:.3f} GB/s (cold: {COLD_READ_METHOD}; a "
                     f"remote or virtual disk may still cache)")
    lines.append(f"# why: {clean(recommendation.reason)}")
    lines.append("# load with gdsckpt.Config.from_toml(path)")
    for name, value in recommendation.fields.items():
        if name.endswith("_bytes"):
            lines.append(f"{name} = {json.dumps(format_size(value))}")
        elif isinstance(value, str):
            lines.append(f"{name} = {json.dumps(value)}")
        else:
            lines.append(f"{name} = {value!r}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# plots

def target_slug(number: int, path: str) -> str:
    """A file-name-safe name for the ``number``-th target (``1-nvme``)."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", Path(path).name).strip("-") or "root"
    return f"{number}-{name}"


def write_plots(report: BenchReport, out_dir: str | os.PathLike[str]) -> list[Path]:
    """One PNG per target and engine: save, cold load and warm load GB/s by codec (groups) and chunk size (bars),
    each bar the best median over thread counts and depths, with raw I/O and the baselines as
    lines. Returns the files written; none (with a logged warning) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: no plots written (pip install 'gdsckpt[bench]')")
        return []
    written = []
    for number, target in enumerate(report.targets, 1):
        for engine in ("cpu", "gpu"):
            rows = [m for m in target.measurements if m.kind == "gdsckpt" and m.engine == engine
                    and m.status == "ok"]
            if not rows:
                continue
            device = rows[0].device
            others = [m for m in target.measurements if m.kind != "gdsckpt" and m.device == device
                      and m.status == "ok"]
            path = Path(out_dir) / f"bench-{target_slug(number, target.path)}-{engine}.png"
            figure = _plot_target(Figure(figsize=(15, 4.5)), target, engine, rows, others, report)
            figure.savefig(path, dpi=110)
            written.append(path)
    return written


def _plot_target(figure: Any, target: TargetResult, engine: str, rows: list[Measurement],
                 others: list[Measurement], report: BenchReport) -> Any:
    codecs = list(dict.fromkeys(m.codec for m in rows))
    chunks = sorted({m.chunk_bytes for m in rows if m.chunk_bytes})
    width = 0.8 / max(len(chunks), 1)
    # raw I/O is the ceiling (black, dashed); each baseline has its own colour (dotted)
    colours = {"torch": "tab:red", "safetensors": "tab:purple"}
    titles = {"save": "durable save", "load": "cold load", "warm_load": "warm load (page cache)"}
    for axis, what in zip(figure.subplots(1, 3), titles):
        for i, chunk in enumerate(chunks):
            values = []
            for codec in codecs:
                speeds = [getattr(m, f"{what}_gbps") or 0.0 for m in rows
                          if m.codec == codec and m.chunk_bytes == chunk]
                values.append(max(speeds, default=0.0))
            positions = [x + (i - (len(chunks) - 1) / 2) * width for x in range(len(codecs))]
            axis.bar(positions, values, width, label=f"{format_size(chunk)} chunks")
        for path in dict.fromkeys(m.path for m in others):
            best = max((getattr(m, f"{what}_gbps") or 0.0) for m in others if m.path == path)
            kind = next(m.kind for m in others if m.path == path)
            axis.axhline(best, linestyle="--" if kind == "raw" else ":", color=colours.get(path, "black"),
                         linewidth=1.2, label=f"{path} {best:.2f}")
        axis.set_xticks(range(len(codecs)))
        axis.set_xticklabels(codecs)
        axis.set_ylabel("GB/s (logical bytes)")
        axis.set_title(titles[what])
        axis.legend(fontsize="small")
    figure.suptitle(f"{target.path} ({target.filesystem['type']}), {engine} engine, "
                    f"{human_size(report.data['logical_bytes'])}, median of {report.settings.repeats}; "
                    f"bars: best over threads and depths", fontsize="medium")
    figure.tight_layout()
    return figure
