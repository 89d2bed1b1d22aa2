"""load_into on a real model and optimizer: resuming from a checkpoint is bit-identical to never
having stopped; mismatches are reported in full before anything is written."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gdsckpt
from gdsckpt.demo import TinyGPT, train_steps, training_state

WIDTH, DEPTH, VOCAB = 32, 1, 96


def _bits(tensor: torch.Tensor, h: Any) -> bytes:
    return h.tensor_bytes(tensor)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, h: Any) -> dict[str, Any]:
    """Every parameter, buffer and optimizer state tensor as (dtype, shape, bytes)."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        out[f"model/{key}"] = (value.dtype, tuple(value.shape), _bits(value, h))
    state = optimizer.state_dict()
    for param_id, entries in state["state"].items():
        for name, value in entries.items():
            value = torch.as_tensor(value)
            out[f"optimizer/{param_id}/{name}"] = (value.dtype, tuple(value.shape), _bits(value, h))
    groups = [{k: v for k, v in group.items()} for group in state["param_groups"]]
    out["param_groups"] = groups
    return out


def _assert_snapshots_equal(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    assert expected.keys() == actual.keys()
    differing = [key for key in expected if expected[key] != actual[key]]
    assert not differing, f"not bit-identical: {differing[:10]}"


def _save_training_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                         h: Any) -> None:
    gdsckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path,
                 config=h.small_config())


def _fresh(seed: int, width: int = WIDTH, depth: int = DEPTH, lr: float = 5e-2) -> tuple[Any, Any]:
    model, _ = training_state(width=width, depth=depth, steps=0, seed=seed, vocab=VOCAB)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def test_resume_is_bit_identical_to_an_uninterrupted_run(ckpt_path: Path, h: Any) -> None:
    model, optimizer = training_state(width=WIDTH, depth=DEPTH, steps=3, seed=0, vocab=VOCAB)
    _save_training_state(ckpt_path, model, optimizer, 3, h)
    saved = _snapshot(model, optimizer, h)

    fresh_model, fresh_optimizer = _fresh(seed=1)
    assert _snapshot(fresh_model, fresh_optimizer, h).keys() != saved.keys()  # no optimizer state yet
    parameters_before = {name: p for name, p in fresh_model.named_parameters()}
    pointers_before = {name: p.data_ptr() for name, p in fresh_model.named_parameters()}
    target = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}

    assert gdsckpt.load_into(target, ckpt_path) is target
    assert target["step"] == 3
    # In place: the very same parameter objects and memory.
    for name, p in fresh_model.named_parameters():
        assert p is parameters_before[name] and p.data_ptr() == pointers_before[name]
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # the checkpoint's, not 5e-2
    _assert_snapshots_equal(saved, _snapshot(fresh_model, fresh_optimizer, h))

    # Train both the uninterrupted original and the restored copy on the same data.
    loss_original = train_steps(model, optimizer, 3, seed=1234)
    loss_restored = train_steps(fresh_model, fresh_optimizer, 3, seed=1234)
    assert loss_original == loss_restored
    _assert_snapshots_equal(_snapshot(model, optimizer, h), _snapshot(fresh_model, fresh_optimizer, h))


def test_resume_from_a_state_dict_target(ckpt_path: Path, h: Any) -> None:
    """A plain state dict of tensors is filled in place, key by key."""
    model, optimizer = training_state(width=WIDTH, depth=DEPTH, steps=2, seed=0, vocab=VOCAB)
    _save_training_state(ckpt_path, model, optimizer, 2, h)
    fresh_model, _ = _fresh(seed=5)
    tensors = fresh_model.state_dict()
    gdsckpt.load_into({"model": tensors}, ckpt_path, strict=False)
    for key, value in model.state_dict().items():
        assert _bits(tensors[key], h) == _bits(value, h), key
        assert _bits(fresh_model.state_dict()[key], h) == _bits(value, h), key


def test_load_into_a_model_with_tied_weights(ckpt_path: Path, h: Any) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, width=WIDTH, depth=DEPTH)
    model.head.weight = model.embed.weight
    with torch.no_grad():
        model.embed.weight.mul_(3.0)
    gdsckpt.save({"model": model.state_dict()}, ckpt_path, config=h.small_config())
    torch.manual_seed(1)
    fresh = TinyGPT(vocab=VOCAB, width=WIDTH, depth=DEPTH)
    fresh.head.weight = fresh.embed.weight
    gdsckpt.load_into({"model": fresh}, ckpt_path)
    assert fresh.head.weight is fresh.embed.weight
    for key, value in model.state_dict().items():
        assert _bits(fresh.state_dict()[key], h) == _bits(value, h), key


