"""A fuzzer over the index fields of real checkpoints, with a time and a memory budget per input.

Each input is a real full or delta checkpoint whose index JSON had one to three fields edited
(chunk records, codec chains and their stage parameters, tensor records, segments, aliases, tree
nodes, the delta ``base``), its checksums repaired, then read through every public reader: ``open``
(``info``, ``get``, ``get_many``, ``get_rows``), ``load``, ``load_into``, ``verify`` and ``inspect``.
Only ``CheckpointError`` subclasses may escape, and no input may take more than
``TIME_BUDGET_S`` or raise the child's peak resident memory more than ``MEMORY_BUDGET`` above what
it held before the input (the kernel's peak is reset before each input). The inputs run in one
child process whose address space is capped (``RLIMIT_AS``), watched by the parent: an input that
hangs is killed and named, as is one that crashes the interpreter.

``GDSCKPT_FUZZ_EXAMPLES`` (default 150) sets the number of inputs, ``GDSCKPT_FUZZ_SEED`` the
first seed; input ``n`` depends only on ``seed + n``, so a finding is reproduced by its number.
test_hostile_files.py fuzzes the bytes of files and generates indexes from scratch; this one
edits the fields of indexes the writer produced, so most inputs get past the validator.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import random
import resource
import select
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gdsckpt
from gdsckpt.errors import CheckpointError
from gdsckpt.format import checksum, pack_trailer, unpack_trailer

from .harness import record_figure

EXAMPLES = int(os.environ.get("GDSCKPT_FUZZ_EXAMPLES", "150"))
SEED = int(os.environ.get("GDSCKPT_FUZZ_SEED", "0"))
TIME_BUDGET_S = 2.0
"""Per input, all readers together; a reader of an input ran in about 10 ms on the dev host."""
MEMORY_BUDGET = 256 << 20
"""Peak resident memory an input may add; the largest array any edit can claim is a few MiB."""
ADDRESS_SPACE_HEADROOM = 4 << 30
"""RLIMIT_AS above the warmed-up child: a runaway allocation fails instead of swapping the host."""
HANG_GUARD_S = 30.0
CONFIG = gdsckpt.Config(codec="zstd", chunk_bytes=4 << 20, pack_below=4096, codec_threads=1, io_threads=1,
                        fsync=False)


# ---------------------------------------------------------------------------------------------
# the files the edits start from

def base_state() -> dict[str, Any]:
    """Every kind of record the writer makes: byte-planed and plain chunks, a 4 MiB zero array
    (a chunk of a few hundred stored bytes), a Parameter, tied torch and NumPy aliases, 0-d and
    empty arrays, an OrderedDict with metadata, nested lists and scalars."""
    rng = np.random.default_rng(5)
    weight = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32)))
    table = rng.integers(-9, 9, 300).astype(np.int64)
    model = collections.OrderedDict(w=weight, tied=weight, h=torch.randn(700).to(torch.bfloat16),
                                    zeros=torch.zeros(1 << 20), ids=torch.arange(50, dtype=torch.int32),
                                    scalar=torch.tensor(2.5, dtype=torch.float64), empty=torch.zeros(0, 3))
    model._metadata = collections.OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return {"model": model, "np": table, "np_tied": table, "mask": rng.random(40) > 0.5,
            "misc": [np.float32(1.5), torch.ones(3, dtype=torch.float16), None, "text"], "step": 7}


def make_files(directory: Path) -> list[Path]:
    """A full checkpoint and a delta on it (``xorbase/1`` chains and a ``base`` member)."""
    state = base_state()
    full, delta = directory / "full.gdsckpt", directory / "delta.gdsckpt"
    gdsckpt.save(state, full, config=CONFIG)
    with torch.no_grad():
        state["model"]["w"].add_(1)
    state["np"] = state["np_tied"] = state["np"] * 3
    gdsckpt.save(state, delta, base=full, config=CONFIG)
    return [full, delta]


def read_index(path: Path) -> tuple[bytes, int, int, dict[str, Any]]:
    data = path.read_bytes()
    trailer = unpack_trailer(data[-64:], len(data))
    doc = json.loads(data[trailer.index_offset:trailer.index_offset + trailer.index_length])
    return data, trailer.index_offset, trailer.minor, doc


def write_with_index(path: Path, data: bytes, index_offset: int, minor: int, doc: dict[str, Any]) -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))  # a tree edited 600 levels deep is 1,200 JSON levels
    try:
        index = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    finally:
        sys.setrecursionlimit(limit)
    trailer = pack_trailer(index_offset, len(index), checksum(index), minor)
    path.write_bytes(data[:index_offset] + index + trailer)


# ---------------------------------------------------------------------------------------------
# the edits: each changes one field (or adds one record) of an index document

INTS = [-1, 0, 1, 2, 3, 7, 8, 4095, 4096, 4097, 1 << 20, 1 << 30, (1 << 30) + 1, 1 << 32, 1 << 63, 1 << 64]
ODD = [None, True, 1.5, "1", [], {}, [1], -0.0]
STAGES: list[dict[str, Any]] = [
    {"name": "zstd/1"}, {"name": "lz4/1"}, {"name": "deflate/1"}, {"name": "none/1"}, {"name": "xorbase/1"},
    {"name": "nvcomp.ans/1", "data_type": "<f2"}, {"name": "nvcomp.bitcomp-lossy/1", "data_type": "<f4",
                                                   "delta": 0.5},
    {"name": "future/1"}, {"name": "zstd/2"}, {"name": "byteplanes/1"},
    *({"name": "byteplanes/1", "width": width}
      for width in (2, 4, 8, 2, 4, 8, 1, 3, 0, 16, -4, "4", True, 2.0))]


def _any(rng: random.Random) -> Any:
    return rng.choice(INTS + ODD)


def _records(doc: dict[str, Any], *, alias: bool | None = None) -> list[dict[str, Any]]:
    return [r for r in doc["tensors"] if isinstance(r, dict) and (alias is None or ("alias" in r) == alias)]


def edit_chunk_field(doc: dict[str, Any], rng: random.Random) -> str:
    chunk = rng.choice(doc["chunks"])
    field = rng.randrange(5)
    chunk[field] = rng.choice([chunk[field] + rng.choice([-1, 1, 4096]), chunk[field] * 2, _any(rng)])
    return f"chunk field {field} = {chunk[field]!r:.30}"


def edit_chunk_chain(doc: dict[str, Any], rng: random.Random) -> str:
    chunk = rng.choice(doc["chunks"])
    chunk[4] = rng.randrange(len(doc["chains"]) + 1)
    return f"chunk chain = {chunk[4]}"


def edit_chain(doc: dict[str, Any], rng: random.Random) -> str:
    length = rng.choice([1, 1, 2, 2, 3, 4, 8, 9, 40, 3000])
    stages = [copy.deepcopy(rng.choice(STAGES)) for _ in range(length)]
    if rng.random() < 0.5:  # mostly the same transform, as the stall of the report
        stages = [copy.deepcopy(stages[0])] * (length - 1) + stages[-1:]
    number = rng.randrange(len(doc["chains"]) + 1)
    if number == len(doc["chains"]):
        doc["chains"].append(stages)
    else:
        doc["chains"][number] = stages
    return f"chain {number} = {'+'.join(s['name'] for s in stages)[:80]} ({length} stages)"


def edit_lengthen_chain(doc: dict[str, Any], rng: random.Random) -> str:
    """The stall of the report: many valid transform stages before the chain's own codec."""
    chain = doc["chains"][doc["chunks"][rng.randrange(len(doc["chunks"]))][4]]
    count = rng.choice([1, 2, 6, 7, 50, 3000])
    chain[:-1] = [{"name": "byteplanes/1", "width": rng.choice([2, 2, 4, 8])} for _ in range(count)]
    return f"chain of {count} byteplanes/1 stages before {chain[-1]['name']}"


