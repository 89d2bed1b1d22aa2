"""A training process for the crash/resume test (``tests/test_manager.py``), run as a script.

    python tests/resume_worker.py reference OUT_DIR STEPS
    python tests/resume_worker.py train CKPT_DIR STEPS

Both train a small TinyGPT (width 32, depth 1) with AdamW on tokens drawn from torch's global RNG,
one process thread, deterministically. Every line on stdout is one JSON event.

``reference`` trains STEPS steps uninterrupted, printing the digest of the training state after
every step (``{"event": "state", "step": s, "digest": ...}``, step 0 = the initial state), and
saves the final model and optimizer to ``OUT_DIR/final.gdsckpt``.

``train`` builds the model, prints ``ready`` and waits for a line on stdin (so a test can start it
ahead of time: importing torch is the slow part). Then it restores the newest complete checkpoint
of CKPT_DIR with a ``CheckpointManager`` (keep_last=2), prints ``restored`` with the step and the
digest of the restored state, and trains to STEPS, saving with ``save_async`` every SAVE_EVERY
steps and printing ``step`` after each step. It can be killed at any moment. When it gets to
STEPS it waits for its saves, saves ``CKPT_DIR/../final.gdsckpt`` and prints ``done``.

The digest covers the model's state_dict, the optimizer's state_dict and the RNG state, i.e.
exactly what the checkpoint holds, so a restored digest equal to the reference's digest of that
step means the restore was bit-exact.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import gdsckpt
from gdsckpt.demo import TinyGPT

SAVE_EVERY = 2
WIDTH, DEPTH, VOCAB, BATCH, LENGTH = 32, 1, 128, 4, 16


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def skip_dynamo_imports() -> None:
    """Keep ``torch._dynamo`` (about 3 s of CPU per process, mostly sympy) out of this process.

    ``torch.optim`` wraps ``zero_grad``, ``state_dict``, ``load_state_dict``, ``add_param_group``
    in a decorator that imports torch._dynamo on first call to mark them "not compiled", and its
    ``step`` wrapper imports it to insert a graph break. Nothing here compiles, so: mark the
    functions as already resolved (the decorator's own cache attribute) and run ``step``'s body
    under ``no_grad`` (see ``train_step``), which is what the wrapper does. The reference run uses
    the stock ``optimizer.step()``, so the bit-exact comparison also checks that this is the same.
    """
    import torch._compile

    decorated = torch._compile._disable_dynamo(lambda: None).__code__
    for cls in torch.optim.Optimizer.__mro__ + torch.optim.AdamW.__mro__:
        for attr in vars(cls).values():
            if getattr(attr, "__code__", None) is decorated:
                attr.__wrapped__.__dynamo_disable = attr.__wrapped__


def build() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, width=WIDTH, depth=DEPTH, heads=4, context=LENGTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # the data stream
    return model, optimizer


def train_step(model: TinyGPT, optimizer: torch.optim.Optimizer, *, stock: bool = False) -> None:
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if stock:
        optimizer.step()
    else:
        with torch.no_grad():
            inspect.unwrap(type(optimizer).step)(optimizer)


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = torch.empty(value.numel(), dtype=value.dtype)
        flat.copy_(value.detach().reshape(-1))
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(repr(value).encode())


def checkpoint_state(model: TinyGPT, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
            "step": step}


def digest_of(model: TinyGPT, optimizer: torch.optim.Optimizer) -> str:
    digest = hashlib.sha256()
    state = checkpoint_state(model, optimizer, 0)
    for key in ("model", "optimizer", "rng"):
        _feed(digest, state[key])
    return digest.hexdigest()


def final_state(model: TinyGPT, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def reference(out: Path, steps: int) -> None:
    model, optimizer = build()
    emit(event="state", step=0, digest=digest_of(model, optimizer))
    for step in range(1, steps + 1):
        train_step(model, optimizer, stock=True)
        emit(event="state", step=step, digest=digest_of(model, optimizer))
    gdsckpt.save(final_state(model, optimizer), out / "final.gdsckpt")
    emit(event="done", step=steps)


def train(directory: Path, steps: int) -> None:
    skip_dynamo_imports()
    model, optimizer = build()
    emit(event="ready", pid=os.getpid())
    if not sys.stdin.readline():
        return  # the test ended without needing this worker
    config = gdsckpt.Config(codec_threads=1, io_threads=2)
    manager = gdsckpt.CheckpointManager(directory, keep_last=2, config=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.restore_latest(model=model, optimizer=optimizer)
    if restored is None:
        step = 0
    else:
        step, extra = restored
        if extra["step"] != step:
            raise SystemExit(f"checkpoint of step {step} holds step {extra['step']}")
        torch.set_rng_state(extra["rng"])
    emit(event="restored", step=step, digest=digest_of(model, optimizer),
         warnings=[str(w.message) for w in caught])
    while step < steps:
        train_step(model, optimizer)
        step += 1
        if step % SAVE_EVERY == 0 or step == steps:
            manager.save_async(step, checkpoint_state(model, optimizer, step))
        emit(event="step", step=step)
    manager.wait()
    gdsckpt.save(final_state(model, optimizer), directory.parent / "final.gdsckpt")
    emit(event="done", step=step, steps=manager.steps(), dynamo="torch._dynamo" in sys.modules)


def main() -> None:
    mode, directory, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "reference":
        reference(directory, steps)
    elif mode == "train":
        train(directory, steps)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
