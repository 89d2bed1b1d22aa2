"""Crafted but index-valid files whose arrays this machine cannot build: a clear CheckpointError
naming the array, never an ImportError / TypeError / RuntimeError from an array library."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import rewrite_index

import gdsckpt


def _saved(tmp_path, state):
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save(state, path)
    return path


def _set_tensor(path, which, **fields):
    def edit(doc):
        for record in doc["tensors"]:
            if record["key"] == which:
                record.update(fields)
    rewrite_index(path, edit)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_cupy_array_without_cupy_names_the_array(tmp_path):
    path = _saved(tmp_path, {"a": np.arange(10, dtype=np.float32)})
    _set_tensor(path, "a", kind="cupy", device="cuda:0")
    with pytest.raises(gdsckpt.CheckpointError, match=r"'a'.*cupy"):
        gdsckpt.load(path, config=gdsckpt.Config(engine="cpu"))


@pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is not None, reason="ml_dtypes is installed here")
def test_numpy_bfloat16_without_ml_dtypes_names_the_array(tmp_path):
    path = _saved(tmp_path, {"w": torch.ones(8, dtype=torch.bfloat16)})
    _set_tensor(path, "w", kind="numpy")
    with pytest.raises(gdsckpt.CheckpointError, match=r"'w'.*ml_dtypes"):
        gdsckpt.load(path)


def test_integer_parameter_requiring_grad_is_corrupt(tmp_path):
    path = _saved(tmp_path, {"i": torch.arange(4), "j": torch.ones(3)})
    _set_tensor(path, "i", parameter={"requires_grad": True})
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="'i'"):
        gdsckpt.load(path)
    assert torch.equal(gdsckpt.load(path, keys=["j"])["j"], torch.ones(3))  # other keys still load


def test_tensor_key_must_match_its_place_in_the_structure(tmp_path):
    path = _saved(tmp_path, {"a": torch.ones(2), "b": torch.zeros(2)})
    _set_tensor(path, "a", key="c")
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="'c' but sits at 'a'"):
        gdsckpt.load(path)


def test_dict_with_a_repeated_key_is_corrupt(tmp_path):
    path = _saved(tmp_path, {"a": 1, "b": 2})

    def edit(doc):
        doc["tree"]["items"][1][0] = {"t": "str", "v": "a"}
    rewrite_index(path, edit)
    with pytest.raises(gdsckpt.CorruptCheckpointError, match="repeats a key"):
        gdsckpt.load(path)
