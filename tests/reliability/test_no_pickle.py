"""Loading never executes code from the file: no unpickling anywhere on the read path.

``gdsckpt.load``, ``gdsckpt.open(...).get_many``, ``inspect``, ``verify`` and
``CheckpointManager.restore_latest`` (in place into a model and optimizer, and whole) run on a real
checkpoint with every unpickling entry point of ``pickle``, ``_pickle`` and ``torch`` replaced by a
function that raises (fault injection); a subprocess runs them under an audit hook that sees every
``pickle.find_class`` (the step that imports what a pickle names, however the unpickler was
reached). A file crafted to hold pickle payloads, as plain-value strings and dict keys and in its
index's ``kind`` and ``dtype`` fields, loads the strings as strings and rejects the fields; the
payload, which runs when unpickled (checked), never runs.
"""

from __future__ import annotations

import _pickle
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt import CheckpointManager
from gdsckpt.demo import training_state

from .harness import record_figure


class Unpickled(BaseException):
    """Raised by the replaced unpickling functions (a BaseException: no ``except Exception`` in the
    library can swallow it)."""


UNPICKLERS = [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (pickle, "_loads"),
              (pickle, "_load"), (pickle, "_Unpickler"), (_pickle, "loads"), (_pickle, "load"),
              (_pickle, "Unpickler"), (torch, "load"), (torch.serialization, "load")]


def refuse_unpickling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every unpickling entry point raise ``Unpickled``; the list records each call."""
    calls: list[str] = []
    for module, name in UNPICKLERS:
        def refuse(*args: Any, _name: str = f"{module.__name__}.{name}", **kwargs: Any) -> Any:
            calls.append(_name)
            raise Unpickled(f"{_name} called")
        monkeypatch.setattr(module, name, refuse)
    return calls


class Payload:
    """Unpickling this runs ``exec`` of code that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> Any:
        return exec, (f"__import__('pathlib').Path({str(self.marker)!r}).write_text('executed')",)


def _payloads(marker: Path) -> list[str]:
    """The payload as text: protocol 0 (ASCII) and protocol 4 (binary, as Latin-1)."""
    texts = [pickle.dumps(Payload(marker), protocol=0).decode("ascii"),
             pickle.dumps(Payload(marker), protocol=4).decode("latin-1")]
    for text in texts:  # the payloads are live: unpickled, they run
        pickle.loads(text.encode("latin-1"))
        assert marker.read_text() == "executed"
        marker.unlink()
    return texts


def _torch_state() -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = training_state(width=32, depth=1, steps=1)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
             "numpy": np.arange(10, dtype=np.float16), "step": 1, "note": "plain"}
    return state, model, optimizer


def test_read_paths_never_unpickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, h: Any) -> None:
    state, _model, _optimizer = _torch_state()
    manager = CheckpointManager(tmp_path, config=h.small_config())
    manager.save(1, state)
    calls = refuse_unpickling(monkeypatch)
    path = manager.path(1)
    checked = []

    h.assert_same(state, gdsckpt.load(path))
    checked.append("load")
    with gdsckpt.open(path) as ckpt:
        lazily = ckpt.get_many(ckpt.keys())
        assert len(lazily) == len(ckpt.keys()) > 10
    checked.append("open().get_many")
    assert gdsckpt.inspect(path).tensors
    checked.append("inspect")
    gdsckpt.verify(path)
    checked.append("verify")
    fresh, fresh_optimizer = training_state(width=32, depth=1, steps=0, seed=5)
    restored = manager.restore_latest(model=fresh, optimizer=fresh_optimizer, verify=True)
    assert restored is not None
    step, extra = restored
    assert step == 1 and sorted(extra) == ["note", "numpy", "rng", "step"]
    h.assert_same(state["model"], fresh.state_dict())
    h.assert_same(state["optimizer"], fresh_optimizer.state_dict())
    checked.append("restore_latest(model, optimizer)")
    step, everything = manager.restore_latest()  # type: ignore[misc]
    h.assert_same(state, everything)
    checked.append("restore_latest()")
    assert calls == []
    record_figure("no unpickling", f"{len(checked)} read paths ({', '.join(checked)}) completed with "
                                   f"{len(UNPICKLERS)} unpickling functions replaced by ones that raise")


def test_pickle_payloads_in_a_checkpoint_never_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   h: Any) -> None:
    marker = tmp_path / "executed"
    texts = _payloads(marker)
    calls = refuse_unpickling(monkeypatch)
    state = {"note": texts[0], "blob": texts[1], "nested": [texts[0], {"k": texts[1]}],
             "keyed": {texts[0]: 1}, "w": np.ones(3, dtype=np.float32)}
    path = tmp_path / "payload.gdsckpt"
    gdsckpt.save(state, path, config=h.small_config())
    assert str(marker).encode() in path.read_bytes()  # the payload is in the file
    h.assert_same(state, gdsckpt.load(path))
    gdsckpt.verify(path)
    gdsckpt.inspect(path)
    assert not marker.exists()

    # The index's own strings: a tensor's kind or dtype set to the payload is rejected, not run.
    rejected = []
    for field in ("kind", "dtype"):
        crafted = tmp_path / f"crafted-{field}.gdsckpt"
        shutil.copyfile(path, crafted)
        h.rewrite_index(crafted, lambda doc, f=field: doc["tensors"][0].__setitem__(f, texts[1]))
        with pytest.raises(gdsckpt.CheckpointError) as caught:
            gdsckpt.load(crafted)
        rejected.append(f"{field}: {type(caught.value).__name__}")
    assert not marker.exists() and calls == []
    record_figure("pickle payloads in a checkpoint", (
        f"{len(texts)} live payloads (they run when unpickled) stored as 4 plain-value strings and a dict "
        f"key: loaded back as strings, never run; in the index's tensor fields: rejected "
        f"({', '.join(rejected)})"))


AUDITED = """
import json, sys
events = []
sys.addaudithook(lambda event, args: events.append(args[:2]) if event == "pickle.find_class" else None)
import gdsckpt
directory = sys.argv[1]
manager = gdsckpt.CheckpointManager(directory)
path = manager.path(1)
gdsckpt.load(path)
with gdsckpt.open(path) as ckpt:
    ckpt.get_many(ckpt.keys())
gdsckpt.inspect(path)
gdsckpt.verify(path)
manager.restore_latest(verify=True)
during = list(events)
import collections, pickle
pickle.loads(pickle.dumps(collections.OrderedDict))  # control: the hook sees an unpickled global
print(json.dumps({"during": [list(map(str, e)) for e in during], "control": len(events) - len(during)}))
"""


def test_no_pickle_find_class_under_an_audit_hook(tmp_path: Path, h: Any) -> None:
    marker = tmp_path / "executed"
    texts = _payloads(marker)
    CheckpointManager(tmp_path / "run").save(1, {"note": texts[1], "w": np.ones(3, dtype=np.float32)})
    result = h.run_python("-c", AUDITED, str(tmp_path / "run"), timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["control"] >= 1, "the audit hook does not see unpickling"
    assert report["during"] == [], report
    assert not marker.exists()
    record_figure("audit hook", "0 pickle.find_class events during load, open().get_many, inspect, verify, "
                                "restore_latest (the control unpickling: "
                                f"{report['control']})")