def test_mismatched_width_raises_listing_every_differing_key(ckpt_path: Path, h: Any) -> None:
    model, optimizer = training_state(width=WIDTH, depth=DEPTH, steps=1, seed=0, vocab=VOCAB)
    _save_training_state(ckpt_path, model, optimizer, 1, h)
    wide, wide_optimizer = _fresh(seed=1, width=48)
    before = {k: _bits(v, h) for k, v in wide.state_dict().items()}
    with pytest.raises(gdsckpt.StateMismatchError) as caught:
        gdsckpt.load_into({"model": wide, "optimizer": wide_optimizer, "step": 0}, ckpt_path)
    message = str(caught.value)
    for key in wide.state_dict():
        assert f"model/{key}" in message, f"{key} not listed"
    assert "model/embed.weight" in message and "[96, 48]" in message and "[96, 32]" in message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, gdsckpt.CheckpointError)
    # Nothing was written.
    assert {k: _bits(v, h) for k, v in wide.state_dict().items()} == before
    assert not wide_optimizer.state


def test_missing_and_unexpected_keys_are_listed(ckpt_path: Path, h: Any) -> None:
    model, _ = training_state(width=WIDTH, depth=2, steps=0, seed=0, vocab=VOCAB)
    gdsckpt.save({"model": model.state_dict(), "extra": torch.ones(2)}, ckpt_path, config=h.small_config())

    shallow, _ = _fresh(seed=1, depth=1)
    with pytest.raises(gdsckpt.StateMismatchError) as caught:
        gdsckpt.load_into({"model": shallow}, ckpt_path, strict="exact")
    message = str(caught.value)
    assert "'model/blocks.1.qkv.weight': in checkpoint, missing from target" in message
    assert "'extra': in checkpoint, missing from target" in message
    assert "model/blocks.0" not in message
    # strict=True: only what the target asks for ("model") must match; "extra" is not asked for.
    with pytest.raises(gdsckpt.StateMismatchError) as caught:
        gdsckpt.load_into({"model": shallow}, ckpt_path)
    message = str(caught.value)
    assert "'model/blocks.1.qkv.weight': in checkpoint, missing from target" in message
    assert "'extra'" not in message

    deep, _ = _fresh(seed=1, depth=3)
    with pytest.raises(gdsckpt.StateMismatchError) as caught:
        gdsckpt.load_into({"model": deep, "extra": torch.zeros(2), "epoch": 0}, ckpt_path)
    message = str(caught.value)
    assert "'model/blocks.2.qkv.weight': in target, missing from checkpoint" in message
    assert "'epoch': in target, missing from checkpoint" in message
    assert "model/blocks.1" not in message and "'extra'" not in message


def test_strict_false_ignores_unexpected_checkpoint_entries(ckpt_path: Path, h: Any) -> None:
    model, _ = training_state(width=WIDTH, depth=2, steps=0, seed=0, vocab=VOCAB)
    gdsckpt.save({"model": model.state_dict(), "extra": torch.ones(2), "note": "hello", "step": 4},
                 ckpt_path, config=h.small_config())
    shallow, _ = _fresh(seed=1, depth=1)
    target = {"model": shallow, "step": 0}
    gdsckpt.load_into(target, ckpt_path, strict=False)
    assert target == {"model": shallow, "step": 4}
    expected = model.state_dict()
    for key, value in shallow.state_dict().items():
        assert _bits(value, h) == _bits(expected[key], h), key
    # strict=False does not excuse what the target needs and the checkpoint lacks.
    deep, _ = _fresh(seed=1, depth=3)
    with pytest.raises(gdsckpt.StateMismatchError, match="blocks.2"):
        gdsckpt.load_into({"model": deep}, ckpt_path, strict=False)


