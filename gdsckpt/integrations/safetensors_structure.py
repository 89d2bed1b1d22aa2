"""The ``gdsckpt.structure`` metadata of a safetensors file written by ``convert``: flattening a
nested state into named tensors plus a JSON document of its structure, and rebuilding the state
from them, strictly validated (a malformed or mismatched document is one ``ConvertError``).

Safetensors refuses tensors that share memory, so entries whose bytes overlap another's are
written as copies; entries that were the same view are recorded as such and come back shared.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Any

from ..errors import ConvertError, CorruptCheckpointError
from ..format.index import validate_tree
from ..state import decode_scalar, flatten, join_key, unflatten, walk_tree

logger = logging.getLogger("gdsckpt")


STRUCTURE_KEY = "gdsckpt.structure"
"""The safetensors metadata entry that records the structure a flattened state came from."""

_STRUCTURE_VERSION = 1


def flatten_for_safetensors(state: Any, src: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The named tensors of ``state``, the structure document that rebuilds it, and how many
    entries were cloned off shared memory."""
    import torch

    try:
        flat = flatten(state)
    except (TypeError, ValueError) as err:
        raise ConvertError(f"{str(src)!r} cannot be written as safetensors: {err}") from err
    paths = {node["id"]: path for node, path in walk_tree(flat.tree) if node["t"] == "tensor"}
    supported: dict[Any, bool] = {}
    names: dict[str, str] = {}
    entries: list[dict[str, Any]] = []
    tensors: dict[str, Any] = {}
    for i, array in enumerate(flat.arrays):
        if array.kind != "torch":
            raise ConvertError(f"{array.key!r} of {str(src)!r} is a {array.kind} array; only torch "
                               f"tensors can be written as safetensors")
        name = ".".join(str(part) for part in paths[i])
        if name in names:
            raise ConvertError(f"{array.key!r} and {names[name]!r} of {str(src)!r} both flatten to the "
                               f"safetensors name {name!r}; rename one of them")
        names[name] = array.key
        source = flat.arrays[array.alias].source if array.alias is not None else array.source
        tensor = source.tensor
        if tensor.dtype not in supported:
            supported[tensor.dtype] = _safetensors_holds(tensor)
        if not supported[tensor.dtype]:
            raise ConvertError(f"{array.key!r} of {str(src)!r} has dtype {array.dtype}, which this "
                               f"safetensors version cannot hold")
        entry: dict[str, Any] = {"name": name}
        if array.alias is not None:
            entry["alias"] = array.alias
        if "parameter" in array.extra:
            entry["parameter"] = array.extra["parameter"]
        entries.append(entry)
        if tensor.numel() == 0:
            tensor = tensor.clone()  # a zero-size view still counts as sharing its base's memory
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
        tensors[name] = tensor
    cloned = _unshare(tensors, torch)
    if cloned:
        logger.info("convert: %d tensor(s) of %s share memory with another and are written as copies",
                    cloned, src)
    return tensors, {"version": _STRUCTURE_VERSION, "tree": flat.tree, "tensors": entries}, cloned


def _safetensors_holds(tensor: Any) -> bool:
    """Whether the installed safetensors can write ``tensor``'s dtype (probed with a zero-size
    view of it: the supported set grows with versions)."""
    import safetensors
    import safetensors.torch

    try:
        safetensors.torch.save({"probe": tensor.as_strided((0,), (1,))})
    except (KeyError, ValueError, TypeError, RuntimeError, safetensors.SafetensorError):
        return False  # its dtype tables lack this dtype
    return True


def _unshare(tensors: dict[str, Any], torch: Any) -> int:
    """Clone, in place in ``tensors``, every entry whose bytes overlap an earlier one's, so that no
    two entries share memory (which safetensors refuses); returns how many were cloned."""
    by_storage: dict[tuple[str, int], list[tuple[int, int, str]]] = collections.defaultdict(list)
    for name, tensor in tensors.items():
        if tensor.numel():
            start = tensor.data_ptr()
            by_storage[(str(tensor.device), tensor.untyped_storage().data_ptr())].append(
                (start, start + tensor.numel() * tensor.element_size(), name))
    cloned = 0
    for ranges in by_storage.values():
        end_so_far = -1
        # Enclosing tensors first (start ascending, end descending): views of them get copied.
        for start, end, name in sorted(ranges, key=lambda r: (r[0], -r[1], r[2])):
            if start < end_so_far:
                tensors[name] = tensors[name].clone(memory_format=torch.contiguous_format)
                cloned += 1
            else:
                end_so_far = end
    return cloned


# ---------------------------------------------------------------------------------------------
# safetensors structure -> state

def rebuild_state(text: str, tensors: dict[str, Any], path: Path) -> Any:
    """The state a ``gdsckpt.structure`` document describes, over the file's tensors."""
    import torch

    try:
        doc = json.loads(text)
        entries = _check_document(doc, tensors)
        arrays: dict[int, Any] = {}
        for i, entry in enumerate(entries):
            arrays[i] = _rebuilt_tensor(entries, i, tensors[entry["name"]], arrays, torch)
        return unflatten(doc["tree"], arrays)
    except CorruptCheckpointError as err:  # from the index's tree validation: not about an index
        raise ConvertError(f"{str(path)!r}: its {STRUCTURE_KEY} metadata is malformed "
                           f"({err.reason.removeprefix('invalid index: ')})") from err
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as err:
        raise ConvertError(f"{str(path)!r}: its {STRUCTURE_KEY} metadata is malformed or does not "
                           f"match its tensors ({type(err).__name__}: {err})") from err