def edit_stage_parameter(doc: dict[str, Any], rng: random.Random) -> str:
    stage = rng.choice(rng.choice(doc["chains"]))
    name = rng.choice(["width", "data_type", "delta", "name", "level", "dictionary"])
    stage[name] = rng.choice(INTS + ODD + ["<f4", "|u1", "nan", "byteplanes/1", "zstd/1", {"width": 2}])
    return f"stage {stage.get('name')!r:.30} {name} = {stage[name]!r:.30}"


def edit_segment(doc: dict[str, Any], rng: random.Random) -> str:
    record = rng.choice([r for r in _records(doc, alias=False) if r.get("segments")])
    segments = record["segments"]
    action = rng.choice(["field", "split", "swap", "drop", "duplicate"])
    if action == "field":
        segment = rng.choice(segments)
        segment[rng.randrange(3)] = rng.choice([segment[1] + 1, segment[2] - 1, 0, _any(rng)])
    elif action == "split" and segments[0][2] > 1:  # still tiles the chunk: a valid index
        chunk, start, length = segments.pop(0)
        cut = rng.randrange(1, length)
        segments[:0] = [[chunk, start, cut], [chunk, start + cut, length - cut]]
    elif action == "swap" and len(segments) > 1:
        segments.reverse()
    elif action == "drop":
        segments.pop()
    else:
        segments.append(list(rng.choice(segments)))
    return f"segments of {record['key']!r}: {action}"