def test_strict_reports_unexpected_plain_values(ckpt_path: Path, h: Any) -> None:
    """A checkpoint entry the target does not hold is unexpected whether it is a tensor or a value."""
    model, optimizer = training_state(width=WIDTH, depth=DEPTH, steps=1, seed=0, vocab=VOCAB)
    _save_training_state(ckpt_path, model, optimizer, 1, h)
    fresh_model, fresh_optimizer = _fresh(seed=1)
    with pytest.raises(gdsckpt.StateMismatchError, match="'step': in checkpoint, missing from target"):
        gdsckpt.load_into({"model": fresh_model, "optimizer": fresh_optimizer}, ckpt_path, strict="exact")
    gdsckpt.load_into({"model": fresh_model, "optimizer": fresh_optimizer}, ckpt_path, strict=False)
    assert fresh_optimizer.state


def test_dtype_mismatch_is_reported(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save({"w": torch.ones(4, dtype=torch.float32)}, ckpt_path, config=h.small_config())
    target = {"w": torch.zeros(4, dtype=torch.float16)}
    with pytest.raises(gdsckpt.StateMismatchError, match=r"'w': target float16\[4\] != checkpoint float32\[4\]"):
        gdsckpt.load_into(target, ckpt_path)
    assert not target["w"].any()


def test_optimizer_missing_from_checkpoint(ckpt_path: Path, h: Any) -> None:
    model, _ = training_state(width=WIDTH, depth=DEPTH, steps=0, seed=0, vocab=VOCAB)
    gdsckpt.save({"model": model.state_dict()}, ckpt_path, config=h.small_config())
    fresh_model, fresh_optimizer = _fresh(seed=1)
    with pytest.raises(gdsckpt.StateMismatchError, match="optimizer"):
        gdsckpt.load_into({"model": fresh_model, "optimizer": fresh_optimizer}, ckpt_path)


def test_load_into_non_contiguous_target_tensor(ckpt_path: Path, h: Any) -> None:
    source = torch.randn(6, 5)
    gdsckpt.save({"w": source}, ckpt_path, config=h.small_config())
    storage = torch.zeros(5, 6)
    target = {"w": storage.t()}  # a non-contiguous view into `storage`
    gdsckpt.load_into(target, ckpt_path)
    assert _bits(target["w"], h) == _bits(source, h)
    assert _bits(storage, h) == _bits(source.t(), h)


def test_load_into_rejects_unfillable_targets(ckpt_path: Path, h: Any) -> None:
    gdsckpt.save({"w": torch.ones(2)}, ckpt_path, config=h.small_config())
    with pytest.raises(TypeError, match="'w'"):
        gdsckpt.load_into({"w": object()}, ckpt_path)


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_load_into_a_lazily_conjugated_or_negated_view_is_a_type_error(tmp_path: Path, view: str) -> None:
    """A target that is a lazy view (``z.conj()``, a negative view) holds in memory the conjugate
    or negation of what it reads: ``load_into`` failed with a bare ``RuntimeError`` from taking a
    byte view of it. It is now a ``TypeError`` naming the key and what to pass instead, and the
    viewed tensor is left as it was."""
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"c": torch.randn(8, dtype=torch.complex64)}, path)
    z = torch.zeros(8, dtype=torch.complex64)
    target = z.conj() if view == "conj" else torch._neg_view(z)
    with pytest.raises(TypeError, match="load_into cannot fill the tensor at 'c': a lazily"):
        gdsckpt.load_into({"c": target}, path)
    assert torch.equal(z, torch.zeros(8, dtype=torch.complex64))


def test_load_into_a_target_whose_tuple_holds_the_saved_plain_values(tmp_path: Path, h: Any) -> None:
    """``{"betas": (0.9, 0.999)}``: a tuple cannot be assigned into, and its plain values were left
    out of the target, so the very state that was saved was refused as missing them. Equal values
    now match (bit for bit); a differing one is a mismatch naming the key, nothing written."""
    path = tmp_path / "t.gdsckpt"
    gdsckpt.save({"w": torch.ones(2), "hparams": {"betas": (0.9, 0.999), "eps": -0.0}}, path)
    for strict in (True, "exact"):
        target = {"w": torch.zeros(2), "hparams": {"betas": (0.9, 0.999), "eps": 1.0}}
        gdsckpt.load_into(target, path, strict=strict)
        assert torch.equal(target["w"], torch.ones(2)) and target["hparams"]["betas"] == (0.9, 0.999)
        assert str(target["hparams"]["eps"]) == "-0.0"
    differing = {"w": torch.zeros(2), "hparams": {"betas": (0.95, 0.999), "eps": 1.0}}
    with pytest.raises(gdsckpt.StateMismatchError, match="'hparams/betas/0': target 0.95 != checkpoint 0.9"):
        gdsckpt.load_into(differing, path)
    assert torch.equal(differing["w"], torch.zeros(2)) and differing["hparams"]["eps"] == 1.0
    with pytest.raises(gdsckpt.StateMismatchError, match="'hparams/betas/2': in target, missing"):
        gdsckpt.load_into({"hparams": {"betas": (0.9, 0.999, 1)}}, path, strict=False)


