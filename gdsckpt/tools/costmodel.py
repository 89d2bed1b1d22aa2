"""What checkpointing costs a training job a month, with and without gdsckpt.

The model follows the cost analysis of NVIDIA's technical blog post "Cut Checkpoint Costs with
About 30 Lines of Python and NVIDIA nvCOMP" (April 2026,
https://developer.nvidia.com/blog/cut-checkpoint-costs-with-about-30-lines-of-python-and-nvidia-nvcomp/):
a synchronous save stalls every GPU of the job for checkpoint size / storage bandwidth; the GPU
time lost in a month is that stall x checkpoints a month (a month of 30 days, as there) x GPUs,
and its price is those GPU-hours x the price of a GPU-hour. Lossless compression shrinks the
bytes written (so the stall and the storage needed) by the compression ratio, as long as the
compressor keeps ahead of the storage. Where this module departs from the post:

- The checkpoint is made of parts chosen by the caller (weights in their dtype, an fp32 master
  copy under mixed precision, the optimizer's moments, optionally gradients); the post's example
  counts bf16 weights, AdamW moments and bf16 gradients (``ModelSpec(70e9, master=None,
  grads="bf16")`` gives its 70B checkpoint).
- Bytes are decimal throughout (GB = 1e9 bytes, against GB/s): the post divides sizes in GiB by
  bandwidths in GB/s, so its stalls are 7% shorter than this model's for the same inputs.
- Ratios are per part, measured by gdsckpt on a GPU (``docs/performance.md``), or read from a
  real gdsckpt checkpoint (``group_sizes``), not one figure per architecture.
- A third column models gdsckpt's asynchronous save, which blocks training only while the state
  is copied into a snapshot, plus the measured slowdown of training while the save runs behind it.
- Its fair comparison is another asynchronous save, not a synchronous one: a column models
  torch.distributed.checkpoint's ``async_save`` (staging into host memory, then an uncompressed
  write behind training) with the figures measured for it on the same host, so that the gain of
  gdsckpt itself shows apart from the gain of saving asynchronously at all.

Everything here is arithmetic on dataclasses; only ``group_sizes`` reads a file.

Why one module of about 600 lines: the measured defaults, the inputs and the arithmetic are one
model, read top to bottom against the blog post it follows; most of the length is the commented
provenance of each default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config

# ---------------------------------------------------------------------------------------------
# measured defaults (docs/performance.md names the runs and the commands)

#: Ratios of the parts of an 8.76 GiB GPT-style AdamW state, the same in every GPU benchmark run
#: (the benchmark's ``group_ratios``; docs/performance.md, "Save and load on the GPU").
MEASURED_RATIOS: dict[str, float] = {
    "weights/bf16": 1.546,   # bf16 weights ("model" group)
    "weights/fp32": 1.215,   # fp32 weights: the fp32 master copy is the same values in fp32
    "master": 1.215,
    "exp_avg": 1.192,
    "exp_avg_sq": 1.230,
}

#: SGD's momentum buffer was not measured; it is a running average of gradients like AdamW's
#: exp_avg, so it takes exp_avg's ratio. fp16 weights and gradients were not measured either and
#: are counted as incompressible (ratio 1.0), so the plan never credits gdsckpt with unmeasured gains.
ANALOGUE_RATIOS: dict[str, tuple[float, str]] = {
    "momentum_buffer": (1.192, "exp_avg's measured ratio (momentum not measured)"),
}
UNMEASURED_RATIO = 1.0

#: GB/s of the GPU pipeline of one GPU into a null sink (compression alone, no storage): the lowest
#: measured with 16 MiB chunks (40.6-55.6 GB/s). A save can never go faster than this per GPU.
PIPELINE_GBPS_PER_GPU = 40.6

#: GB/s at which ``save_async`` copies the state into its snapshot, seen by a training loop
#: (docs/performance.md, "Cost model inputs"), in steady state: the first pinned snapshot of a
#: process also allocates the pinned pool, once, which ``prepare`` pays before the loop. Measured
#: with one GPU on the host: GPUs copying to pinned memory at once share the host's memory
#: bandwidth, so several GPUs per host may see less.
SNAPSHOT_GBPS: dict[str, float] = {"gpu": 261.0, "pinned": 50.8}

#: Seconds of training lost per second a background save runs, beyond the blocked time, with the
#: default thread worker (docs/performance.md, "Cost model inputs": 0.25 with a GPU snapshot, 0.22
#: pinned; the larger is taken). One small model on one GPU at
#: 15 steps/s, where the save's Python pipeline competes with the training loop for the GIL:
#: a larger model with longer steps is likely slowed less; set 0 to leave the effect out.
BACKGROUND_SLOWDOWN = 0.25

#: GB/s at which DCP ``async_save`` stages the state into host memory before returning, in steady
#: state (docs/performance.md, "Cost model inputs"): ``pinned`` (pinned staging memory and a
#: writer kept between calls) and ``pageable`` (a new FileSystemWriter per call, DCP's default
#: staging).
DCP_STAGING_GBPS: dict[str, float] = {"pinned": 50.5, "pageable": 1.74}

#: Seconds of training lost per second DCP's background write runs: none measurable beyond its
#: blocked time (docs/performance.md, "Cost model inputs"). Its writer thread spends its time in
#: file writes, which release the GIL; counted as 0, the baseline's most favourable case.
DCP_BACKGROUND_SLOWDOWN = 0.0

#: A month of 30 days, as in the NVIDIA post (48 checkpoints a day at 30 minutes = 1440).
HOURS_PER_MONTH = 720.0

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_MOMENTS: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
    "none": (),
}
SNAPSHOTS = ("auto", "gpu", "pinned")
DCP_STAGINGS = tuple(DCP_STAGING_GBPS)

#: The groups of a checkpoint (``group_sizes``) whose ratio a part of ``ModelSpec`` takes with
#: ``--from``: the layout of ``benchmarks/save_load_bench.py`` and of a torch optimizer's state_dict.
PART_GROUPS: dict[str, tuple[str, ...]] = {
    "weights": ("model",),
    "master": ("master",),
    "exp_avg": ("optimizer/exp_avg",),
    "exp_avg_sq": ("optimizer/exp_avg_sq",),
    "momentum_buffer": ("optimizer/momentum_buffer",),
    "grads": ("grads", "gradients"),
}


# ---------------------------------------------------------------------------------------------
# what a checkpoint holds

@dataclass(frozen=True)
class Part:
    """One component of a checkpoint: ``nbytes`` logical bytes that compress ``ratio``:1."""

    name: str
    dtype: str
    nbytes: int
    ratio: float
    ratio_source: str

    @property
    def stored_bytes(self) -> float:
        """Bytes on disk once compressed: ``nbytes / ratio``."""
        return self.nbytes / self.ratio


@dataclass(frozen=True)
class ModelSpec:
    """A model's training state, described by its size rather than by its tensors.

    ``params``: parameter count. ``weights``: dtype of the weights the model holds. ``master``:
    dtype of the master copy an optimizer keeps under mixed precision, or None. ``optimizer``:
    ``adamw`` (two fp32 moments), ``sgd`` (one fp32 momentum buffer) or ``none``. ``grads``:
    dtype of gradients saved with the state, or None (a state_dict holds none).
    """

    params: int
    weights: str = "bf16"
    master: str | None = "fp32"
    optimizer: str = "adamw"
    grads: str | None = None

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ValueError(f"params must be > 0, got {self.params}")
        for name in ("weights", "master", "grads"):
            dtype = getattr(self, name)
            if dtype is not None and dtype not in DTYPE_BYTES:
                raise ValueError(f"{name}={dtype!r} is not a known dtype (expected one of: "
                                 f"{', '.join(DTYPE_BYTES)})")
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ValueError(f"optimizer={self.optimizer!r} is not known (expected one of: "
                             f"{', '.join(OPTIMIZER_MOMENTS)})")


def default_ratio(part: str, dtype: str) -> tuple[float, str]:
    """The ratio a part compresses by when no checkpoint or override says otherwise, and where
    that figure comes from."""
    if part == "weights" and f"weights/{dtype}" in MEASURED_RATIOS:
        detail = "" if dtype == "bf16" else ", as the fp32 master copy"
        return MEASURED_RATIOS[f"weights/{dtype}"], f"measured (docs/performance.md{detail})"
    if part in MEASURED_RATIOS and dtype == "fp32":
        return MEASURED_RATIOS[part], "measured (docs/performance.md)"
    if part in ANALOGUE_RATIOS and dtype == "fp32":
        return ANALOGUE_RATIOS[part]
    return UNMEASURED_RATIO, "not measured: counted incompressible"


def checkpoint_parts(spec: ModelSpec, ratios: Mapping[str, tuple[float, str]] | None = None) -> list[Part]:
    """The parts of ``spec``'s checkpoint, each ``params x bytes of its dtype``; optimizer moments
    are fp32. ``ratios`` (part name -> (ratio, source)) replaces the default ratio of a part."""
    layout = [("weights", spec.weights)]
    if spec.master is not None:
        layout.append(("master", spec.master))
    layout.extend((moment, "fp32") for moment in OPTIMIZER_MOMENTS[spec.optimizer])
    if spec.grads is not None:
        layout.append(("grads", spec.grads))
    chosen = dict(ratios or {})
    parts = []
    for name, dtype in layout:
        ratio, source = chosen.get(name) or default_ratio(name, dtype)
        parts.append(Part(name, dtype, spec.params * DTYPE_BYTES[dtype], _checked_ratio(name, ratio), source))
    return parts


def with_ratios(parts: Iterable[Part], overrides: Mapping[str, float], source: str) -> list[Part]:
    """``parts`` with the ratios of ``overrides`` (part name -> ratio) put in; a name that is no
    part's is a ``ValueError`` listing the parts."""
    parts = list(parts)
    unknown = sorted(set(overrides) - {part.name for part in parts})
    if unknown:
        raise ValueError(f"no part named {', '.join(map(repr, unknown))} in this checkpoint (its parts: "
                         f"{', '.join(part.name for part in parts)})")
    return [replace(part, ratio=_checked_ratio(part.name, overrides[part.name]), ratio_source=source)
            if part.name in overrides else part for part in parts]


