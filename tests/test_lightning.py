"""The PyTorch Lightning plugin (``gdsckpt.lightning.GdsCheckpointIO``) with a real ``Trainer``.

A tiny regression model trains on the CPU, 3 batches an epoch, with ``ModelCheckpoint`` saving
through the plugin; a second ``Trainer`` resumes from the file. Checkpoints are compared bit-exact
against the dict Lightning handed to the plugin.
"""

from __future__ import annotations

import argparse
import collections
import copy
import errno
import importlib
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import gdsckpt
from gdsckpt.demo import bit_equal
from gdsckpt.lightning import GdsCheckpointIO

pytestmark = [
    # Lightning's advice for real training jobs (given where the machine has more than 2 cores),
    # irrelevant to a 3-batch CPU test.
    pytest.mark.filterwarnings("ignore:The '(train|val)_dataloader' does not have many workers"),
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates.
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
    # A resumed job writes into the directory of the run it resumes, as it should.
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    # On a machine with a GPU, Lightning advises using it; these tests train on the CPU on purpose
    # (accelerator="cpu"), the same on every machine.
    pytest.mark.filterwarnings("ignore:GPU available but not used"),
]

BATCHES_PER_EPOCH = 3


class TinyRegressor(L.LightningModule):
    """Linear-tanh-linear with AdamW and a per-epoch StepLR: optimizer and scheduler state both
    change the next steps, so a resume that lost either would train differently."""

    def __init__(self, lr: float = 0.05, data_dir: Any = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def make_model(seed: int, **hparams: Any) -> TinyRegressor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyRegressor(**hparams)


def make_loader() -> Any:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(4 * BATCHES_PER_EPOCH, 4, generator=generator)
    y = torch.randn(4 * BATCHES_PER_EPOCH, 1, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def make_trainer(root: Path, max_epochs: int, plugin: Any = None, callbacks: list[Any] | None = None) -> Any:
    callbacks = list(callbacks or [])
    return L.Trainer(
        max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, deterministic=True,
        default_root_dir=root, plugins=[plugin] if plugin is not None else None, callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )


class RecordSaved(Callback):
    """Keeps a deep copy of each checkpoint dict Lightning builds, by global step (this hook runs
    after every part of the dict is gathered, just before the CheckpointIO writes it)."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, Any]] = {}

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.saved[checkpoint["global_step"]] = copy.deepcopy(checkpoint)


class RecordAtStart(Callback):
    """Keeps the model, optimizer and scheduler state as training (re)starts."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.global_step = trainer.global_step
        self.model = copy.deepcopy(pl_module.state_dict())
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.scheduler = copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict())


def final_state(model: Any, trainer: Any) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict())}


def test_fit_saves_gdsckpt_files_and_resume_continues_bit_exact(tmp_path: Path, h: Any) -> None:
    recorder = RecordSaved()
    directory = tmp_path / "checkpoints"
    first = make_trainer(tmp_path, 1, GdsCheckpointIO(), [ModelCheckpoint(dirpath=directory), recorder])
    first.fit(make_model(0), make_loader())
    path = directory / f"epoch=0-step={BATCHES_PER_EPOCH}.ckpt"
    assert sorted(p.name for p in directory.iterdir()) == [path.name]
    info = gdsckpt.inspect(path)  # a gdsckpt file, not torch.save's zip
    assert any(t.key == "state_dict/net.0.weight" for t in info.tensors)
    gdsckpt.verify(path)
    saved = recorder.saved[BATCHES_PER_EPOCH]
    h.assert_same(saved, GdsCheckpointIO().load_checkpoint(path))

    # A differently initialised model resumes from the file and trains one more epoch, with the
    # same ModelCheckpoint directory as a restarted job has.
    at_start = RecordAtStart()
    second_recorder = RecordSaved()
    resumed_model = make_model(1)
    second = make_trainer(tmp_path, 2, GdsCheckpointIO(),
                          [ModelCheckpoint(dirpath=directory), at_start, second_recorder])
    second.fit(resumed_model, make_loader(), ckpt_path=path)
    assert at_start.global_step == BATCHES_PER_EPOCH
    h.assert_same(saved["state_dict"], at_start.model)
    h.assert_same(saved["optimizer_states"][0], at_start.optimizer)
    h.assert_same(saved["lr_schedulers"][0], at_start.scheduler)
    resumed = final_state(resumed_model, second)

    # The same two epochs without interruption (and without any checkpointing).
    reference_model = make_model(0)
    reference = make_trainer(tmp_path, 2)
    reference.fit(reference_model, make_loader())
    expected = final_state(reference_model, reference)
    h.assert_same(expected, resumed)
    assert not bit_equal(expected["model"]["net.0.weight"], saved["state_dict"]["net.0.weight"])  # it trained
    # ModelCheckpoint keeps the file a run resumed from.
    last = directory / f"epoch=1-step={2 * BATCHES_PER_EPOCH}.ckpt"
    assert sorted(p.name for p in directory.iterdir()) == [path.name, last.name]
    h.assert_same(second_recorder.saved[2 * BATCHES_PER_EPOCH], GdsCheckpointIO().load_checkpoint(last))