def test_load_into_refuses_a_slot_two_saved_keys_of_different_types_share(tmp_path: Path) -> None:
    """``{1: 5, "1": "five"}`` saves and loads as it is, but a path spells both keys ``"1"``: a
    ``load_into`` target's ``"1"`` slot was filled with the int key's value, silently. It is now
    a mismatch that names the key, nothing written."""
    path = tmp_path / "k.gdsckpt"
    gdsckpt.save({"cfg": {1: 5, "1": "five"}, "w": torch.ones(1)}, path)
    assert gdsckpt.load(path)["cfg"] == {1: 5, "1": "five"}
    target = {"cfg": {"1": "x"}, "w": torch.zeros(1)}
    with pytest.raises(gdsckpt.StateMismatchError, match="'cfg/1': the checkpoint holds two entries"):
        gdsckpt.load_into(target, path, strict=False)
    assert target["cfg"] == {"1": "x"} and torch.equal(target["w"], torch.zeros(1))


class _Counted(torch.nn.Module):
    """A module with extra state (``get_extra_state``): its state_dict holds a dict beside tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.counter = 0

    def get_extra_state(self) -> Any:
        return {"counter": self.counter, "table": torch.arange(3)}

    def set_extra_state(self, state: Any) -> None:
        self.counter = state["counter"]
        self.table = state["table"]


def test_load_into_a_module_with_extra_state_restores_it_as_load_state_dict_does(tmp_path: Path, h: Any) -> None:
    """A module with extra state failed with ``AttributeError: 'dict' object has no attribute
    'device'``; its extra state now goes to ``set_extra_state``, tensors in it included, and its
    absence from the checkpoint is a mismatch."""
    path = tmp_path / "m.gdsckpt"
    source = torch.nn.Sequential(_Counted(), torch.nn.Linear(2, 1))
    source[0].counter = 7
    gdsckpt.save(source.state_dict(), path)
    target = torch.nn.Sequential(_Counted(), torch.nn.Linear(2, 1))
    gdsckpt.load_into(target, path, strict="exact")
    assert target[0].counter == 7 and torch.equal(target[0].table, torch.arange(3))
    assert all(_bits(a, h) == _bits(b, h) for a, b in zip(source.state_dict().values(), target.state_dict().values())
               if isinstance(a, torch.Tensor))
    gdsckpt.save({k: v for k, v in source.state_dict().items() if "extra" not in k}, path)
    with pytest.raises(gdsckpt.StateMismatchError, match="'0._extra_state': extra state missing"):
        gdsckpt.load_into(torch.nn.Sequential(_Counted(), torch.nn.Linear(2, 1)), path)


def _expanded() -> torch.Tensor:
    return torch.zeros(1).expand(4)


def _meta() -> torch.Tensor:
    return torch.empty(4, device="meta")


def _sparse() -> torch.Tensor:
    return torch.zeros(4).to_sparse()


@pytest.mark.parametrize("make, why", [(_expanded, "expanded view"), (_meta, "meta tensor"), (_sparse, "sparse_coo"),
                                       (lambda: torch.nn.LazyLinear(4).weight, "uninitialized")])
def test_load_into_refuses_a_tensor_it_cannot_fill_before_writing_anything(tmp_path: Path, make: Any,
                                                                           why: str) -> None:
    """An expanded view (its elements share memory), a meta, a sparse or a lazy (uninitialized)
    tensor failed inside the restore, with torch's message naming no key, after the other
    targets were written. Each is now a ``TypeError`` naming the key before anything is read."""
    path = tmp_path / "u.gdsckpt"
    gdsckpt.save({"a": torch.ones(4), "t": torch.ones(4)}, path)
    first = torch.zeros(4)
    with pytest.raises(TypeError, match=f"cannot fill the tensor at 't': .*{why}"):
        gdsckpt.load_into({"a": first, "t": make()}, path)
    assert torch.equal(first, torch.zeros(4))


def test_load_into_a_non_contiguous_inference_tensor(tmp_path: Path, h: Any) -> None:
    """A non-contiguous tensor made under ``torch.inference_mode`` is filled by a copy, which torch
    allows only in inference mode: it failed there, after other targets were written."""
    path = tmp_path / "i.gdsckpt"
    source = torch.randn(3, 5)
    gdsckpt.save({"w": source, "alias": source}, path)
    with torch.inference_mode():
        storage = torch.zeros(5, 3)
        tied = torch.zeros(3, 5)
    target = {"w": storage.t(), "alias": tied}
    gdsckpt.load_into(target, path)
    assert _bits(target["w"], h) == _bits(source, h) and _bits(tied, h) == _bits(source, h)


def test_parameters_that_need_grad_and_are_not_contiguous_are_filled(tmp_path: Path, h: Any) -> None:
    """A channels_last convnet (the usual recipe for convnets), a weight stored transposed and a
    checkpoint tied where the model is not: each Parameter filled through a copy (not in its own
    memory) was refused by torch ("a leaf Variable that requires grad is being used in an
    in-place operation") after the other tensors were overwritten."""
    torch.manual_seed(0)

    def convnet() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3)).to(
            memory_format=torch.channels_last)

    source, target = convnet(), convnet()
    transposed = torch.nn.Parameter(torch.zeros(4, 3).t())
    assert not transposed.is_contiguous() and transposed.requires_grad
    tied = torch.randn(5, 2)
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"net": source.state_dict(), "t": torch.randn(3, 4), "a": tied, "b": tied}, path)
    a, b = torch.nn.Parameter(torch.zeros(5, 2)), torch.nn.Parameter(torch.zeros(5, 2))
    gdsckpt.load_into({"net": target, "t": transposed, "a": a, "b": b}, path)
    expected = gdsckpt.load(path)
    for key, value in target.state_dict().items():
        h.assert_same(expected["net"][key], value.contiguous())
    h.assert_same(expected["t"], transposed.detach().contiguous())
    h.assert_same(tied, a.detach())
    h.assert_same(tied, b.detach())
    assert transposed.requires_grad and a.requires_grad and target[0].weight.requires_grad