def edit_record(doc: dict[str, Any], rng: random.Random) -> str:
    record = rng.choice(_records(doc))
    name = rng.choice(["dtype", "shape", "kind", "device", "parameter", "scalar", "lossy", "key"])
    if name == "dtype":
        value: Any = rng.choice(["float32", "int32", "uint8", "bfloat16", "float64", "complex64", "bool",
                                 "float8_e5m2", "float128", 4])
    elif name == "shape":
        shape = record.get("shape") or [1]
        total = int(np.prod(shape))
        value = rng.choice([[total], list(reversed(shape)), [*shape, 1], [0, *shape], [1 << 40], [-1], [],
                            [total // 2, 2], ["2"]])
    elif name == "kind":
        value = rng.choice(["torch", "numpy", "cupy", "jax", "tf"])
    elif name == "device":
        value = rng.choice(["cuda:0", "cuda:99", "cuda:-1", "cpu:1", "meta", "", 3])
    elif name == "parameter":
        value = rng.choice([{"requires_grad": True}, {"requires_grad": False}, {}, True, None, "x"])
    elif name == "scalar":
        value = rng.choice([True, False, 1, "yes"])
    elif name == "lossy":
        value = rng.choice([{"mode": "grid", "rel_bound": 0.01, "abs_bound": 0.1, "max_error": 0.05},
                            {"mode": "grid", "rel_bound": -1, "abs_bound": 0, "max_error": 0},
                            {"mode": 3}, []])
    else:
        value = rng.choice([r["key"] for r in _records(doc)] + ["", "a/../b", "model/w/x"])
    record[name] = value
    return f"record {record['key']!r:.40} {name} = {value!r:.40}"


def edit_alias(doc: dict[str, Any], rng: random.Random) -> str:
    count = len(doc["tensors"])
    if rng.random() < 0.4 and _records(doc, alias=True):  # retarget an existing alias
        record = rng.choice(_records(doc, alias=True))
        record["alias"] = rng.choice([*range(count), count, -1, "0", None])
        return f"alias {record['key']!r} -> {record['alias']!r}"
    target_number = rng.randrange(count)
    target = doc["tensors"][target_number]
    record = {name: target[name] for name in ("kind", "dtype", "shape", "device") if name in target}
    record.update(key=f"alias{count}", alias=rng.choice([target_number, target_number, count, count + 1]))
    change = rng.choice(["kind", "kind", "dtype", "shape", "parameter", "parameter", "scalar", "segments",
                         "none"])
    if change == "kind":  # mostly the other of torch and NumPy, often as a Parameter
        record["kind"] = rng.choice(["torch", "numpy", "cupy", "jax"] if rng.random() < 0.3 else
                                    [kind for kind in ("torch", "numpy") if kind != record.get("kind")])
        if rng.random() < 0.5:
            record["parameter"] = {"requires_grad": rng.random() < 0.5}
    elif change == "dtype":
        record["dtype"] = rng.choice(["float32", "int64", "uint8"])
    elif change == "shape":
        record["shape"] = [1, *record.get("shape", [])]
    elif change == "parameter":
        record["parameter"] = {"requires_grad": rng.random() < 0.7}
    elif change == "scalar":
        record["scalar"] = True
    elif change == "segments":
        record["segments"] = []
    doc["tensors"].append(record)
    doc["tree"]["items"].append([{"t": "str", "v": record["key"]}, {"t": "tensor", "id": count}])
    return f"alias record of {target_number} ({change}, -> {record['alias']})"


def edit_tree(doc: dict[str, Any], rng: random.Random) -> str:
    items = doc["tree"]["items"]
    action = rng.choice(["swap ids", "scalar", "meta tensor", "cls", "deep", "key type"])
    nodes: list[dict[str, Any]] = []
    stack = [doc["tree"]]
    while stack:  # every tensor node
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("t") == "tensor":
                nodes.append(node)
            for item in node.get("items", []):
                stack.extend(item if isinstance(item, list) else [item])
    if action == "swap ids" and len(nodes) > 1:
        first, second = rng.sample(nodes, 2)
        first["id"], second["id"] = second["id"], first["id"]
    elif action == "scalar":
        node = rng.choice(nodes)
        node.clear()
        node.update(t="int", v="1")
    elif action == "meta tensor":
        doc["tree"].update(cls="OrderedDict", meta={"t": "tensor", "id": 0})
    elif action == "cls":
        doc["tree"]["cls"] = rng.choice(["OrderedDict", "defaultdict", 1, None])
    elif action == "deep":
        node = doc["tree"]
        for _ in range(rng.choice([100, 600])):
            node = {"t": "list", "items": [node]}
        doc["tree"] = node
    else:
        rng.choice(items)[0] = rng.choice([{"t": "float", "v": "7ff8000000000001"}, {"t": "bool", "v": 1},
                                           {"t": "tensor", "id": 0}, {"t": "none"}])
    return f"tree: {action}"


def edit_top(doc: dict[str, Any], rng: random.Random) -> str:
    action = rng.choice(["minor", "base", "drop base", "xor chain"])
    if action == "minor":
        doc["version"] = [1, rng.choice([0, 1, 99, -1])]
    elif action == "base":
        base = doc.setdefault("base", {"path": "full.gdsckpt", "index_sha256": "0" * 64, "file_length": 8192,
                                       "depth": 1})
        name = rng.choice(["path", "index_sha256", "file_length", "depth"])
        base[name] = rng.choice([*INTS, "", "../full.gdsckpt", "/", "F" * 64, "delta.gdsckpt", None])
    elif action == "drop base":
        doc.pop("base", None)
    else:
        chain = rng.choice(doc["chains"])
        if chain[0]["name"] != "xorbase/1":
            chain.insert(0, {"name": "xorbase/1"})
    return f"top: {action}"


EDITS: list[Callable[[dict[str, Any], random.Random], str]] = [
    edit_chunk_field, edit_chunk_chain, edit_chain, edit_lengthen_chain, edit_stage_parameter, edit_segment,
    edit_record, edit_record, edit_alias, edit_alias, edit_tree, edit_top]


# ---------------------------------------------------------------------------------------------
# the child: runs the inputs, one JSON line before and after each

def exercise(path: Path) -> str:
    """Every public reader on ``path``; returns how far it got. Other exceptions propagate."""
    stage = "refused at open"
    try:
        with gdsckpt.open(path, config=CONFIG) as ckpt:
            stage = "opened"
            keys = list(ckpt)
            for key in keys:
                info = ckpt.info(key)
                try:
                    value = ckpt.get(key)
                    assert tuple(value.shape) == tuple(info.shape), (key, value.shape, info.shape)
                    if info.shape and info.shape[0]:
                        ckpt.get_rows(key, 0, 1)
                except CheckpointError:
                    stage = "opened, an array refused"
            ckpt.get_many(keys)
    except CheckpointError:
        pass
    target = {"model": {"w": torch.zeros(64, 32), "h": torch.zeros(700, dtype=torch.bfloat16),
                        "ids": torch.zeros(50, dtype=torch.int32)}}
    for operation in (lambda: gdsckpt.load(path, config=CONFIG),
                      lambda: gdsckpt.load_into(target, path, strict=False, config=CONFIG),
                      lambda: gdsckpt.verify(path, config=CONFIG),
                      lambda: gdsckpt.inspect(path, config=CONFIG)):
        try:
            operation()
        except CheckpointError:
            pass
    return stage


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _apply(edit: Callable[[dict[str, Any], random.Random], str], doc: dict[str, Any],
           rng: random.Random) -> str:
    """``edit(doc)``; an edit that an earlier one made inapplicable (a field it looks for now has
    another type) is skipped."""
    try:
        return edit(doc, rng)
    except (LookupError, TypeError, ValueError, AttributeError):
        return f"{edit.__name__} skipped"


def fuzz_child(directory: str, seed: int, count: int) -> None:
    """Run inputs ``seed .. seed + count`` in ``directory``, printing a JSON event per step."""
    warnings.simplefilter("ignore")
    work = Path(directory)
    files = make_files(work)
    sources = [read_index(path) for path in files]
    exercise(files[1])  # warm up: thread pools, codecs, allocator arenas
    vm_size = _status_bytes("VmSize")
    hard_limit = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + ADDRESS_SPACE_HEADROOM, hard_limit))
    print(json.dumps({"event": "ready", "peak_reset": _reset_peak()}), flush=True)
    target = work / "input.gdsckpt"  # beside full.gdsckpt, which a delta's base path names
    for number in range(seed, seed + count):
        rng = random.Random(number)
        which = rng.randrange(2)
        data, index_offset, minor, doc = copy.deepcopy(sources[which])
        edits = [_apply(rng.choice(EDITS), doc, rng) for _ in range(rng.choice([1, 1, 2, 3]))]
        described = f"{files[which].name}: " + "; ".join(edits)
        print(json.dumps({"event": "begin", "n": number, "edits": described}), flush=True)
        write_with_index(target, data, index_offset, minor, doc)
        _reset_peak()
        rss_before = _status_bytes("VmRSS")
        start = time.perf_counter()
        try:
            outcome = exercise(target)
        except Exception as err:  # what the test looks for: anything but a CheckpointError
            where = traceback.extract_tb(err.__traceback__)[-1]
            outcome = f"escaped: {type(err).__name__}: {str(err)[:300]} at {Path(where.filename).name}:{where.lineno}"
        seconds = time.perf_counter() - start
        peak = max(_status_bytes("VmHWM") - rss_before, 0)
        print(json.dumps({"event": "end", "n": number, "outcome": outcome, "seconds": seconds, "peak": peak}),
              flush=True)


# ---------------------------------------------------------------------------------------------
# the parent: watches the child, then judges every input

CHILD = ("import sys; sys.path[:0] = sys.argv[1:3]; from reliability.test_index_fuzz import fuzz_child; "
         "fuzz_child(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))")
"""The child imports the gdsckpt the parent imported (argv[1]) and this module (argv[2])."""


def _events(proc: subprocess.Popen[bytes], guard: float) -> Any:
    """JSON events of the child, each awaited for at most ``guard`` s (then the child is killed)."""
    assert proc.stdout is not None
    buffer = b""
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], guard)
        if not ready:
            proc.kill()
            yield {"event": "hung"}
            return
        data = os.read(proc.stdout.fileno(), 1 << 16)
        if not data:
            return
        *lines, buffer = (buffer + data).split(b"\n")
        for line in lines:
            yield json.loads(line)


