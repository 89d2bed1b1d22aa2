"""``gdsckpt demo``: save a small transformer's model + AdamW state, restore it, check it bit-exact,
and print ratio and speed next to ``torch.save`` / ``torch.load`` on the same state.

Also home of ``TinyGPT`` and ``training_state``, the GPT-style model and the "trained for a few
steps on random tokens" state that tests and benchmarks share.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..io.posix import fsync_directory


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention, then the MLP, each added to its input (pre-norm residual block)."""
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model; size set by ``width`` and ``depth``."""

    def __init__(self, vocab: int = 512, width: int = 128, depth: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for ``tokens`` (batch, length)."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train_steps(model: TinyGPT, optimizer: torch.optim.Optimizer, steps: int, *, seed: int, batch: int = 8,
                length: int = 32) -> float:
    """Train on random tokens (drawn from a generator seeded by ``seed``); returns the last loss."""
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.embed.num_embeddings
    loss = torch.tensor(0.0)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, length + 1), generator=generator).to(device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def training_state(*, width: int = 128, depth: int = 2, steps: int = 3, device: str = "cpu",
                   seed: int = 0, vocab: int = 512) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """A TinyGPT and its AdamW optimizer after ``steps`` training steps (deterministic in ``seed``)."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, width=width, depth=depth).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps, seed=seed)
    return model, optimizer


HEADS = 4
"""Attention heads of the demo's TinyGPT: its width must be a multiple of this."""

VOCAB = 4096
"""The demo's TinyGPT vocabulary (its embedding and head are ``VOCAB x width`` each)."""