def test_an_optimizer_that_does_not_fit_is_refused_before_the_model_is_written(tmp_path: Path) -> None:
    """``optimizer.load_state_dict`` runs after the tensors are restored; its own checks (the
    number of parameter groups, of parameters in each) are made with the others, first."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    path = tmp_path / "o.gdsckpt"
    gdsckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 5}, path)
    other = torch.nn.Linear(8, 8)
    before = {key: value.clone() for key, value in other.state_dict().items()}
    for groups, message in (([{"params": [other.weight]}, {"params": [other.bias]}], "2"),
                            ([{"params": [other.weight]}], "group 0 holds 2 parameter")):
        target = {"model": other, "optimizer": torch.optim.AdamW(groups, lr=1e-3), "step": 0}
        with pytest.raises(gdsckpt.StateMismatchError, match=message):
            gdsckpt.load_into(target, path)
        assert target["step"] == 0
        assert all(torch.equal(before[key], value) for key, value in other.state_dict().items())
    not_an_optimizer = tmp_path / "n.gdsckpt"
    gdsckpt.save({"model": model.state_dict(), "optimizer": {"lr": 0.1}}, not_an_optimizer)
    with pytest.raises(gdsckpt.StateMismatchError, match="no optimizer state_dict"):
        gdsckpt.load_into({"model": other, "optimizer": torch.optim.AdamW(other.parameters())}, not_an_optimizer)
    assert all(torch.equal(before[key], value) for key, value in other.state_dict().items())


def test_copies_for_non_contiguous_targets_stay_within_max_inflight_bytes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          h: Any) -> None:
    """Each non-contiguous target is filled through a contiguous copy; all of them were made
    before the first read, twice a channels_last model's memory whatever ``max_inflight_bytes``
    said. The copies alive at once are counted as the targets make and finish them."""
    from gdsckpt.state.arrays import TorchTarget

    live, peak = [0], [0]
    made, finish = TorchTarget.__init__, TorchTarget.finish

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        if self.existing is not None and self.tensor is not self.existing:
            live[0] += self.nbytes
            peak[0] = max(peak[0], live[0])

    def counting_finish(self: Any) -> Any:
        if self.existing is not None and self.tensor is not self.existing:
            live[0] -= self.nbytes
        return finish(self)

    monkeypatch.setattr(TorchTarget, "__init__", counting_init)
    monkeypatch.setattr(TorchTarget, "finish", counting_finish)
    source = {f"w{i}": torch.randn(256, 512) for i in range(10)}  # 512 KiB each
    source["small"] = torch.randn(8)
    path = tmp_path / "t.gdsckpt"
    gdsckpt.save(source, path)
    target = {f"w{i}": torch.zeros(512, 256).t() for i in range(10)}
    target["small"] = torch.zeros(8)
    assert not target["w0"].is_contiguous()
    gdsckpt.load_into(target, path, config=gdsckpt.Config(max_inflight_bytes=1 << 20, chunk_bytes=1 << 20))
    for key, value in source.items():
        h.assert_same(value, target[key].contiguous())
    assert live[0] == 0 and 0 < peak[0] <= 1 << 20, f"{peak[0]} bytes of copies at once"


def test_the_optimizer_check_leaves_hooks_and_tuples_to_torch(tmp_path: Path) -> None:
    """The check made before anything is written is torch's own: a ``load_state_dict`` pre-hook
    may reshape what it is given (two saved groups merged into one here), and tuples of groups or
    parameters are what torch accepts too."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    two_groups = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1, momentum=0.9)
    (a.sum() + b.sum()).backward()
    two_groups.step()
    path = tmp_path / "o.gdsckpt"
    gdsckpt.save({"optimizer": two_groups.state_dict()}, path)

    def merge(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        groups = state["param_groups"]
        merged = dict(groups[0], params=list(groups[0]["params"]) + list(groups[1]["params"]))
        return {"state": state["state"], "param_groups": [merged]}

    one_group = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))],
                                lr=0.5, momentum=0.9)
    one_group.register_load_state_dict_pre_hook(merge)
    gdsckpt.load_into({"optimizer": one_group}, path)
    assert one_group.param_groups[0]["lr"] == 0.1
    assert torch.equal(one_group.state_dict()["state"][1]["momentum_buffer"], torch.ones(3))

    saved = two_groups.state_dict()
    as_tuples = {"state": saved["state"],
                 "param_groups": tuple(dict(g, params=tuple(g["params"])) for g in saved["param_groups"])}
    gdsckpt.save({"optimizer": as_tuples}, path)
    fresh = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                             {"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=0.5, momentum=0.9)
    gdsckpt.load_into({"optimizer": fresh}, path)
    assert fresh.param_groups[1]["lr"] == 0.1


def test_a_later_key_wins_over_an_earlier_non_contiguous_view_of_the_same_memory(tmp_path: Path) -> None:
    """``{"first": base.t(), "second": base}``: filled key by key as ``load_state_dict`` does, the
    later key wins. The non-contiguous earlier view was moved to a phase of its own after all the
    others (to bound its copy's memory), and overwrote the later key's values."""
    path = tmp_path / "c.gdsckpt"
    saved = {"first": torch.full((3, 2), 1.0), "second": torch.full((2, 3), 2.0)}
    gdsckpt.save(saved, path)
    base = torch.zeros(2, 3)
    gdsckpt.load_into({"first": base.t(), "second": base}, path)
    assert torch.equal(base, saved["second"])
    other = torch.zeros(2, 3)  # the other order: the view is the later key and wins
    gdsckpt.load_into({"second": other, "first": other.t()}, path)
    assert torch.equal(other.t(), saved["first"])


@pytest.mark.parametrize("make", [lambda m: m.as_strided((3, 3), (1, 1)), lambda m: m.unfold(0, 3, 1)[:3]])
def test_a_target_whose_elements_share_memory_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                     make: Any) -> None:
    """A view over 5 floats holding 9 elements cannot hold the checkpoint's values: it was filled
    and reported restored, holding [[0, 3, 6], [3, 6, 7], [6, 7, 8]] for arange(9)."""
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"a": torch.ones(4), "x": torch.arange(9.0).reshape(3, 3)}, path)
    memory, a = torch.zeros(5), torch.zeros(4)
    with pytest.raises(TypeError, match="load_into cannot fill the tensor at 'x': a view whose elements share"):
        gdsckpt.load_into({"a": a, "x": make(memory)}, path)
    assert not a.any() and not memory.any()


