"""FSDP2 training with torch.distributed.checkpoint through gdsckpt's storage layer.

Each rank trains its shard of a small MLP wrapped with FSDP2 (``fully_shard``); every
``--every`` steps the sharded model and optimizer state is checkpointed with ``dcp.save`` (or
``dcp.async_save``, which returns once the state is staged in CPU memory) through
``GdsStorageWriter``: one compressed gdsckpt file per rank plus DCP's ``.metadata``. At the end a
fresh model is restored with ``dcp.load`` through ``GdsStorageReader`` and checked bit-exact
against the trained one. A checkpoint saved at one world size loads at another (resharding).
``async_save`` gets its own gloo process group: its collectives run in a background thread while
FSDP's run on the main thread, and on one shared group they would interleave and hang.

Runs on the CPU with gloo (1-2 ranks are enough to try it), or on GPUs with NCCL::

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --steps 6 --every 3 --async-save
    python3 examples/fsdp2_train.py --nprocs 2          # spawns the ranks itself (CPU, gloo)

On GPUs (``--device cuda``) the process group is ``cpu:gloo,cuda:nccl``, as ``async_save`` needs
a CPU backend; the GPU path has not been run on a GPU host yet.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from gdsckpt.dcp import GdsStorageReader, GdsStorageWriter


class AppState(Stateful):
    """Model + optimizer as one DCP ``Stateful``: sharded (DTensor) state dicts in and out."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def build(device: torch.device, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
        torch.nn.GELU(), torch.nn.Linear(width, 1),
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, width: int,
               device: torch.device) -> float:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(16, width, generator=g).to(device)
    y = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def run(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, optimizer = build(device, args.width)
    root = Path(args.dir)
    pending = None
    last = None
    # async_save runs DCP's collectives in a background thread while training runs FSDP's on the
    # main thread: on one process group they would interleave and deadlock, so it gets its own
    save_group = dist.new_group(backend="gloo") if args.async_save else None
    for step in range(1, args.steps + 1):
        loss = train_step(model, optimizer, step, args.width, device)
        if step % args.every == 0:
            if pending is not None:
                pending.result()  # at most one background save at a time
            path = root / f"step-{step:06d}"
            writer = GdsStorageWriter(path, codec=args.codec)
            started = time.perf_counter()
            state = {"app": AppState(model, optimizer), "step": step}
            if args.async_save:
                pending = dcp.async_save(state, storage_writer=writer, process_group=save_group)
            else:
                dcp.save(state, storage_writer=writer)
            last = path
            if rank == 0:
                verb = "staged" if args.async_save else "saved"
                print(f"step {step}: loss {loss:.4f}, {verb} {path.name} in "
                      f"{time.perf_counter() - started:.2f}s", flush=True)
    if pending is not None:
        pending.result()
    dist.barrier()
    if last is None:
        return

    # restore into a fresh model and optimizer, and compare with the trained ones
    fresh_model, fresh_optimizer = build(device, args.width)
    restored = {"app": AppState(fresh_model, fresh_optimizer), "step": 0}
    dcp.load(restored, storage_reader=GdsStorageReader(last))
    trained = AppState(model, optimizer).state_dict()
    again = AppState(fresh_model, fresh_optimizer).state_dict()
    mismatches = 0
    for (name, a), (_name, b) in zip(sorted(_flat(trained).items()), sorted(_flat(again).items())):
        if isinstance(a, torch.Tensor):
            local_a = a.to_local() if hasattr(a, "to_local") else a
            local_b = b.to_local() if hasattr(b, "to_local") else b
            if local_a.dtype != local_b.dtype or not torch.equal(_bits(local_a), _bits(local_b)):
                mismatches += 1
                print(f"rank {rank}: {name} differs", flush=True)
        elif a != b:
            mismatches += 1
    if mismatches:
        raise SystemExit(f"rank {rank}: {mismatches} entries differ after dcp.load")
    if rank == 0:
        files = sorted(p.name for p in last.iterdir())
        size = sum(p.stat().st_size for p in last.iterdir())
        print(f"restored {last.name} (step {restored['step']}) bit-exact on {world} rank(s); "
              f"files {files}, {size} bytes", flush=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def _flat(tree: object, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, value in enumerate(tree):
            out.update(_flat(value, f"{prefix}{i}."))
        return out
    return {prefix: tree}


def _main_worker(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--codec", default="auto")
    parser.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="spawn this many ranks here (without torchrun); CPU: 1-2 is plenty")
    args = parser.parse_args()
    if "RANK" in os.environ and args.dir is None:
        parser.error("under torchrun, give --dir (a directory every rank sees)")
    temporary = args.dir is None
    if temporary:
        args.dir = tempfile.mkdtemp(prefix="fsdp2-gdsckpt-")
    try:
        if "RANK" in os.environ:  # under torchrun
            _main_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            import torch.multiprocessing as mp

            world = args.nprocs or 1
            mp.start_processes(_main_worker, args=(world, f"tcp://127.0.0.1:{port}", args), nprocs=world,
                               join=True, start_method="spawn")
    finally:
        if temporary:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