def _checked_ratio(name: str, ratio: float) -> float:
    if not ratio > 0:
        raise ValueError(f"the ratio of {name!r} must be > 0, got {ratio}")
    return float(ratio)


@dataclass(frozen=True)
class GroupSize:
    """Logical and stored bytes of one group of a checkpoint's tensors, and their dtypes."""

    nbytes: int
    stored_bytes: int
    dtypes: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """``nbytes / stored_bytes`` (1.0 for a group that stores nothing)."""
        return self.nbytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def dtype(self) -> str:
        """The group's dtypes joined by ``+`` (``-`` for none)."""
        return "+".join(self.dtypes) or "-"


#: Index dtype names as this module spells them.
_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def group_of(key: str) -> str:
    """The group a tensor key counts in: its top-level key (``model``, ``master``, ...), or for an
    optimizer's per-parameter state its top-level key and the state's name
    (``optimizer/state/3/exp_avg`` -> ``optimizer/exp_avg``), so Adam's two moments show their own
    ratios, as ``benchmarks/save_load_bench.py`` groups its ratios. ``gdsckpt inspect`` uses it too."""
    parts = key.split("/")
    if len(parts) > 2 and parts[0].startswith("optim"):
        return f"{parts[0]}/{parts[-1]}"
    return parts[0]