def test_async_saves_match_the_state_at_each_save(tmp_path: Path, h: Any) -> None:
    recorder = RecordSaved()
    plugin = GdsCheckpointIO(codec="lz4", async_save=True)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    make_trainer(tmp_path, 1, plugin, [checkpoint, recorder]).fit(make_model(0), make_loader())
    assert sorted(recorder.saved) == [1, 2, 3]
    for step, saved in recorder.saved.items():
        path = tmp_path / "ckpt" / f"epoch=0-step={step}.ckpt"
        # gdsckpt.inspect, not the plugin (whose load waits for a pending save): fit() returned, so
        # teardown has waited for every background save.
        assert "state_dict/net.0.weight" in {t.key for t in gdsckpt.inspect(path).tensors}
        h.assert_same(saved, plugin.load_checkpoint(path))
    # The states differ from step to step: a file written from the live tensors after a later
    # step would not match.
    weights = [saved["state_dict"]["net.0.weight"] for saved in recorder.saved.values()]
    assert not bit_equal(weights[0], weights[1]) and not bit_equal(weights[1], weights[2])


def _disk_full(self: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


def test_async_background_error_surfaces_in_next_save_and_teardown(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from gdsckpt.io.posix import PosixWriter

    monkeypatch.setattr(PosixWriter, "commit", _disk_full)
    plugin = GdsCheckpointIO(async_save=True)
    state = {"state_dict": {"w": torch.arange(6.0)}, "global_step": 1}
    plugin.save_checkpoint(state, tmp_path / "a.ckpt")  # returns: the write runs in the background
    with pytest.raises(OSError, match="No space left") as caught:
        plugin.save_checkpoint(state, tmp_path / "b.ckpt")  # started, then reports a.ckpt's failure
    assert caught.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space left"):
        plugin.teardown()  # b.ckpt failed too
    plugin.teardown()  # every error was reported once
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind

    monkeypatch.undo()
    plugin.save_checkpoint(state, tmp_path / "sub" / "c.ckpt")
    assert plugin.load_checkpoint(tmp_path / "sub" / "c.ckpt")["global_step"] == 1  # waits for the save
    plugin.remove_checkpoint(tmp_path / "sub" / "c.ckpt")
    plugin.teardown()
    assert list((tmp_path / "sub").iterdir()) == []
    assert pickle.loads(pickle.dumps(plugin)).async_save  # spawn launchers pickle the Trainer


Point = collections.namedtuple("Point", "x y")


def test_unsupported_entries_raise_naming_every_key_before_writing(tmp_path: Path) -> None:
    checkpoint = {"hyper_parameters": {"data_dir": Path("/data"), "lr": 0.1},
                  "extra": [1, Point(1, 2)], "state_dict": {"w": torch.zeros(2)}}
    with pytest.raises(TypeError) as caught:
        GdsCheckpointIO().save_checkpoint(checkpoint, tmp_path / "out" / "x.ckpt")
    message = str(caught.value)
    assert "'hyper_parameters/data_dir': pathlib.PosixPath" in message
    assert f"'extra/1': {__name__}.Point" in message
    assert "convert=" in message and "lr" not in message.split("\n", 1)[1].split("Convert")[0]
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match=r"'extra': dict key \(1, 2\) of type tuple"):
        GdsCheckpointIO(convert=str).save_checkpoint({"extra": {(1, 2): 3}}, tmp_path / "y.ckpt")


def test_convert_stores_a_plain_value_and_leaves_lightnings_dict_alone(tmp_path: Path, h: Any) -> None:
    def to_plain(obj: Any) -> Any:
        if isinstance(obj, argparse.Namespace):
            return vars(obj)
        return str(obj)

    def with_metadata(**items: Any) -> collections.OrderedDict[str, Any]:
        result = collections.OrderedDict(items)
        result._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
        return result

    checkpoint = {"state_dict": with_metadata(w=torch.arange(4.0), origin=Path("/w")),
                  "hyper_parameters": {"data_dir": Path("/data"),
                                       "args": argparse.Namespace(depth=2, act="tanh")},
                  "betas": (0.9, Point(1, 2))}
    path = tmp_path / "x.ckpt"
    GdsCheckpointIO(convert=to_plain).save_checkpoint(checkpoint, path)
    assert isinstance(checkpoint["hyper_parameters"]["data_dir"], Path)  # the caller's dict is unchanged
    assert isinstance(checkpoint["state_dict"]["origin"], Path)
    expected = {"state_dict": with_metadata(w=torch.arange(4.0), origin="/w"),
                "hyper_parameters": {"data_dir": "/data", "args": {"depth": 2, "act": "tanh"}},
                "betas": (0.9, "Point(x=1, y=2)")}
    h.assert_same(expected, GdsCheckpointIO().load_checkpoint(path))
    with pytest.raises(TypeError, match=r"'p': object \(returned by convert for a pathlib"):
        GdsCheckpointIO(convert=lambda obj: object()).save_checkpoint({"p": Path("x")}, tmp_path / "z.ckpt")


def test_trainer_with_a_path_hyperparameter(tmp_path: Path) -> None:
    model = make_model(0, data_dir=tmp_path / "data")
    with pytest.raises(TypeError, match="'hyper_parameters/data_dir': pathlib"):
        make_trainer(tmp_path, 1, GdsCheckpointIO(), [ModelCheckpoint(dirpath=tmp_path / "a")]).fit(
            model, make_loader())
    assert not (tmp_path / "a").exists() or list((tmp_path / "a").iterdir()) == []
    # Two epochs: ModelCheckpoint (save_top_k=1) removes the first epoch's file through the plugin.
    model = make_model(0, data_dir=tmp_path / "data")
    make_trainer(tmp_path, 2, GdsCheckpointIO(convert=str), [ModelCheckpoint(dirpath=tmp_path / "b")]).fit(
        model, make_loader())
    (path,) = (tmp_path / "b").iterdir()
    assert path.name == f"epoch=1-step={2 * BATCHES_PER_EPOCH}.ckpt"
    assert GdsCheckpointIO().load_checkpoint(path)["hyper_parameters"]["data_dir"] == str(tmp_path / "data")


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        GdsCheckpointIO(codec="brotli")
    with pytest.raises(ValueError, match="max_inflight"):
        GdsCheckpointIO(max_inflight=0)
    plugin = GdsCheckpointIO()
    with pytest.raises(TypeError, match="'chunk_size' are not gdsckpt.Config fields"):
        plugin.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"chunk_size": 1})
    with pytest.raises(ValueError, match="local files"):
        plugin.save_checkpoint({}, "s3://bucket/x.ckpt")
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError, match="map_location"):
        plugin.load_checkpoint(tmp_path / "missing.ckpt", map_location=lambda storage, loc: storage)
    compressible = {"w": torch.zeros(4096)}
    plugin.save_checkpoint(compressible, tmp_path / "x.ckpt", storage_options={"codec": "zstd"})
    assert "none/1" not in gdsckpt.inspect(tmp_path / "x.ckpt").codecs
    plugin.save_checkpoint(compressible, tmp_path / "x.ckpt",
                           storage_options={"codec": "none", "fsync": False})
    assert set(gdsckpt.inspect(tmp_path / "x.ckpt").codecs) == {"none/1"}
    plugin.remove_checkpoint(tmp_path / "x.ckpt")
    plugin.remove_checkpoint(tmp_path / "x.ckpt")  # already gone: not an error
    assert not (tmp_path / "x.ckpt").exists()