def test_views_that_overlap_nothing_pass_the_overlap_check() -> None:
    """The check against brute force over small strided layouts (transposes, gaps, interleaving)."""
    import itertools
    import random

    from gdsckpt.api.in_place import _overlaps_itself

    chooser = random.Random(0)
    for _ in range(2000):
        rank = chooser.randint(1, 3)
        shape = [chooser.randint(1, 4) for _ in range(rank)]
        strides = [chooser.randint(0, 7) for _ in range(rank)]
        offsets = [sum(i * s for i, s in zip(place, strides)) for place in itertools.product(*map(range, shape))]
        assert _overlaps_itself(shape, strides) == (len(set(offsets)) < len(offsets)), (shape, strides)


def test_a_module_whose_state_dict_makes_copies_is_refused_not_left_unrestored(tmp_path: Path) -> None:
    """A layer that saves its bf16 weights as float32 (``_save_to_state_dict`` returning copies):
    ``load_into`` filled the copies and returned, the module keeping its old weights."""

    class SavesFloat32(torch.nn.Linear):
        def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
            for name, param in self._parameters.items():
                destination[prefix + name] = param.detach().float()

    torch.manual_seed(0)
    source = SavesFloat32(4, 4).to(torch.bfloat16)
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"model": source.state_dict(), "step": 1}, path)
    target = SavesFloat32(4, 4).to(torch.bfloat16)
    before = target.weight.detach().clone()
    with pytest.raises(TypeError, match="makes a new one each time it is asked"):
        gdsckpt.load_into({"model": target}, path)
    assert torch.equal(target.weight, before)
    # a module whose state_dict hands out its own tensors (or views of them) is filled in place
    plain = torch.nn.Linear(4, 4)
    gdsckpt.save({"model": plain.state_dict()}, path)
    other = torch.nn.Linear(4, 4)
    gdsckpt.load_into({"model": other}, path)
    assert torch.equal(other.weight, plain.weight)


