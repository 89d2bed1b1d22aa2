"""``gdsckpt demo``: save a small transformer's model + AdamW state, restore it, check it bit-exact,
and print ratio and speed next to ``torch.save`` / ``torch.load`` on the same state.

Also home of ``TinyGPT`` and ``training_state``, the GPT-style model and the "trained for a few
steps on random tokens" state that tests and benchmarks share.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


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


def _durable_torch_save(state: Any, path: Path) -> None:
    with path.open("wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


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
             device: str | None = None) -> dict[str, Any]:
    """Run the demo and return its figures (also printed)."""
    from .. import api

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, optimizer = training_state(width=width, depth=depth, steps=3, device=device, vocab=4096)
    state: dict[str, Any] = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        ours, theirs = Path(tmp) / "demo.gdsckpt", Path(tmp) / "demo.pt"
        report = api.save(state, ours)
        started = time.perf_counter()
        _durable_torch_save(state, theirs)
        torch_save_seconds = time.perf_counter() - started

        fresh_model, _ = training_state(width=width, depth=depth, steps=0, device=device, seed=1, vocab=4096)
        fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
        target = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
        started = time.perf_counter()
        api.load_into(target, ours)
        load_seconds = time.perf_counter() - started
        started = time.perf_counter()
        torch.load(theirs, map_location=device, weights_only=True)
        torch_load_seconds = time.perf_counter() - started
        torch_bytes = theirs.stat().st_size

    restored = {"model": fresh_model.state_dict(), "optimizer": fresh_optimizer.state_dict()}
    mismatched = [key for key, value in state["model"].items() if not bit_equal(value, restored["model"][key])]
    for param_id, entries in state["optimizer"]["state"].items():
        for name, value in entries.items():
            if not bit_equal(torch.as_tensor(value), torch.as_tensor(restored["optimizer"]["state"][param_id][name])):
                mismatched.append(f"optimizer/state/{param_id}/{name}")
    mb = report.logical_bytes / 1e6
    figures = {
        "device": device, "logical_mb": mb, "ratio": report.ratio, "torch_ratio": report.logical_bytes / torch_bytes,
        "save_mb_s": mb / report.seconds, "torch_save_mb_s": mb / torch_save_seconds,
        "load_mb_s": mb / load_seconds, "torch_load_mb_s": mb / torch_load_seconds,
        "bit_exact": not mismatched and target["step"] == 3, "codec": report.codec, "backend": report.backend,
    }
    print(f"gdsckpt demo: TinyGPT width={width} depth={depth} + AdamW after 3 steps on {device}, "
          f"{mb:.1f} MB of tensors")
    print(f"{'':14}{'ratio':>8}{'save MB/s':>12}{'load MB/s':>12}")
    print(f"{'gdsckpt':14}{report.ratio:>8.3f}{figures['save_mb_s']:>12.0f}{figures['load_mb_s']:>12.0f}"
          f"   ({report.codec}, {report.backend})")
    print(f"{'torch.save':14}{figures['torch_ratio']:>8.3f}{figures['torch_save_mb_s']:>12.0f}"
          f"{figures['torch_load_mb_s']:>12.0f}")
    print("restored bit-exact: " + ("yes" if figures["bit_exact"] else f"NO ({', '.join(mismatched[:5])})"))
    verdicts = [verdict("save", mb / report.seconds, mb / torch_save_seconds, report.ratio, device),
                verdict("load", mb / load_seconds, mb / torch_load_seconds, report.ratio, device)]
    figures["verdicts"] = verdicts
    for line in verdicts:
        print(line)
    return figures


def verdict(what: str, mine: float, theirs: float, ratio: float, device: str) -> str:
    """One plain sentence: which side was faster at ``what`` in this run and, where torch won,
    the likely reason (each side ran once: small differences are noise)."""
    baseline = "torch.save" if what == "save" else "torch.load"
    if mine >= theirs:
        return f"{what}: gdsckpt faster, {mine / theirs:.1f}x {baseline}"
    if device == "cpu" and ratio > 1.0:
        why = (f"on this CPU, compressing costs more time than the {ratio:.2f}x fewer bytes save on this "
               f"storage; the GPU engine, or codec='none', is where gdsckpt is faster")
    else:
        why = "a state this small is dominated by fixed costs, and each side ran once"
    return f"{what}: {baseline} was faster here ({theirs:.0f} against {mine:.0f} MB/s): {why}"

__all__ = ["Block", "TinyGPT", "bit_equal", "run_demo", "train_steps", "training_state", "verdict"]