def _forget_plugin_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop the plugin module and its public alias so the next import runs them again."""
    import gdsckpt.integrations

    for name in ("gdsckpt.lightning", "gdsckpt.integrations.lightning"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(gdsckpt, "lightning", raising=False)
    monkeypatch.delattr(gdsckpt.integrations, "lightning", raising=False)


def test_pytorch_lightning_namespace_accepts_the_plugin(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    plugin = GdsCheckpointIO()
    trainer = pl.Trainer(plugins=[plugin], accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    assert trainer.strategy.checkpoint_io is plugin

    # Where only pytorch_lightning is installed, the class subclasses lightning_fabric's base.
    from lightning_fabric.plugins import CheckpointIO

    for name in ("lightning", "lightning.fabric.plugins"):
        monkeypatch.setitem(sys.modules, name, None)
    _forget_plugin_modules(monkeypatch)
    fabric_only = importlib.import_module("gdsckpt.lightning")
    assert fabric_only.GdsCheckpointIO.__bases__ == (CheckpointIO,)
    assert GdsCheckpointIO.__bases__ != (CheckpointIO,)


def test_import_without_lightning_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import name` fail as it does when the package is not installed.
    for name in ("lightning", "lightning.fabric.plugins", "lightning_fabric", "lightning_fabric.plugins"):
        monkeypatch.setitem(sys.modules, name, None)
    _forget_plugin_modules(monkeypatch)
    with pytest.raises(ImportError, match="pip install lightning"):
        importlib.import_module("gdsckpt.lightning")


def test_import_gdsckpt_does_not_import_lightning(h: Any) -> None:
    probe = "import sys, gdsckpt; print(sorted(m for m in sys.modules if 'lightning' in m))"
    result = h.run_python("-c", probe, cwd=Path("/"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_checkpoint_that_holds_itself_is_refused_not_walked_for_ever(tmp_path: Path) -> None:
    """Hyperparameters holding themselves twice made the plugin walk the checkpoint 2**256 times
    (its depth cap, no cycle check) before ``gdsckpt.save`` could refuse the cycle."""
    hp: dict[str, Any] = {"lr": 0.1}
    hp["a"] = hp
    hp["b"] = hp
    with pytest.raises(TypeError, match="reference cycle"):
        GdsCheckpointIO().save_checkpoint({"hyper_parameters": hp}, tmp_path / "x.gdsckpt")
    shared: dict[str, Any] = {"v": torch.ones(2)}
    for _level in range(6):  # one dict reached by several paths is still saved and loaded
        shared = {"a": shared, "b": shared}
    GdsCheckpointIO().save_checkpoint({"hyper_parameters": shared}, tmp_path / "y.gdsckpt")
    loaded = GdsCheckpointIO().load_checkpoint(tmp_path / "y.gdsckpt")
    node = loaded["hyper_parameters"]
    for branch in "abaaba":
        node = node[branch]
    assert bit_equal(node["v"], torch.ones(2))


def test_a_checkpoint_superseded_by_a_failed_background_save_is_kept(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``ModelCheckpoint(save_top_k=1)`` with ``async_save``: Lightning removes the previous
    checkpoint right after asking for the new one. The removal ran at once; the new save then
    failed in the background, and the run was left with no checkpoint at all."""
    from gdsckpt.background import async_save as background

    original = background.api_saving.save_flat

    def failing(flat: Any, target: Any, **kwargs: Any) -> Any:
        if "b.ckpt" in str(target):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(flat, target, **kwargs)

    monkeypatch.setattr(background.api_saving, "save_flat", failing)
    plugin = GdsCheckpointIO(async_save=True)
    state = {"state_dict": {"w": torch.arange(6.0)}, "global_step": 1}
    plugin.save_checkpoint(state, tmp_path / "a.ckpt")
    plugin.teardown()  # a.ckpt is complete
    plugin.save_checkpoint(state, tmp_path / "b.ckpt")  # fails in the background
    plugin.remove_checkpoint(tmp_path / "a.ckpt")  # as ModelCheckpoint does, at once
    with pytest.raises(OSError, match="No space left"):
        plugin.teardown()
    assert plugin.load_checkpoint(tmp_path / "a.ckpt")["global_step"] == 1
    # with the new save succeeding, the superseded one goes once it has
    plugin.save_checkpoint(state, tmp_path / "c.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")
    plugin.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