def test_an_overlapping_view_whose_entry_is_an_alias_keeps_its_key_order(tmp_path: Path) -> None:
    """``model/w`` stored as an alias of ``ema/w`` (one tensor under two keys), the target only
    ``model`` with ``w`` a transposed view overlapping the later ``c``: the view was moved after
    ``c`` (phases are keyed by stored array, the overlap set by key), so ``w`` won the overlap."""
    weights, row = torch.arange(16.0).reshape(4, 4) + 100, torch.full((4,), -1.0)
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"ema": {"w": weights}, "model": {"w": weights, "c": row}}, path)
    base = torch.zeros(4, 4)
    gdsckpt.load_into({"model": {"w": base.t(), "c": base[0]}}, path)
    expected = torch.zeros(4, 4)
    expected.t().copy_(weights)
    expected[0].copy_(row)
    assert torch.equal(base, expected)


def test_a_module_that_saves_a_live_attribute_tensor_is_filled(tmp_path: Path) -> None:
    """A ``_save_to_state_dict`` that adds a tensor the module keeps as a plain attribute (not a
    registered buffer): the same memory on every call, so it is filled in place, not refused as
    a copy."""

    class KeepsTable(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(3, 3)
            self.table = torch.zeros(5)

        def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            destination[prefix + "table"] = self.table

    source = KeepsTable()
    source.table += torch.arange(5.0)
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"m": source.state_dict()}, path)
    target = KeepsTable()
    gdsckpt.load_into({"m": target}, path)
    assert torch.equal(target.table, torch.arange(5.0)) and torch.equal(target.weight, source.weight)


def test_a_lazy_module_or_a_nested_tensor_is_refused_naming_the_key(tmp_path: Path) -> None:
    """``load_into(nn.LazyLinear(3), p)`` raised torch's "uninitialized parameter" error (the
    module's storage was asked for before the fillability check), and a nested tensor target an
    internal torch error; both are the documented ``TypeError`` naming the key, nothing written."""
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"weight": torch.ones(3, 2), "bias": torch.ones(3)}, path)
    with pytest.raises(TypeError, match=r"at 'weight': an uninitialized \(lazy\) parameter"):
        gdsckpt.load_into(torch.nn.LazyLinear(3), path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the strided nested layout is a prototype
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match="at 'bias': a nested tensor"):
        gdsckpt.load_into({"weight": torch.zeros(3, 2), "bias": nested}, path, strict=False)