def check_demo_options(*, width: int, depth: int, device: str | None, directory: str | None = None) -> str:
    """Check the demo's options before any work; returns the device to run on (``None``: cuda when
    torch sees a GPU, else cpu). Raises ``ValueError`` saying what is wrong and what would do
    (``directory``, where given, must be an existing directory: the demo's temporary directory is
    made inside it, and a missing one would be named by that temporary's path, not by the one given)."""
    if directory is not None and not os.path.isdir(directory):
        problem = "is not a directory" if os.path.lexists(directory) else "does not exist"
        raise ValueError(f"directory {directory!r} {problem}: give an existing directory, or leave it out for the "
                         f"system's temporary directory")
    if width < HEADS or width % HEADS:
        raise ValueError(f"width must be a positive multiple of {HEADS} (the model's attention heads), got {width}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda") or (parsed.type == "cpu" and parsed.index not in (None, 0)):
        raise ValueError(f"device {device!r} is invalid (expected one of: cpu, cuda, cuda:N)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"device {device!r} asked for, but torch {torch.__version__} ({build}) sees no "
                             f"CUDA device; use cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} CUDA "
                             f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return str(parsed)


def _durable_torch_save(state: Any, path: Path) -> None:
    """torch.save made as durable as ``gdsckpt.save`` (fsync of the file and of its directory)."""
    with path.open("wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_directory(path.parent)


def _evict(path: Path) -> bool:
    """Drop ``path`` from this host's page cache so the next load reads storage; False where the OS
    has no ``posix_fadvise`` (the loads are then warm, for both sides alike)."""
    from .storagebench import fsync_file

    fsync_file(path, drop_cache=True)
    return hasattr(os, "posix_fadvise")


def _timed(call: Any, device: str) -> float:
    """Seconds ``call()`` takes, until the device has finished the work it queued."""
    started = time.perf_counter()
    call()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors have the same dtype, shape and bit pattern (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        # A fresh 1-D buffer: a one-element view may keep a non-unit stride through .contiguous()
        flat = torch.empty(t.numel(), dtype=t.dtype)
        flat.copy_(t.detach().cpu().reshape(-1))
        return flat.view(torch.uint8)

    return bool(torch.equal(as_bytes(a), as_bytes(b)))


def run_demo(*, width: int = 512, depth: int = 6, directory: str | None = None,
             device: str | None = None, rounds: int = 3, config: Any = None) -> dict[str, Any]:
    """Run the demo and return its figures (also printed).

    Both sides are measured the same way over ``rounds`` rounds, taking turns at going first:
    durable saves (fsync of the file and its directory inside the timing), then cold loads (the
    file dropped from the page cache first) into a fresh model and optimizer (torch: ``torch.load``
    + ``load_state_dict``). The medians are printed with the conditions and which side won.
    gdsckpt runs with ``config`` (else the environment's) and ``fsync`` on whatever it says: the
    torch side is always made durable, so a save without it would not be measured alike.
    """
    from .. import api
    from ..api.resolve import resolve_config

    config = resolve_config(config).replace(fsync=True)

    device = check_demo_options(width=width, depth=depth, device=device, directory=directory)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    model, optimizer = training_state(width=width, depth=depth, steps=3, device=device, vocab=VOCAB)
    state: dict[str, Any] = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}
    fresh_model, _ = training_state(width=width, depth=depth, steps=0, device=device, seed=1, vocab=VOCAB)
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    target: dict[str, Any] = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
    times: dict[str, list[float]] = {"save": [], "torch_save": [], "load": [], "torch_load": []}
    cold = True
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        ours, theirs = Path(tmp) / "demo.gdsckpt", Path(tmp) / "demo.pt"
        reports: list[Any] = []

        def torch_restore() -> None:
            loaded = torch.load(theirs, map_location=device, weights_only=True)
            fresh_model.load_state_dict(loaded["model"])
            fresh_optimizer.load_state_dict(loaded["optimizer"])

        sides = {
            "save": lambda: reports.append(api.save(state, ours, config=config)),
            "torch_save": lambda: _durable_torch_save(state, theirs),
            "load": lambda: api.load_into(target, ours, config=config),
            "torch_load": torch_restore,
        }
        for number in range(rounds):
            # Taking turns at going first: a slow phase of the storage or a cache the first one warms
            # up falls on both sides alike.
            order = ("", "torch_") if number % 2 == 0 else ("torch_", "")
            for what in ("save", "load"):
                for prefix in order:
                    if what == "load":
                        cold = _evict(ours if prefix == "" else theirs) and cold
                    times[prefix + what].append(_timed(sides[prefix + what], device))
            target["step"] = 0
        # torch's restore may have been the last to fill the model: restore from gdsckpt once more so
        # that the comparison below checks gdsckpt's restore.
        api.load_into(target, ours, config=config)
        report = reports[-1]
        torch_bytes = theirs.stat().st_size
        filesystem = _filesystem_of(Path(tmp))

    restored = {"model": fresh_model.state_dict(), "optimizer": fresh_optimizer.state_dict()}
    mismatched = [key for key, value in state["model"].items() if not bit_equal(value, restored["model"][key])]
    for param_id, entries in state["optimizer"]["state"].items():
        for name, value in entries.items():
            if not bit_equal(torch.as_tensor(value), torch.as_tensor(restored["optimizer"]["state"][param_id][name])):
                mismatched.append(f"optimizer/state/{param_id}/{name}")
    mb = report.logical_bytes / 1e6
    medians = {what: statistics.median(seconds) for what, seconds in times.items()}
    figures: dict[str, Any] = {
        "device": device, "logical_mb": mb, "ratio": report.ratio, "torch_ratio": report.logical_bytes / torch_bytes,
        "rounds": rounds, "cold_loads": cold, "seconds": times,
        "save_mb_s": mb / medians["save"], "torch_save_mb_s": mb / medians["torch_save"],
        "load_mb_s": mb / medians["load"], "torch_load_mb_s": mb / medians["torch_load"],
        "bit_exact": not mismatched and target["step"] == 3, "codec": report.codec, "backend": report.backend,
    }
    loads = ("cold (this host's page cache dropped for the file before each load; a virtual or network "
             "disk may still cache it)" if cold else "warm (this OS cannot drop a file from the page cache)")
    print(f"gdsckpt demo: TinyGPT width={width} depth={depth} + AdamW after 3 steps on {device}, "
          f"{mb:.1f} MB of tensors")
    print(f"conditions: median of {rounds} round(s), the sides taking turns at going first, files on "
          f"{filesystem};\n  saves durable (fsync of the file and its directory inside the timing);\n"
          f"  loads {loads},\n  into a fresh model and optimizer (torch: torch.load + load_state_dict)")
    print(f"{'':14}{'ratio':>8}{'save MB/s':>12}{'load MB/s':>12}")
    print(f"{'gdsckpt':14}{report.ratio:>8.3f}{figures['save_mb_s']:>12.0f}{figures['load_mb_s']:>12.0f}"
          f"   ({report.codec}, {report.backend})")
    print(f"{'torch.save':14}{figures['torch_ratio']:>8.3f}{figures['torch_save_mb_s']:>12.0f}"
          f"{figures['torch_load_mb_s']:>12.0f}")
    print("restored bit-exact: " + ("yes" if figures["bit_exact"] else f"NO ({', '.join(mismatched[:5])})"))
    verdicts = [verdict("save", figures["save_mb_s"], figures["torch_save_mb_s"], report.ratio, device, rounds),
                verdict("load", figures["load_mb_s"], figures["torch_load_mb_s"], report.ratio, device, rounds)]
    figures["verdicts"] = verdicts
    for line in verdicts:
        print(line)
    return figures


def _filesystem_of(directory: Path) -> str:
    """``<type> (<directory>)`` from /proc/mounts where there is one, else the directory alone."""
    from .storagebench.host import filesystem_of

    kind = filesystem_of(directory)["type"]
    return str(directory.parent) if kind == "?" else f"{kind} ({directory.parent})"


def verdict(what: str, mine: float, theirs: float, ratio: float, device: str, rounds: int = 1) -> str:
    """One plain sentence: which side was faster at ``what`` (medians of ``rounds`` rounds) and,
    where torch won, the likely reason."""
    baseline = "torch.save" if what == "save" else "torch.load"
    of = f"median of {rounds} rounds" if rounds > 1 else "one round"
    if mine >= theirs:
        return f"{what}: gdsckpt faster, {mine / theirs:.1f}x {baseline} ({of})"
    if device == "cpu" and ratio > 1.0:
        work = "compressing" if what == "save" else "decompressing"
        why = (f"on this CPU, {work} costs more time than the {ratio:.2f}x fewer bytes save on this "
               f"storage; the GPU engine, or codec='none', is where gdsckpt is faster")
    else:
        why = "a state this small is dominated by fixed costs"
    return f"{what}: {baseline} was faster here ({theirs:.0f} against {mine:.0f} MB/s, {of}): {why}"

__all__ = ["Block", "TinyGPT", "bit_equal", "check_demo_options", "run_demo", "train_steps", "training_state",
           "verdict"]