def group_sizes(path: str | os.PathLike[str], config: Config | None = None) -> dict[str, GroupSize]:
    """Logical and stored bytes per group (``group_of``) of a gdsckpt checkpoint, from its index
    alone (``CheckpointInfo.groups``). Aliases (tied weights, stored once) are not counted again.
    A group's stored bytes are exact unless it shares chunks with another group (arrays smaller
    than ``Config.pack_below`` are packed together): those chunks are split by raw bytes, so the
    groups of a checkpoint of tiny arrays mix each other's ratios. ``config``: how to read it (an
    ``s3://`` address's endpoint, the timeout), else the environment's."""
    from ..api import inspect

    info = inspect(path, config=config)
    if info.base is not None:
        # its chunks hold XORs with the base: their ratio says how little changed, not how well
        # the state compresses (an unchanged state showed "ratio 15420")
        raise ValueError(f"{str(path)!r} is a delta checkpoint (on {info.base['path']!r}): plan from a full "
                         f"one, or write it in full first with 'gdsckpt rebase {path} -o FULL'")
    dtypes: dict[str, set[str]] = {}
    for tensor in info.tensors:
        if tensor.alias_of is None:
            dtypes.setdefault(group_of(tensor.key), set()).add(_SHORT_DTYPES.get(tensor.dtype, tensor.dtype))
    return {name: GroupSize(group.logical_bytes, group.stored_bytes, tuple(sorted(dtypes[name])))
            for name, group in info.groups(group_of).items()}


