"""A damaged or hand-made offload ``index.json`` is refused when the index is read, naming the entry.

Before, a shape was read with ``int(d)`` per dimension: ``[2.5, 3]`` and ``["2", "3"]`` loaded as
``(2, 3)``, ``"23"`` as ``(2, 3)``, ``[-2, 3]`` failed at the first read with "needs -24 bytes", and
an entry that is not an object failed with ``TypeError: argument of type 'int' is not iterable``.
Folders written by accelerate (its dtype strings, ``[]`` for scalars) keep loading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from bigmodel import OffloadedWeightsLoader, load_offloaded_weight, offload_state_dict
from bigmodel.offload.format import OffloadIndexError

VALUES = {
    "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "scalar": torch.tensor(1.5),
    "half": torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
    "ids": torch.tensor([3, 4, 5], dtype=torch.int64),
    "mask": torch.tensor([True, False]),
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    offload_state_dict(tmp_path / "offload", VALUES)
    return tmp_path / "offload"


def _damage(folder: Path, key: str, field: str | None, value: object) -> Path:
    """Set ``index[key][field] = value`` (the whole entry when ``field`` is None; drop the field for ...)."""
    path = folder / "index.json"
    index = json.loads(path.read_text())
    if field is None:
        index[key] = value
    elif value is ...:
        del index[key][field]
    else:
        index[key][field] = value
    path.write_text(json.dumps(index))
    return path


BAD_SHAPES = {
    "float": ([2.5, 3], r"shape \[2\.5, 3\]"),  # was read as (2, 3), silently
    "strings": (["2", "3"], r"shape \['2', '3'\]"),  # was read as (2, 3), silently
    "a-string": ("23", r"shape '23'"),  # was read as (2, 3), silently
    "negative": ([-2, 3], r"shape \[-2, 3\]"),  # was "holds 24 bytes but ... needs -24" at the first read
    "bool": ([True, 6], r"shape \[True, 6\]"),
    "a-number": (6, r"shape 6"),
    "missing": (..., r"shape None"),
}


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_a_bad_shape_is_refused_when_the_index_is_read(folder: Path, case: str) -> None:
    value, shown = BAD_SHAPES[case]
    index = _damage(folder, "a.weight", "shape", value)
    message = (
        rf"Offload index '{re.escape(str(index))}', entry 'a\.weight': {shown} is not a list of non-negative "
        r"integers \(e\.g\. \[4096, 4096\], \[\] for a scalar\); the index is damaged or was edited by hand: "
        r"correct that entry, or delete the offload folder and offload again\."
    )
    with pytest.raises(OffloadIndexError, match=message):
        OffloadedWeightsLoader(save_folder=folder)


@pytest.mark.parametrize("dtype", ["float33", 7, ...])
def test_an_unknown_dtype_is_refused_when_the_index_is_read(folder: Path, dtype: object) -> None:
    index = _damage(folder, "ids", "dtype", dtype)
    shown = "None" if dtype is ... else repr(dtype)
    message = rf"Offload index '{re.escape(str(index))}', entry 'ids': dtype {re.escape(shown)} is not a torch dtype"
    with pytest.raises(OffloadIndexError, match=message) as info:
        OffloadedWeightsLoader(save_folder=folder)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)  # accelerate raises either


def test_an_entry_that_is_not_an_object_is_refused(folder: Path) -> None:
    index = _damage(folder, "mask", None, [2])
    with pytest.raises(OffloadIndexError, match=rf"'{re.escape(str(index))}', entry 'mask' is \[2\], not an object"):
        OffloadedWeightsLoader(save_folder=folder)


def test_a_bad_part_of_a_quantized_entry_is_named(folder: Path) -> None:
    index = json.loads((folder / "index.json").read_text())
    index["a.weight"]["quantization"] = {"form": "int8", "parts": {"data": {"dtype": "int8", "shape": [2, -3]}}}
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(OffloadIndexError, match=r"entry 'a\.weight', quantization part 'data': shape \[2, -3\]"):
        OffloadedWeightsLoader(save_folder=folder)


def test_a_bad_shape_passed_to_load_offloaded_weight_names_the_file(folder: Path) -> None:
    with pytest.raises(OffloadIndexError, match=r"Offload entry for '.*a\.weight\.dat': shape \[2\.0, 3\.0\]"):
        load_offloaded_weight(folder / "a.weight.dat", {"dtype": "float32", "shape": [2.0, 3.0]})


def test_an_index_passed_in_memory_is_checked_too(folder: Path) -> None:
    index = json.loads((folder / "index.json").read_text())
    index["ids"]["shape"] = [3.0]
    with pytest.raises(OffloadIndexError, match=r"'.*index\.json', entry 'ids': shape \[3\.0\]"):
        OffloadedWeightsLoader(save_folder=folder, index=index)


def test_valid_entries_still_load_scalars_and_pointers_included(folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    index = json.loads((folder / "index.json").read_text())
    assert index["scalar"] == {"dtype": "float32", "shape": []}
    index["pointer"] = {"safetensors_file": str(tmp_path / "model.safetensors"), "weight_name": "w", "dtype": "float16"}
    loader = OffloadedWeightsLoader(save_folder=folder, index=index)  # a pointer needs no shape (transformers)
    for name, value in VALUES.items():
        assert loader[name].dtype == value.dtype and torch.equal(loader[name], value), name
    assert loader["pointer"].dtype == torch.float16 and torch.equal(loader["pointer"], torch.ones(2, 2).half())


def test_a_folder_written_by_accelerate_loads(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate.utils")
    values = {**VALUES, "half16": torch.tensor([0.5, 2.0], dtype=torch.float16)}
    accelerate.offload_state_dict(str(tmp_path), values)
    index = json.loads((tmp_path / "index.json").read_text())
    assert {index[k]["dtype"] for k in index} == {"float32", "bfloat16", "int64", "bool", "float16"}
    assert index["scalar"]["shape"] == []
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    for name, value in values.items():
        assert loader[name].dtype == value.dtype and torch.equal(loader[name], value), name
