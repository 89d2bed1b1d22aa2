"""The model the experiments measure on: the benchmarks' TinyGPT + AdamW at a given width and depth
(``experiments/benchlib.py`` builds the same; experiments do not import the benchmarks)."""

from __future__ import annotations

from typing import Any

import torch

from gdsckpt.demo import TinyGPT, train_steps

BATCH, LENGTH, VOCAB, HEADS = 4, 128, 8192, 16
MOMENTS = ("exp_avg", "exp_avg_sq")


def build_training(width: int, depth: int, steps: int, device: Any) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, width=width, depth=depth, heads=HEADS, context=LENGTH).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, steps, seed=0, batch=BATCH, length=LENGTH)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return model, optimizer


def training(width: int, depth: int, warmup: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    return build_training(width, depth, warmup, "cuda")


def state_of(model: TinyGPT, optimizer: torch.optim.Optimizer) -> dict:
    """A copy of the training state: bf16 weights, fp32 master weights, AdamW moments."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()},
            "master": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optimizer": {names[id(p)]: {k: s[k].clone() for k in MOMENTS} for p, s in optimizer.state.items()}}


def live_state(model: TinyGPT, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