def ratios_from_groups(groups: Mapping[str, GroupSize], source: str) -> dict[str, tuple[float, str]]:
    """Part name -> (ratio, source) for each part of ``PART_GROUPS`` whose group ``groups`` has;
    the source names the group and its dtypes, so a dtype unlike the part's shows."""
    found: dict[str, tuple[float, str]] = {}
    for part, names in PART_GROUPS.items():
        present = {name: groups[name] for name in names if name in groups and groups[name].nbytes}
        if present:
            total = GroupSize(sum(g.nbytes for g in present.values()),
                              sum(g.stored_bytes for g in present.values()))
            described = ", ".join(f"{name} {group.dtype}" for name, group in present.items())
            found[part] = (total.ratio, f"{source} ({described})")
    return found


def parts_from_groups(groups: Mapping[str, GroupSize], source: str) -> list[Part]:
    """A checkpoint's own groups as parts: its sizes and its ratios (groups holding no bytes
    are left out)."""
    return [Part(name, group.dtype, group.nbytes, group.ratio, source) for name, group in sorted(groups.items())
            if group.nbytes]


# ---------------------------------------------------------------------------------------------
# the job

@dataclass(frozen=True)
class Job:
    """How the training job checkpoints, and what its GPUs and storage cost.

    ``interval_s``: seconds between checkpoints. ``gpus``: GPUs of the job (all of them wait out a
    synchronous save). ``storage_gbps``: GB/s the storage takes writes at, all writers together.
    ``gpu_hour_price``: price of one GPU-hour (None: no money figures). ``keep_last``: checkpoints
    kept on storage. ``writers``: GPUs that each save a shard of the state (None: all ``gpus``,
    as DCP/FSDP do; 1 for rank 0 saving a replicated state). ``torch_save_gbps``: the speed the job's
    current synchronous save actually reaches, all writers together (None: the storage's speed,
    the most favourable case for the baseline). ``pipeline_gbps_per_gpu``: the fastest one GPU
    compresses. ``snapshot``: where ``save_async`` copies the state: ``gpu``, ``pinned`` host memory,
    or ``auto`` (``gpu`` when a writer's shard fits ``snapshot_gpu_bytes``, gdsckpt's own rule).
    ``snapshot_gbps``: overrides the measured copy speed. ``background_slowdown``: seconds of
    training lost per second a background save runs. ``hours_per_month``: the month's length.
    ``dcp_staging``: how the DCP ``async_save`` baseline stages the state (``pinned``, its fastest
    measured setup and the default, or ``pageable``; ``DCP_STAGING_GBPS``).
    """

    interval_s: float
    gpus: int
    storage_gbps: float
    gpu_hour_price: float | None = None
    keep_last: int = 3
    writers: int | None = None
    torch_save_gbps: float | None = None
    pipeline_gbps_per_gpu: float = PIPELINE_GBPS_PER_GPU
    snapshot: str = "auto"
    snapshot_gbps: float | None = None
    snapshot_gpu_bytes: int = 1 << 30
    background_slowdown: float = BACKGROUND_SLOWDOWN
    hours_per_month: float = HOURS_PER_MONTH
    dcp_staging: str = "pinned"

    def __post_init__(self) -> None:
        positive = {"interval_s": self.interval_s, "storage_gbps": self.storage_gbps,
                    "pipeline_gbps_per_gpu": self.pipeline_gbps_per_gpu, "hours_per_month": self.hours_per_month}
        positive.update({name: value for name, value in (("torch_save_gbps", self.torch_save_gbps),
                                                         ("snapshot_gbps", self.snapshot_gbps))
                         if value is not None})
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.gpus < 1 or self.keep_last < 1:
            raise ValueError(f"gpus and keep_last must be >= 1, got {self.gpus} and {self.keep_last}")
        if self.writers is not None and not 1 <= self.writers <= self.gpus:
            raise ValueError(f"writers must be between 1 and gpus ({self.gpus}), got {self.writers}")
        if self.gpu_hour_price is not None and self.gpu_hour_price < 0:
            raise ValueError(f"gpu_hour_price must be >= 0, got {self.gpu_hour_price}")
        if self.snapshot not in SNAPSHOTS:
            raise ValueError(f"snapshot={self.snapshot!r} is invalid (expected one of: {', '.join(SNAPSHOTS)})")
        if self.background_slowdown < 0:
            raise ValueError(f"background_slowdown must be >= 0, got {self.background_slowdown}")
        if self.dcp_staging not in DCP_STAGINGS:
            raise ValueError(f"dcp_staging={self.dcp_staging!r} is invalid (expected one of: "
                             f"{', '.join(DCP_STAGINGS)})")

    @property
    def shard_writers(self) -> int:
        """GPUs that write a shard each: ``writers``, or every GPU."""
        return self.writers if self.writers is not None else self.gpus

    @property
    def checkpoints_per_month(self) -> float:
        """``hours_per_month x 3600 / interval_s``."""
        return self.hours_per_month * 3600.0 / self.interval_s