_DOCUMENT_FIELDS = {"version", "tree", "tensors"}
_ENTRY_FIELDS = {"name", "alias", "parameter"}


def _check_document(doc: Any, tensors: dict[str, Any]) -> list[dict[str, Any]]:
    """Raise unless ``doc`` is exactly what ``flatten_for_safetensors`` writes, over ``tensors``:
    its tree is checked as a gdsckpt index's is (node kinds, scalar encodings, depth, each entry
    referenced once), each tensor of the file is named by one entry. Returns the entries."""
    if not isinstance(doc, dict) or set(doc) != _DOCUMENT_FIELDS:
        raise ValueError(f"the document must be an object with exactly the fields {sorted(_DOCUMENT_FIELDS)}")
    version = doc["version"]
    if type(version) is not int or version != _STRUCTURE_VERSION:  # True == 1, but is no version
        raise ValueError(f"version {version!r:.40} is not {_STRUCTURE_VERSION}")
    entries = doc["tensors"]
    if not isinstance(entries, list):
        raise TypeError("'tensors' is not a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or not set(entry) <= _ENTRY_FIELDS:
            raise ValueError(f"entry {i} must be an object with a 'name' and at most the fields "
                             f"{sorted(_ENTRY_FIELDS)}: {entry!r:.80}")
        if not isinstance(entry["name"], str):
            raise TypeError(f"entry {i} has the name {entry['name']!r:.80}, not a string")
        alias = entry.get("alias")
        if "alias" in entry and not (type(alias) is int and 0 <= alias < i):
            raise ValueError(f"entry {i} ties to {alias!r:.40}, not to an earlier entry")
        parameter = entry.get("parameter")
        if "parameter" in entry and not (isinstance(parameter, dict) and set(parameter) == {"requires_grad"}
                                         and isinstance(parameter["requires_grad"], bool)):
            raise ValueError(f"entry {i} has the parameter {parameter!r:.80}, not "
                             f"{{\"requires_grad\": true or false}}")
    named = [entry["name"] for entry in entries]
    if len(set(named)) != len(named):
        twice = sorted(name for name in set(named) if named.count(name) > 1)
        raise ValueError(f"entries name the same tensor twice ({twice[:5]})")
    missing = [name for name in named if name not in tensors]
    extra = sorted(set(tensors) - set(named))
    if missing or extra:
        raise ValueError(f"it names tensors the file lacks ({missing[:5]}) or leaves out tensors "
                         f"the file holds ({extra[:5]})")
    validate_tree(doc["tree"], len(entries))
    for node, key_path in walk_tree(doc["tree"]):
        where = join_key(key_path)
        if node["t"] == "str" and not _is_unicode_text(node["v"]):
            raise ValueError(f"a string at {where!r:.80} is not valid Unicode text")
        if node["t"] != "dict":
            continue
        if node.get("cls", "OrderedDict") != "OrderedDict" or ("meta" in node and "cls" not in node):
            raise ValueError(f"the dict at {where!r:.80} has the class {node.get('cls')!r:.40} or a meta "
                             f"without one: only an OrderedDict has either")
        if "meta" in node and node["meta"]["t"] != "dict":
            raise ValueError(f"the OrderedDict at {where!r:.80} has a {node['meta']['t']!r:.40} as its meta")
        for key, _child in node["items"]:
            if key["t"] == "str" and not _is_unicode_text(key["v"]):
                raise ValueError(f"a dict key at {where!r:.80} is not valid Unicode text")
        keys = [decode_scalar(key) for key, _child in node["items"]]
        # by == (as a dict holds them: True == 1, 0.0 == -0.0) and by repr (NaN != NaN): a key
        # given twice would silently drop a value
        if len(set(keys)) != len(keys) or len(set(map(repr, keys))) != len(keys):
            raise ValueError(f"the dict at {where!r:.80} repeats a key")
    return entries


def _is_unicode_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (JSON can spell lone surrogates, which the writer refuses)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _rebuilt_tensor(entries: list[dict[str, Any]], i: int, tensor: Any, done: dict[int, Any], torch: Any) -> Any:
    """Entry ``i`` of the structure document as the object it was: a Parameter where it was one,
    and the very object of the entry it was tied to, where the file still holds equal bytes."""
    entry = entries[i]
    parameter = entry.get("parameter")
    alias = entry.get("alias")
    if alias is not None:
        if not (isinstance(alias, int) and not isinstance(alias, bool) and 0 <= alias < i):
            raise ValueError(f"entry {i} ties to {alias!r}, not to an earlier entry")
        shared = done[alias]
        if _same_bits(shared, tensor, torch):
            same_type = isinstance(shared, torch.nn.Parameter) == isinstance(parameter, dict)
            if same_type and (not isinstance(parameter, dict)
                              or shared.requires_grad == bool(parameter.get("requires_grad"))):
                return shared
            tensor = shared.detach()  # the same memory, as the type this entry had
        else:
            # Another tool changed one of the two copies: keep what the file says.
            logger.warning("convert: %r was tied to %r but the file holds different bytes for it; "
                           "it is restored as a separate tensor", entry["name"], entries[alias]["name"])
    if isinstance(parameter, dict):
        if parameter["requires_grad"] and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"entry {i} is a {tensor.dtype} Parameter that requires grad, which only "
                             f"floating-point and complex tensors can")
        return torch.nn.Parameter(tensor, requires_grad=parameter["requires_grad"])
    return tensor


def _same_bits(a: Any, b: Any, torch: Any) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.detach().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