def _label(event: dict[str, Any], described: dict[int, str]) -> str:
    """An input's number and edits, for the failure messages."""
    number = event.get("n")
    return f"#{number} ({described[number]})" if number in described else "before the first input"


def test_index_field_fuzz_within_time_and_memory_budget(tmp_path: Path) -> None:
    stderr_path = tmp_path / "child.err"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(Path(gdsckpt.__file__).parents[1]),
                                 str(Path(__file__).parents[1]), str(tmp_path), str(SEED), str(EXAMPLES)],
                                stdout=subprocess.PIPE, stderr=stderr)
    begun: dict[str, Any] = {}
    hung: list[str] = []
    described: dict[int, str] = {}  # input number -> its edits, for the messages
    ended: list[dict[str, Any]] = []
    peak_reset = False
    try:
        for event in _events(proc, HANG_GUARD_S):
            if event["event"] == "ready":
                peak_reset = event["peak_reset"]
            elif event["event"] == "begin":
                begun = event
                described[event["n"]] = event["edits"]
            elif event["event"] == "end":
                ended.append(event)
            else:
                hung.append(f"{_label(begun, described)}: ran past {HANG_GUARD_S} s")
    finally:
        proc.kill()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
    child_error = stderr_path.read_text(errors="replace")[-3000:]
    escaped = [f"{_label(e, described)}: {e['outcome']}" for e in ended if e["outcome"].startswith("escaped")]
    assert not hung, "\n".join(hung + escaped)
    assert len(ended) == EXAMPLES, f"the child died in {_label(begun, described)}:\n{child_error}"
    slow = [f"{_label(e, described)}: {e['seconds']:.1f} s" for e in ended if e["seconds"] > TIME_BUDGET_S]
    heavy = [f"{_label(e, described)}: {e['peak'] >> 20} MiB" for e in ended if e["peak"] > MEMORY_BUDGET]
    outcomes = collections.Counter(e["outcome"] if not e["outcome"].startswith("escaped") else "escaped"
                                   for e in ended)
    record_figure("index field fuzzer",
                  f"{len(ended)} edited indexes (seed {SEED}) through every reader: "
                  + ", ".join(f"{outcome} {count}" for outcome, count in sorted(outcomes.items()))
                  + f"; slowest input {max(e['seconds'] for e in ended) * 1e3:.0f} ms, largest peak-RSS "
                  + f"growth {max(e['peak'] for e in ended) / (1 << 20):.1f} MiB"
                  + ("" if peak_reset else " (peak not resettable here: RSS high-water mark)"))
    assert not escaped, "non-CheckpointError exceptions:\n" + "\n".join(escaped)
    assert not slow, f"inputs over the {TIME_BUDGET_S} s budget:\n" + "\n".join(slow)
    assert not heavy, f"inputs over the {MEMORY_BUDGET >> 20} MiB budget:\n" + "\n".join(heavy)
    opened = outcomes["opened"] + outcomes["opened, an array refused"]
    assert opened > len(ended) // 8, outcomes  # the edits reach the readers behind open