# ---------------------------------------------------------------------------------------------
# the ways of saving

@dataclass(frozen=True)
class Scenario:
    """One way of saving, over a month. Seconds are per checkpoint and per GPU.

    ``write_s``: from the start of the save until the last byte is on storage. ``blocked_s``: time
    training waits in the save call. ``background_s``: seconds of training lost to the save running
    behind it (async only). ``lost_s = blocked_s + background_s``. ``bound``: what limits the
    write: ``storage``, ``pipeline`` (compression) or ``torch.save`` (an observed speed).
    """

    name: str
    stored_bytes: float
    write_s: float
    blocked_s: float
    background_s: float
    bound: str
    job: Job
    snapshot: str | None = None
    backlog_s: float = 0.0
    """Async only: the part of ``blocked_s`` spent waiting for the previous save to finish, when a
    save takes longer than the interval (one save runs at a time)."""

    @property
    def lost_s(self) -> float:
        """Training time lost per checkpoint per GPU."""
        return self.blocked_s + self.background_s

    @property
    def lost_fraction(self) -> float:
        """Share of the job's GPU time lost: ``lost_s / interval_s``."""
        return self.lost_s / self.job.interval_s

    @property
    def gpu_hours_per_month(self) -> float:
        """``lost_s x checkpoints a month x gpus / 3600``."""
        return self.lost_s * self.job.checkpoints_per_month * self.job.gpus / 3600.0

    @property
    def cost_per_month(self) -> float | None:
        """GPU-hours lost a month x the price of a GPU-hour (None without a price)."""
        price = self.job.gpu_hour_price
        return None if price is None else self.gpu_hours_per_month * price

    @property
    def storage_bytes(self) -> float:
        """Bytes the kept checkpoints occupy: ``stored_bytes x keep_last``."""
        return self.stored_bytes * self.job.keep_last

    @property
    def written_bytes_per_month(self) -> float:
        """Bytes written to storage in a month: ``stored_bytes x checkpoints a month``."""
        return self.stored_bytes * self.job.checkpoints_per_month

    def to_json(self) -> dict[str, object]:
        """The scenario's inputs and derived figures as plain JSON values."""
        doc: dict[str, object] = {key: value for key, value in asdict(self).items() if key != "job"}
        doc.update(lost_s=self.lost_s, lost_fraction=self.lost_fraction,
                   gpu_hours_per_month=self.gpu_hours_per_month, cost_per_month=self.cost_per_month,
                   storage_bytes=self.storage_bytes, written_bytes_per_month=self.written_bytes_per_month)
        return doc


def logical_bytes(parts: Iterable[Part]) -> int:
    """Bytes of a checkpoint before compression."""
    return sum(part.nbytes for part in parts)


def compressed_bytes(parts: Iterable[Part]) -> float:
    """Bytes of a checkpoint after compression: the sum of each part's ``nbytes / ratio``."""
    return sum(part.stored_bytes for part in parts)


def _scenario(name: str, job: Job, stored: float, write_s: float, blocked_s: float, bound: str,
              background_s: float = 0.0, snapshot: str | None = None, backlog_s: float = 0.0) -> Scenario:
    return Scenario(name=name, stored_bytes=stored, write_s=write_s, blocked_s=blocked_s,
                    background_s=background_s, bound=bound, job=job, snapshot=snapshot, backlog_s=backlog_s)