def test_a_filled_tensor_advances_its_autograd_version(tmp_path: Path) -> None:
    """Contiguous targets are written through views of their memory that autograd does not see:
    a graph that saved the old values ran backward() on the new ones, silently wrong. Their
    version now advances as with ``copy_``, and autograd raises."""
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"w": torch.full((4,), 2.0)}, path)
    weight = torch.nn.Parameter(torch.ones(4))
    loss = (weight * weight).sum()  # saves weight for backward
    version = weight._version
    gdsckpt.load_into({"w": weight}, path)
    assert weight._version > version and torch.equal(weight.detach(), torch.full((4,), 2.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_an_aliased_numpy_bfloat16_entry_fills_a_torch_target(tmp_path: Path) -> None:
    """``{"emb": a, "head": a}`` of a NumPy bfloat16 array, loaded into a torch ``head`` only: its
    bytes are in the alias's array, which ``torch.as_tensor`` refused (ml_dtypes) after the other
    targets had been written."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    array = (np.arange(6, dtype=np.float32) - 2.5).astype(ml_dtypes.bfloat16)
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"emb": array, "head": array, "w": np.ones(3, np.float32)}, path)
    head, w = torch.zeros(6, dtype=torch.bfloat16), torch.zeros(3)
    gdsckpt.load_into({"head": head, "w": w}, path, strict=False)
    assert head.view(torch.int16).numpy().tobytes() == array.view(np.int16).tobytes()
    assert torch.equal(w, torch.ones(3))
    scalar = np.asarray(1.5, dtype=ml_dtypes.bfloat16)  # 0-d: its bits must keep the shape ()
    gdsckpt.save({"emb": scalar, "head": scalar}, path)
    head = torch.zeros((), dtype=torch.bfloat16)
    gdsckpt.load_into({"head": head}, path, strict=False)
    assert head.item() == 1.5


def test_numpy_scalars_in_a_target_take_the_checkpoints_values(tmp_path: Path) -> None:
    """A NumPy float64 (a float subclass) was matched as a plain value while the save stored it as
    an array: "in target, missing from checkpoint" and "in checkpoint, missing from target" for
    one key. Its slot now takes the checkpoint's value; in a tuple it is refused clearly."""
    import numpy as np

    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"w": torch.ones(2), "best": np.float64(0.25), "history": [np.int64(3), 1.5]}, path)
    target = {"w": torch.zeros(2), "best": np.float64(9.0), "history": [np.int64(0), 0.0]}
    gdsckpt.load_into(target, path)
    assert type(target["best"]) is np.float64 and target["best"] == 0.25
    assert type(target["history"][0]) is np.int64 and target["history"] == [3, 1.5]
    with pytest.raises(TypeError, match="in a tuple"):
        gdsckpt.load_into({"w": torch.zeros(2), "best": 0.0, "history": (np.int64(0), 0.0)}, path)
    # only a single value fills such a slot, as for a plain one: an array or a dict is a mismatch
    gdsckpt.save({"x": {"a": torch.ones(2)}, "y": np.arange(1000.0)}, path)
    target = {"x": np.float64(0), "y": np.float64(0)}
    with pytest.raises(gdsckpt.StateMismatchError, match=r"'x': target NumPy scalar != checkpoint dict"
                                                         r"(.|\n)*'y': target NumPy scalar != checkpoint float64\[1000\]"):
        gdsckpt.load_into(target, path)
    assert target == {"x": 0.0, "y": 0.0}


def test_a_module_with_load_state_dict_hooks_is_warned_about(tmp_path: Path) -> None:
    """A module whose load_state_dict post-hook rebuilds a derived buffer was left stale without a
    word (``load_into`` fills tensors in place and runs no hooks): it now warns, naming it."""
    module = torch.nn.Linear(2, 2)
    module.register_load_state_dict_post_hook(lambda _module, _keys: None)
    path = tmp_path / "a.gdsckpt"
    gdsckpt.save(torch.nn.Linear(2, 2).state_dict(), path)
    with pytest.warns(UserWarning, match="does not run the load_state_dict hooks of Linear") as caught:
        gdsckpt.load_into(module, path)
    assert caught[0].filename == __file__
