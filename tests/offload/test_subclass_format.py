"""Wrapper tensor subclasses in an offload folder: inner tensors as raw .dat files, a JSON spec in index.json.

Uses torchao's quantized tensors (the subclasses users have) and a small nested subclass defined
here (a subclass inside a subclass, and a context holding each JSON-tagged type).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from bigmodel.core.file_maps import is_mapped
from bigmodel.core.subclasses import flatten_tensor, stored_nbytes
from bigmodel.offload.storage import OffloadedWeightsLoader, OffloadWriter, dat_path
from bigmodel.offload.subclass_format import decode_context, encode_context, spec_from_entry
from bigmodel.utils import compute_module_sizes, load_offloaded_weight, offload_weight


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


@dataclass(frozen=True)
class Settings:
    mode: Mode
    block: tuple[int, int]


class Pair(torch.Tensor):
    """A float tensor stored as ``a * scale + b`` (``a`` may itself be a Pair); the context holds the scale."""

    @staticmethod
    def __new__(cls, a: torch.Tensor, b: torch.Tensor, context: dict):
        out = torch.Tensor._make_wrapper_subclass(cls, b.shape, dtype=torch.float32, device=b.device)
        out.a, out.b, out.context = a, b, context
        return out

    def __tensor_flatten__(self):
        return ["a", "b"], self.context

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return Pair(inner["a"], inner["b"], context)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Pair does not compute ({func})")

    def value(self) -> torch.Tensor:
        a = self.a.value() if isinstance(self.a, Pair) else self.a.float()
        return a * self.context["scale"] + self.b


CONTEXT = {
    "scale": 0.5, "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
    "block": (1, 64), "names": ["x", None, True], "settings": Settings(Mode.EXACT, (4, 8)),
}  # fmt: skip


def nested_pair() -> Pair:
    inner = Pair(torch.arange(12, dtype=torch.int8).reshape(3, 4), torch.ones(3, 4, dtype=torch.float16), {"scale": 2.0})
    return Pair(inner, torch.full((3, 4), 0.25), dict(CONTEXT))


def test_context_round_trips_through_json():
    data = json.loads(json.dumps(encode_context(CONTEXT, "w")))
    assert decode_context(data, "w") == CONTEXT
    assert type(decode_context(data, "w")["block"]) is tuple


def test_nested_subclass_bytes_and_round_trip(tmp_path):
    pair = nested_pair()
    assert stored_nbytes(pair) == 12 * 1 + 12 * 2 + 12 * 4  # int8 + float16 inside, float32 outside
    parts, spec = flatten_tensor(pair)
    assert sorted(parts) == ["a.a", "a.b", "b"] and spec.part_names() == ["a.a", "a.b", "b"]
    index = offload_weight(pair, "layer.w", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer.w#a.a.dat", "layer.w#a.b.dat", "layer.w#b.dat"]
    back = load_offloaded_weight(dat_path(tmp_path, "layer.w"), json.loads(json.dumps(index["layer.w"])))
    assert type(back) is Pair and type(back.a) is Pair
    assert back.context == CONTEXT and back.a.context == {"scale": 2.0}
    assert torch.equal(back.value(), pair.value())
    assert is_mapped(back.a.a) and is_mapped(back.b)  # views of the part files


def test_writer_stages_parts_and_duplicates_a_tied_subclass(tmp_path):
    writer = OffloadWriter(tmp_path)
    writer.write("first", nested_pair())
    writer.duplicate("second", "first")
    writer.commit()
    index = json.loads((tmp_path / "index.json").read_text())
    assert sorted(index) == ["first", "second"]  # parts have no index entry of their own
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    for name in ("first", "second"):
        assert torch.equal(loader[name].value(), nested_pair().value())
    assert loader["first"].b is not loader["first"].b  # a new object per read, over one cached mapping
    assert loader["first"].b.data_ptr() == loader["first"].b.data_ptr()


def test_torchao_weight_round_trips_and_sizes(tmp_path):
    torchao_quantization = pytest.importorskip("torchao.quantization")
    model = nn.Sequential(nn.Linear(64, 32))
    torchao_quantization.quantize_(model, torchao_quantization.Int8WeightOnlyConfig())
    weight = model[0].weight
    index = offload_weight(weight, "0.weight", tmp_path)
    back = load_offloaded_weight(dat_path(tmp_path, "0.weight"), index["0.weight"])
    assert type(back) is torchao_quantization.Int8Tensor
    assert torch.equal(back.qdata, weight.qdata) and torch.equal(back.scale, weight.scale)
    x = torch.randn(2, 64)
    assert torch.equal(nn.functional.linear(x, back), nn.functional.linear(x, weight))
    assert compute_module_sizes(model)["0.weight"] == stored_nbytes(weight) == 32 * 64 + 32 * 4 + 32


def _entry(cls: str) -> dict:
    return {"dtype": "float32", "shape": [3, 4], "subclass": {"class": cls, "inner": {}, "context": None}}


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        ("bigmodel_no_such_package.sub:Thing", r"'w'.*bigmodel_no_such_package.*not imported.*import"),
        ("os:system", r"'w'.*'os:system' is not a class"),
        ("json:JSONDecoder", r"'w'.*not a tensor subclass with __tensor_unflatten__"),
    ],
)
def test_an_entry_naming_a_class_it_should_not_is_refused(cls, message):
    with pytest.raises(ValueError, match=message):
        spec_from_entry(_entry(cls), "w")


def test_a_truncated_part_file_is_refused_naming_it(tmp_path):
    index = offload_weight(nested_pair(), "w", tmp_path)
    (tmp_path / "w#b.dat").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"w#b\.dat.*offload again"):
        load_offloaded_weight(dat_path(tmp_path, "w"), index["w"])


def test_the_overwrite_guard_tells_part_files_of_an_offload_from_a_users(tmp_path):
    from bigmodel.offload.format import files_no_offload_wrote
    from bigmodel.offload.storage import offload_state_dict

    offload_state_dict(tmp_path, {"w": nested_pair(), "sub/v": nested_pair()})
    names = ["w", "sub/v", "other"]
    assert files_no_offload_wrote(tmp_path, names) == []  # the offload's own parts (w#a.a.dat, sub/v#b.dat ...)
    users = [tmp_path / "w#c.dat", tmp_path / "sub" / "v#notes.dat", tmp_path / "other#a.dat",
             tmp_path / "other@scale.dat", tmp_path / "w.dat"]  # w is stored as parts: w.dat is no offload's
    for path in users:
        path.write_bytes(b"mine")
    assert sorted(files_no_offload_wrote(tmp_path, names)) == sorted(users)
    (tmp_path / "other#a.dat.bak").write_bytes(b"mine")  # not a .dat name: never written, never reported
    (tmp_path / "otherwise#a.dat").write_bytes(b"mine")  # another tensor's name
    assert sorted(files_no_offload_wrote(tmp_path, names)) == sorted(users)