def without_gdsckpt(parts: list[Part], job: Job) -> Scenario:
    """A synchronous, uncompressed save (torch.save-style): every GPU waits ``bytes / speed``,
    the speed being the storage's, or the observed ``torch_save_gbps`` when given."""
    total = logical_bytes(parts)
    if job.torch_save_gbps is not None:
        seconds, bound = total / (job.torch_save_gbps * 1e9), "torch.save"
    else:
        seconds, bound = total / (job.storage_gbps * 1e9), "storage"
    return _scenario("without gdsckpt", job, total, seconds, seconds, bound)


def gdsckpt_write_seconds(parts: list[Part], job: Job) -> tuple[float, str]:
    """Seconds a gdsckpt save takes and what bounds it: the compressed bytes at the storage's
    speed, or all bytes at the writers' compression speed, whichever is slower
    (``max(stored / storage, logical / (pipeline_gbps_per_gpu x writers))``)."""
    at_storage = compressed_bytes(parts) / (job.storage_gbps * 1e9)
    at_pipeline = logical_bytes(parts) / (job.pipeline_gbps_per_gpu * 1e9 * job.shard_writers)
    return (at_storage, "storage") if at_storage >= at_pipeline else (at_pipeline, "pipeline")


def gdsckpt_sync(parts: list[Part], job: Job) -> Scenario:
    """``gdsckpt.save``: every GPU waits for the whole compressed save."""
    seconds, bound = gdsckpt_write_seconds(parts, job)
    return _scenario("gdsckpt sync", job, compressed_bytes(parts), seconds, seconds, bound)


def snapshot_kind(parts: list[Part], job: Job) -> str:
    """Where ``save_async`` copies a writer's shard: ``job.snapshot``, or for ``auto`` the GPU
    when the shard (``logical bytes / writers``) fits ``snapshot_gpu_bytes``, else pinned memory."""
    if job.snapshot != "auto":
        return job.snapshot
    return "gpu" if logical_bytes(parts) / job.shard_writers <= job.snapshot_gpu_bytes else "pinned"


def gdsckpt_async(parts: list[Part], job: Job) -> Scenario:
    """``gdsckpt.save_async`` / ``CheckpointManager.save_async``.

    Each writer copies its shard into the snapshot in parallel, blocking training for
    ``shard / snapshot speed``; the save then runs behind training for the gdsckpt write time,
    costing ``background_slowdown`` seconds of training per second of overlap (the overlap ends
    at the next checkpoint). One save runs at a time, so a save longer than the interval makes
    the next call wait for the difference (``backlog_s``).
    """
    kind = snapshot_kind(parts, job)
    speed = job.snapshot_gbps if job.snapshot_gbps is not None else SNAPSHOT_GBPS[kind]
    snapshot_s = logical_bytes(parts) / job.shard_writers / (speed * 1e9)
    write_s, bound = gdsckpt_write_seconds(parts, job)
    backlog_s = max(0.0, write_s - job.interval_s)
    background_s = job.background_slowdown * min(write_s, job.interval_s)
    return _scenario("gdsckpt async", job, compressed_bytes(parts), write_s, snapshot_s + backlog_s, bound,
                     background_s=background_s, snapshot=kind, backlog_s=backlog_s)


def dcp_async(parts: list[Part], job: Job) -> Scenario:
    """torch.distributed.checkpoint ``async_save``: the asynchronous save without gdsckpt.

    Each writer stages its shard into host memory, blocking training for ``shard / staging speed``
    (``DCP_STAGING_GBPS[job.dcp_staging]``); the uncompressed bytes are then written behind training
    at the storage's speed, costing ``DCP_BACKGROUND_SLOWDOWN`` of the overlap. As for gdsckpt's
    async save, a write longer than the interval makes the next call wait for the difference.
    """
    total = logical_bytes(parts)
    staging_s = total / job.shard_writers / (DCP_STAGING_GBPS[job.dcp_staging] * 1e9)
    write_s = total / (job.storage_gbps * 1e9)
    backlog_s = max(0.0, write_s - job.interval_s)
    background_s = DCP_BACKGROUND_SLOWDOWN * min(write_s, job.interval_s)
    return _scenario(DCP_ASYNC, job, total, write_s, staging_s + backlog_s, "storage",
                     background_s=background_s, snapshot=job.dcp_staging, backlog_s=backlog_s)


DCP_ASYNC = "DCP async_save"
"""The name of the async baseline's scenario (``dcp_async``)."""


@dataclass(frozen=True)
class Plan:
    """The scenarios for one checkpoint and one job: without gdsckpt, gdsckpt sync, DCP async_save
    (the asynchronous baseline) and gdsckpt async."""

    parts: tuple[Part, ...]
    job: Job
    scenarios: tuple[Scenario, ...]

    @property
    def baseline(self) -> Scenario:
        """Without gdsckpt."""
        return self.scenarios[0]

    def scenario(self, name: str) -> Scenario:
        """The scenario called ``name`` (``without gdsckpt``, ``gdsckpt sync``, ``DCP async_save``,
        ``gdsckpt async``)."""
        return next(s for s in self.scenarios if s.name == name)

    def savings(self) -> dict[str, dict[str, float | None]]:
        """Per gdsckpt scenario (keyed as in ``to_json``): GPU-hours and money a month, and bytes of
        storage, less than without gdsckpt (money None without a price)."""
        return {_json_key(s.name): spent_less(self.baseline, s) for s in self.scenarios if s.name.startswith("gdsckpt")}

    def async_gain(self) -> dict[str, float | None]:
        """What gdsckpt's async save spends less than DCP ``async_save`` (negative: more): the gain
        of gdsckpt itself, apart from that of saving asynchronously at all."""
        return spent_less(self.scenario(DCP_ASYNC), self.scenario("gdsckpt async"))

    def to_json(self) -> dict[str, object]:
        """Inputs, parts, scenarios and savings as plain JSON values."""
        return {
            "job": asdict(self.job) | {"shard_writers": self.job.shard_writers,
                                       "checkpoints_per_month": self.job.checkpoints_per_month},
            "parts": [asdict(part) | {"stored_bytes": part.stored_bytes} for part in self.parts],
            "logical_bytes": logical_bytes(self.parts),
            "compressed_bytes": compressed_bytes(self.parts),
            "ratio": logical_bytes(self.parts) / compressed_bytes(self.parts),
            "scenarios": {_json_key(s.name): s.to_json() for s in self.scenarios},
            "savings": self.savings(),
            "async_gain_over_dcp_async_save": self.async_gain(),
        }


def spent_less(base: Scenario, scenario: Scenario) -> dict[str, float | None]:
    """GPU-hours and money a month, and bytes of storage, ``scenario`` spends less than ``base``."""
    cost = (None if base.cost_per_month is None or scenario.cost_per_month is None
            else base.cost_per_month - scenario.cost_per_month)
    return {"gpu_hours_per_month": base.gpu_hours_per_month - scenario.gpu_hours_per_month,
            "cost_per_month": cost, "storage_bytes": base.storage_bytes - scenario.storage_bytes}


def _json_key(name: str) -> str:
    return name.replace(" ", "_").replace(".", "_").lower()


def plan(parts: Iterable[Part], job: Job) -> Plan:
    """The cost of checkpointing ``parts`` in ``job``: without gdsckpt, gdsckpt sync, DCP
    async_save and gdsckpt async."""
    parts = list(parts)
    if not parts or logical_bytes(parts) <= 0:
        raise ValueError("a plan needs a checkpoint of at least one byte")
    return Plan(tuple(parts), job, (without_gdsckpt(parts, job), gdsckpt_sync(parts, job),
                                    dcp_async(parts, job), gdsckpt_async(parts, job)))


__all__ = [
    "BACKGROUND_SLOWDOWN",
    "DCP_ASYNC",
    "DCP_BACKGROUND_SLOWDOWN",
    "DCP_STAGINGS",
    "DCP_STAGING_GBPS",
    "DTYPE_BYTES",
    "HOURS_PER_MONTH",
    "MEASURED_RATIOS",
    "OPTIMIZER_MOMENTS",
    "PART_GROUPS",
    "PIPELINE_GBPS_PER_GPU",
    "SNAPSHOT_GBPS",
    "GroupSize",
    "Job",
    "ModelSpec",
    "Part",
    "Plan",
    "Scenario",
    "checkpoint_parts",
    "compressed_bytes",
    "dcp_async",
    "default_ratio",
    "gdsckpt_async",
    "gdsckpt_sync",
    "gdsckpt_write_seconds",
    "group_of",
    "group_sizes",
    "logical_bytes",
    "parts_from_groups",
    "plan",
    "ratios_from_groups",
    "snapshot_kind",
    "spent_less",
    "with_ratios",
    "without_gdsckpt",
]
