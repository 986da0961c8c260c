"""Adversarial probes: bad and unusual input to loading, planning and hooks.

Each test feeds the library something a careless or hostile user could pass and checks
that it either works or fails with an error naming the culprit, without partial state.
Probes of bugs not fixed yet are ``xfail(strict=True)`` with the reason (the fix belongs
to a module owned elsewhere); they start failing loudly once the bug is fixed.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import hashlib
import json
import os
import pickle
import re
import struct
import threading
import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import bigmodel.offload.writer as writer_module
from bigmodel import (
    OffloadedWeightsLoader,
    align_module_device,
    attach_align_device_hook,
    attach_layerwise_casting_hooks,
    convert_file_size_to_int,
    cpu_offload,
    disk_offload,
    dispatch_model,
    find_tied_parameters,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    load_state_dict,
    offload_state_dict,
    offload_weight,
    remove_hook_from_module,
    remove_hook_from_submodules,
    set_module_tensor_to_device,
)
from bigmodel.hooks.moving import send_to_device


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Net().state_dict().items()}


def _meta_net() -> Net:
    with init_empty_weights():
        return Net()


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _safetensors_bytes(header: object, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt" / "model.safetensors"
    path.parent.mkdir()
    save_file(_state(), path)
    return path


# ------------------------------------------------------------------ corrupted safetensors


def _corruptions(good: bytes) -> dict[str, bytes]:
    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    return {
        "truncated": good[:-5],
        "trailing_garbage": good + b"junk",
        "empty": b"",
        "huge_header_length": struct.pack("<Q", 2**63) + good[8:],
        "bad_json": struct.pack("<Q", 5) + b"{abc}",
        "header_is_list": _safetensors_bytes([1, 2], b""),
        "unknown_dtype": _safetensors_bytes({"w": {**f32, "dtype": "Q7"}}, bytes(8)),
        "overlapping_offsets": _safetensors_bytes({"w": f32, "v": f32}, bytes(8)),
        "offset_out_of_range": _safetensors_bytes({"w": {**f32, "data_offsets": [0, 800]}}, bytes(8)),
        "shape_vs_bytes": _safetensors_bytes({"w": {**f32, "shape": [3]}}, bytes(8)),
        "negative_dim": _safetensors_bytes({"w": {**f32, "shape": [-2]}}, bytes(8)),
    }


@pytest.mark.parametrize("kind", list(_corruptions(b"x" * 16)))
def test_corrupted_safetensors_is_refused_and_model_unchanged(tmp_path, checkpoint, kind):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_corruptions(checkpoint.read_bytes())[kind])
    with pytest.raises(ValueError, match=r"bad\.safetensors.*not a valid safetensors file.*save it again"):
        load_state_dict(bad)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"bad\.safetensors"):
        load_checkpoint_in_model(model, bad)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_misaligned_tensor_offsets_still_load(tmp_path):
    data = struct.pack("<B", 7) + struct.pack("<2f", 1.5, -2.0)
    header = {
        "u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "w": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
    }
    path = tmp_path / "odd.safetensors"
    path.write_bytes(_safetensors_bytes(header, data))
    loaded = load_state_dict(path)
    assert loaded["u"].tolist() == [7]
    assert loaded["w"].tolist() == [1.5, -2.0]


# ------------------------------------------------------------------ shapes, keys, strict


def test_shape_mismatch_names_key_and_both_shapes_and_changes_nothing(tmp_path):
    state = _state()
    state["b.weight"] = torch.zeros(3, 4)
    save_file(state, tmp_path / "bad.safetensors")
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'b\.weight': checkpoint \[3, 4\] vs model \[2, 4\]"):
        load_checkpoint_in_model(
            model, tmp_path / "bad.safetensors", device_map={"a": "disk", "b": "cpu"}, offload_folder=tmp_path / "off"
        )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "off").exists()  # nothing written before the error


def test_strict_lists_missing_and_unexpected_keys(tmp_path):
    state = _state()
    del state["a.bias"]
    state["zz.weight"] = torch.zeros(1)
    save_file(state, tmp_path / "x.safetensors")
    model = _meta_net()
    with pytest.raises(ValueError, match=r"missing keys \(1\): a\.bias; unexpected keys \(1\): zz\.weight"):
        load_checkpoint_in_model(model, tmp_path / "x.safetensors", strict=True)
    assert model.a.weight.device.type == "meta"


def test_uncovered_device_map_names_the_tensor_before_loading(checkpoint):
    model = _meta_net()
    with pytest.raises(KeyError, match=r"does not cover 2 parameters/buffers of .*: b\.weight, b\.bias"):
        load_checkpoint_in_model(model, checkpoint, device_map={"a": "cpu"})
    assert model.a.weight.device.type == "meta"


@pytest.mark.parametrize("key", ["b.", " b", "b ", ".b", 1])
def test_a_misspelt_map_key_is_named_beside_the_tensors_it_leaves_out(checkpoint, key):
    model = _meta_net()
    shown = re.escape(repr(key))
    with pytest.raises(ValueError, match=rf"does not cover .*b\.weight.* The map.s key\(s\) {shown} cover nothing"):
        load_checkpoint_in_model(model, checkpoint, device_map={"a": "cpu", key: "cpu"})
    assert model.a.weight.device.type == "meta"


def test_a_map_key_that_only_misses_is_not_called_misspelt(checkpoint):
    with pytest.raises(ValueError, match=r"does not cover .*to the device map\.$"):
        load_checkpoint_in_model(_meta_net(), checkpoint, device_map={"a": "cpu", "b.x.": "cpu"})


def test_made_up_device_name_is_a_value_error():
    linear = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"Device 'gpu' is not a device spec"):
        set_module_tensor_to_device(linear, "weight", "gpu", value=torch.zeros(2, 2))


@pytest.mark.parametrize(("spec", "lower"), [("DISK", "disk"), ("CPU", "cpu"), ("Meta", "meta")])
def test_an_uppercase_device_name_in_a_map_says_to_write_it_lowercase(tmp_path, checkpoint, spec, lower):
    message = rf"Device '{spec}' is not a device spec \(device names are lowercase: '{lower}'\); use .*'disk'"
    with pytest.raises(ValueError, match=message):
        load_checkpoint_and_dispatch(_meta_net(), checkpoint, device_map={"a": "cpu", "b": spec},
                                     offload_folder=tmp_path)  # fmt: skip


# ------------------------------------------------------------------ sharded index attacks


def _index(folder, weight_map):
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.fixture
def sharded(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    state = _state()
    save_file({k: v for k, v in state.items() if k.startswith("a")}, folder / "s1.safetensors")
    save_file({k: v for k, v in state.items() if k.startswith("b")}, tmp_path / "outside.safetensors")
    return folder


@pytest.mark.parametrize(
    "shard, message",
    [
        ("../outside.safetensors", "outside the checkpoint folder"),
        ("ABS", "outside the checkpoint folder"),
        ("link.safetensors", "resolves outside the checkpoint folder"),
        ("nope.safetensors", "shard 'nope.safetensors' .*is missing"),
        (5, "entry 'b.weight' maps to 5, not a shard file name"),  # was "points to shard 5 outside the folder"
        ("sub", "shard 'sub' \\(for 'b.weight'\\) is a folder, not a weights file"),  # was "is missing"
        ("model.safetensors.index.json", "is not a .safetensors, .bin, .pt or .pth file"),  # was read as a pickle
        ("notes.txt", "shard 'notes.txt' .* is not a .safetensors, .bin, .pt or .pth file; fix the index"),
    ],
)
def test_index_shards_cannot_leave_the_folder(sharded, shard, message):
    os.symlink(sharded.parent / "outside.safetensors", sharded / "link.safetensors")
    (sharded / "sub").mkdir()
    (sharded / "notes.txt").write_text("not weights")
    if shard == "ABS":
        shard = str(sharded.parent / "outside.safetensors")
    index = _index(
        sharded, {"a.weight": "s1.safetensors", "a.bias": "s1.safetensors", "b.weight": shard, "b.bias": shard}
    )
    model = _meta_net()
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_checkpoint_in_model(model, index)
    assert model.a.weight.device.type == "meta"


def test_one_shard_spelt_two_ways_is_read_once(sharded, caplog):
    save_file({k: v for k, v in _state().items() if k.startswith("b")}, sharded / "s2.safetensors")
    index = _index(sharded, {"a.weight": "s1.safetensors", "a.bias": "./s1.safetensors",
                             "b.weight": "s2.safetensors", "b.bias": "s2.safetensors"})  # fmt: skip
    model = _meta_net()
    load_checkpoint_in_model(model, index)
    assert "is in both" not in caplog.text  # was: "Tensor 'a.bias' is in both <s1> and <s1>"
    assert torch.equal(model.a.bias, _state()["a.bias"])


def test_index_that_is_not_a_mapping(sharded):
    (sharded / "model.safetensors.index.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"is not a sharded-checkpoint index"):
        load_checkpoint_in_model(_meta_net(), sharded / "model.safetensors.index.json")


# ------------------------------------------------------------------ folders


def test_empty_folder(tmp_path):
    with pytest.raises(ValueError, match=r"holds no weights.*found: \[\]"):
        load_checkpoint_in_model(_meta_net(), tmp_path)


def test_folder_with_bin_and_safetensors_prefers_safetensors(tmp_path):
    state = _state()
    save_file(state, tmp_path / "model.safetensors")
    torch.save({k: torch.full_like(v, 9.0) for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    model = _meta_net()
    load_checkpoint_in_model(model, tmp_path)
    assert torch.equal(model.a.weight, state["a.weight"])


# ------------------------------------------------------------------ torch pickles


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("layout", ["zip", "legacy_torch"])
def test_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path, layout):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    torch.save({"a.weight": _Evil(marker)}, path, _use_new_zipfile_serialization=layout == "zip")
    with pytest.raises(pickle.UnpicklingError, match=r"Refusing to load .*evil\.bin.*GLOBAL \S*system"):
        load_state_dict(path)
    with pytest.raises(pickle.UnpicklingError, match="could run code"):
        load_checkpoint_in_model(_meta_net(), path)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_plain_python_pickle_with_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"a.weight": _Evil(marker)}, f)
    with pytest.raises(ValueError, match=r"evil\.pt' is not a readable torch checkpoint"):
        load_state_dict(path)
    assert not marker.exists()


@pytest.mark.parametrize("content, reason", [(b"hello world", "KeyError"), (b"", "EOFError")])
def test_garbage_bin_is_a_value_error(tmp_path, content, reason):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"not a readable torch checkpoint \({reason}"):
        load_state_dict(path)


def test_pickle_with_non_string_keys_loads_the_rest(tmp_path, caplog):
    state = _state()
    torch.save({**state, 1: torch.zeros(1)}, tmp_path / "x.bin")
    model = _meta_net()
    load_checkpoint_in_model(model, tmp_path / "x.bin", strict=True)
    assert torch.equal(model.b.weight, state["b.weight"])
    assert "skipping key 1" in caplog.text


# ------------------------------------------------------------------ offload folder


def test_offload_folder_that_is_a_file(tmp_path, checkpoint):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PermissionError, match=r"afile' is not writable"):
        load_checkpoint_in_model(_meta_net(), checkpoint, device_map={"": "disk"}, offload_folder=tmp_path / "afile")


@pytest.mark.parametrize("spelling", ["same", "dot_slash", "via_folder"])
def test_offload_folder_is_the_checkpoint_folder(checkpoint, spelling):
    digest = _sha(checkpoint)
    folder = checkpoint.parent
    offload = {"same": folder, "dot_slash": f"{folder}/./", "via_folder": folder}[spelling]
    source = folder if spelling == "via_folder" else checkpoint
    (folder / "index.json").write_text('{"mine": "not an offload index"}')
    with pytest.raises(ValueError, match=r"is the checkpoint's folder, and 'index\.json' already exists .* never overwrites"):
        load_checkpoint_in_model(_meta_net(), source, device_map={"": "disk"}, offload_folder=offload)
    assert (folder / "index.json").read_text() == '{"mine": "not an offload index"}'
    (folder / "index.json").unlink()
    load_checkpoint_in_model(_meta_net(), source, device_map={"": "disk"}, offload_folder=offload)
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "model.safetensors"]  # pointers, no copy
    assert _sha(checkpoint) == digest


def _offload_then_fail(checkpoint, folder, monkeypatch, fail_on):
    """Offload once (fp16), then reload as bf16 with a disk that fills up at ``fail_on``."""
    load_checkpoint_in_model(
        _meta_net(), checkpoint, device_map={"": "disk"}, offload_folder=folder, dtype=torch.float16
    )
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    fail_on(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        load_checkpoint_in_model(
            _meta_net(), checkpoint, device_map={"": "disk"}, offload_folder=folder, dtype=torch.bfloat16
        )
    monkeypatch.undo()
    return before


def _fail_on_third_tensor(monkeypatch):
    raw_bytes, calls = writer_module.raw_bytes, []

    def full(tensor):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return raw_bytes(tensor)

    monkeypatch.setattr(writer_module, "raw_bytes", full)


def _fail_on_index(monkeypatch):
    atomic_write = writer_module.atomic_write

    def full(path, write):
        if path.name == "index.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return atomic_write(path, write)

    monkeypatch.setattr(writer_module, "atomic_write", full)


def test_disk_full_mid_offload_keeps_previous_index_and_checkpoint(tmp_path, checkpoint, monkeypatch):
    digest = _sha(checkpoint)
    folder = tmp_path / "off"
    before = _offload_then_fail(checkpoint, folder, monkeypatch, _fail_on_third_tensor)
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert after == before  # same index, same .dat bytes, no temporary file left behind
    assert _sha(checkpoint) == digest
    loader = OffloadedWeightsLoader(save_folder=folder)
    assert torch.equal(loader["a.weight"], _state()["a.weight"].half())


def test_disk_full_while_writing_index_keeps_previous_offload_readable(tmp_path, checkpoint, monkeypatch):
    folder = tmp_path / "off"
    _offload_then_fail(checkpoint, folder, monkeypatch, _fail_on_index)
    loader = OffloadedWeightsLoader(save_folder=folder)
    assert torch.equal(loader["a.weight"], _state()["a.weight"].half())


def test_failure_writing_the_merged_index_never_leaves_an_entry_reading_other_bytes(tmp_path, monkeypatch):
    folder = tmp_path / "off"
    offload_state_dict(folder, {"kept": torch.ones(2), "replaced": torch.ones(3, dtype=torch.float16)})
    atomic_write, index_writes = writer_module.atomic_write, []

    def second_index_write_fails(path, write):
        if path.name == "index.json":
            index_writes.append(1)
            if len(index_writes) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return atomic_write(path, write)

    monkeypatch.setattr(writer_module, "atomic_write", second_index_write_fails)
    with pytest.raises(OSError, match="No space left"):
        offload_state_dict(folder, {"replaced": torch.full((3,), 2.0, dtype=torch.bfloat16)})
    monkeypatch.undo()
    loader = OffloadedWeightsLoader(save_folder=folder)
    assert sorted(loader) == ["kept"]  # the replaced entry is gone from the index, not describing bf16 bytes as fp16
    assert torch.equal(loader["kept"], torch.ones(2))


@pytest.mark.parametrize("name", ["ünïcode.wéight", "a.b.c", "x-y+z weight", "..."])
def test_offload_names_with_odd_characters_round_trip(tmp_path, name):
    value = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    offload_state_dict(tmp_path, {name: value})
    assert (tmp_path / f"{name}.dat").is_file()
    assert torch.equal(OffloadedWeightsLoader(save_folder=tmp_path)[name], value)


def test_offload_weight_name_cannot_escape_the_folder(tmp_path):
    folder = tmp_path / "off"
    with pytest.raises(ValueError, match=r"\.\./evil"):
        offload_weight(torch.ones(2), "../evil", folder)
    assert not (tmp_path / "evil.dat").exists()


def test_offload_state_dict_absolute_name_cannot_escape_the_folder(tmp_path):
    folder = tmp_path / "off"
    target = tmp_path / "evil"
    (folder / str(tmp_path).lstrip("/")).mkdir(parents=True)  # lets the staging file be created
    try:
        offload_state_dict(folder, {str(target): torch.ones(2)})
    except ValueError as err:
        assert str(target) in str(err)
    assert not (tmp_path / "evil.dat").exists()


class Slashed(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("x/y", nn.Linear(2, 2))  # torch accepts '/' in module names


def test_module_name_with_slash_offloaded_to_disk(tmp_path):
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Slashed().state_dict().items()}
    save_file(state, tmp_path / "m.safetensors")
    with init_empty_weights():
        model = Slashed()
    load_checkpoint_in_model(
        model, tmp_path / "m.safetensors", device_map={"": "disk"}, offload_folder=tmp_path / "off",
        dtype=torch.float16,
    )  # fmt: skip
    assert (tmp_path / "off" / "x" / "y.weight.dat").is_file()  # <name>.dat, as the format says
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    assert torch.equal(loader["x/y.weight"], state["x/y.weight"].half())
    assert sorted(p.name for p in (tmp_path / "off").iterdir()) == ["index.json", "x"]  # nothing staged left


@pytest.mark.parametrize("name", ["", ".", "..", "a/../b", "a//b", "a/./b", "/abs", "a/"])
def test_unsafe_names_are_refused_everywhere(tmp_path, name):
    with pytest.raises(ValueError, match="cannot name a file inside the offload folder"):
        offload_weight(torch.ones(1), name, tmp_path / "off")
    with pytest.raises(ValueError, match="cannot name a file inside the offload folder"):
        offload_state_dict(tmp_path / "off2", {"ok": torch.ones(1), name: torch.ones(1)})
    assert list((tmp_path / "off2").iterdir()) == []  # the staged 'ok' was removed too
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "index.json").write_text(json.dumps({name: {"dtype": "float32", "shape": [1]}}))
    with pytest.raises(ValueError, match="cannot name a file inside the offload folder"):
        OffloadedWeightsLoader(save_folder=tmp_path / "idx")[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx", "off2"]


def test_symlinked_subfolder_cannot_redirect_a_write(tmp_path):
    (tmp_path / "off").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "off" / "x")
    with pytest.raises(ValueError, match="resolves outside the offload folder"):
        offload_state_dict(tmp_path / "off", {"x/y": torch.ones(1)})
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ------------------------------------------------------------------ planning


@pytest.mark.parametrize(
    "budget, message",
    [
        ({"cpu": 0, "disk": 0}, r"Module 'a' \(80 bytes\) fits on no device"),
        ({"cpu": -1}, r"max_memory\['cpu'\]: Size -1 is negative"),
        ({"cpu": "-5MB"}, r"Size '-5MB' is not a memory size"),
        ({"cpu": "lots"}, r"Size 'lots' is not a memory size"),
        ({"cpu": float("inf")}, r"Size inf is not a memory size"),
        ({"cpu": float("nan")}, r"Size nan is not a memory size"),
        ({"gpu": 10}, r"max_memory key 'gpu' is not a device"),
        ({"meta": 10}, r"max_memory key 'meta' is not a device"),
        ({True: 10}, r"max_memory key True is not a device"),
        ({}, r"max_memory is empty"),
    ],
)
def test_bad_budgets_are_named(budget, message):
    with pytest.raises(ValueError, match=message):
        infer_auto_device_map(Net(), max_memory=budget)


def test_float_budget_is_bytes():
    assert convert_file_size_to_int(1.5e3) == 1500
    assert infer_auto_device_map(Net(), max_memory={"cpu": 1e3}) == {"": "cpu"}


def test_device_ids_with_gaps():
    assert infer_auto_device_map(Net(), max_memory={0: 100, 2: 100, "cpu": 10_000}) == {"a": 0, "b": 2}


def test_empty_model_and_buffer_only_model():
    class Buffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("x", torch.zeros(10))

    assert infer_auto_device_map(nn.Module(), max_memory={"cpu": 0}) == {"": "cpu"}
    assert infer_auto_device_map(Buffers(), max_memory={0: 40, "cpu": 100}) == {"": 0}


class FarTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Embedding(10, 4)
        self.mid = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
        self.last = nn.Linear(4, 10, bias=False)
        self.last.weight = self.first.weight


@pytest.mark.parametrize(
    "budget", [{0: 200, 1: 400, "cpu": 1000}, {0: 170, 1: 1000}, {0: 400, "cpu": 100, "disk": 10**4}]
)
def test_far_apart_tied_parameters_share_a_device(budget):
    device_map = infer_auto_device_map(FarTied(), max_memory=budget)
    assert device_map["first"] == device_map["last"] == 0


def test_tied_bundle_that_fits_nowhere_is_named():
    with pytest.raises(ValueError, match=r"Module 'first' with the modules tied to it \['last'\] \(160 bytes\)"):
        infer_auto_device_map(FarTied(), max_memory={0: 10, "cpu": 10, "disk": 100})


def test_no_split_class_at_root():
    assert infer_auto_device_map(FarTied(), max_memory={0: 200, 1: 1000}, no_split_module_classes=["FarTied"]) == {
        "": 1
    }
    with pytest.raises(ValueError, match=r"Module 'FarTied' \(560 bytes\) fits on no device"):
        infer_auto_device_map(FarTied(), max_memory={0: 200, 1: 300, "disk": 500}, no_split_module_classes=["FarTied"])
    assert infer_auto_device_map(FarTied(), max_memory={0: 200, 1: 300}, no_split_module_classes=["FarTied"]) == {
        "": "disk"
    }


def test_huge_meta_model_plans_without_memory():
    with init_empty_weights():
        model = nn.Sequential(*[nn.Linear(16384, 16384) for _ in range(200)])  # 215 GB in fp32
    device_map = infer_auto_device_map(model, max_memory={0: "40GiB", 1: "40GiB", "cpu": "100GiB", "disk": "10TB"})
    assert len(device_map) == 200
    assert list(device_map.values()).count(0) < 40 and "disk" in device_map.values()


# ------------------------------------------------------------------ hooks and dispatch


class BoomLinear(nn.Linear):
    fail = False

    def forward(self, x):
        out = super().forward(x)
        if self.fail:
            raise RuntimeError("boom")
        return out


class BoomNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = BoomLinear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("how", ["cpu_offload", "disk"])
def test_exception_in_forward_sends_weights_back_to_meta(tmp_path, how):
    torch.manual_seed(0)
    reference = BoomNet()
    x = torch.randn(2, 3)
    expected = reference(x)
    model = BoomNet()
    model.load_state_dict(reference.state_dict())
    if how == "cpu_offload":
        cpu_offload(model, execution_device="cpu")
    else:
        dispatch_model(model, {"": "disk"}, main_device="cpu", offload_dir=tmp_path)
    model.a.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    assert model.a.weight.device.type == "meta"  # no leaked copy of the weights
    model.a.fail = False
    assert torch.equal(model(x), expected)
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_exception_inside_align_module_device_reoffloads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    x = torch.randn(2, 3)
    expected = model(x)
    cpu_offload(model, execution_device="cpu")
    with pytest.raises(KeyError, match="inside"):
        with align_module_device(model[0], "cpu"):
            assert model[0].weight.device.type == "cpu"
            raise KeyError("inside")
    assert model[0].weight.device.type == "meta"
    assert torch.equal(model(x), expected)


def test_exception_in_layerwise_cast_forward_restores_storage_dtype():
    layer = BoomLinear(3, 3)
    attach_layerwise_casting_hooks(layer, torch.float8_e4m3fn, torch.float32)
    layer.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        layer(torch.ones(1, 3))
    assert layer.weight.dtype == torch.float8_e4m3fn


def test_cpu_offload_twice():
    torch.manual_seed(0)
    model = BoomNet()
    x = torch.randn(2, 3)
    expected = model(x)
    cpu_offload(model, execution_device="cpu")
    cpu_offload(model, execution_device="cpu")
    assert torch.equal(model(x), expected)


def test_dispatch_twice_with_disk(tmp_path):
    torch.manual_seed(0)
    model = BoomNet()
    x = torch.randn(2, 3)
    expected = model(x)
    dispatch_model(model, {"a": "cpu", "b": "disk"}, offload_dir=tmp_path / "one")
    dispatch_model(model, {"a": "cpu", "b": "disk"}, offload_dir=tmp_path / "two")
    assert sorted(json.loads((tmp_path / "two" / "index.json").read_text())) == ["b.bias", "b.weight"]
    assert len(OffloadedWeightsLoader(save_folder=tmp_path / "two")) == 2
    assert model.b.weight.device.type == "meta"
    assert type(model.b._hf_hook).__name__ == "AlignDevicesHook"
    assert torch.equal(model(x), expected)
    remove_hook_from_submodules(model)
    assert model.b.weight.device.type == "cpu" and torch.equal(model(x), expected)


def test_failed_redispatch_leaves_a_working_model_and_hooks_remove_twice(tmp_path):
    torch.manual_seed(0)
    model = BoomNet()
    x = torch.randn(2, 3)
    expected = model(x)
    dispatch_model(model, {"a": "cpu", "b": "disk"}, offload_dir=tmp_path / "one")
    with pytest.raises(ValueError, match=r"does not cover 2 parameters/buffers of BoomNet: b.weight, b.bias"):
        dispatch_model(model, {"a": "cpu"})  # a map that misses b: refused before the old hooks are removed
    assert model.b.weight.device.type == "meta"  # still dispatched as before
    assert torch.equal(model(x), expected)
    remove_hook_from_submodules(model)
    remove_hook_from_submodules(model)
    remove_hook_from_module(model, recurse=True)
    assert model.b.weight.device.type == "cpu"
    assert not hasattr(model.b, "_hf_hook") and not hasattr(model.b, "_old_forward")
    assert torch.equal(model(x), expected)


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, *, x, scale: int = 1, extra=None):
        return {"out": self.linear(x) * scale, "extra": extra, "pair": (self.linear(x), None, 3)}


def test_keyword_only_forward_with_dict_and_tuple_outputs():
    torch.manual_seed(0)
    model = KeywordOnly()
    x = torch.randn(2, 3)
    expected = model.linear(x) * 2
    cpu_offload(model, execution_device="cpu")
    out = model(x=x, scale=2, extra="tag")
    assert torch.equal(out["out"], expected)
    assert out["extra"] == "tag"
    assert out["pair"][1:] == (None, 3)


@dataclasses.dataclass
class Inner:
    t: torch.Tensor
    n: int = 3
    none: object = None


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    items: list


def test_nested_dataclasses_none_and_ints_are_moved():
    moved = send_to_device(Outer(Inner(torch.ones(2)), [None, 1, (torch.zeros(1), "s")]), "meta")
    assert isinstance(moved, Outer) and moved.inner.t.device.type == "meta"
    assert (moved.inner.n, moved.inner.none) == (3, None)
    assert moved.items[:2] == [None, 1] and moved.items[2][0].device.type == "meta" and moved.items[2][1] == "s"


def test_skip_keys_at_any_depth():
    cache = [torch.zeros(1)]
    moved = send_to_device({"x": torch.ones(1), "deep": {"past": cache}}, "meta", skip_keys="past")
    assert moved["x"].device.type == "meta"
    assert moved["deep"]["past"] is cache


def test_concurrent_forwards_on_a_disk_offloaded_model_stay_correct(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(2, 8)
    expected = model(x)
    dispatch_model(model, {"": "disk"}, main_device="cpu", offload_dir=tmp_path)
    results, errors = [], []

    def run():
        try:
            results.extend(torch.equal(model(x), expected) for _ in range(5))
        except Exception as err:  # collected so the main thread can report it
            errors.append(repr(err))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [True] * 15


def test_tied_weights_survive_disk_dispatch_and_removal(tmp_path):
    torch.manual_seed(0)
    model = FarTied()
    ids = torch.tensor([[1, 2]])
    expected = model.last(model.mid(model.first(ids)))
    dispatch_model(model, {"first": "cpu", "mid": "disk", "last": "disk"}, offload_dir=tmp_path)
    remove_hook_from_submodules(model)
    assert find_tied_parameters(model) == [["first.weight", "last.weight"]]
    assert torch.equal(model.last(model.mid(model.first(ids))), expected)


def test_offload_file_deleted_between_forwards_names_it_and_unloads(tmp_path, monkeypatch):
    """Files read at each forward (not mapped: BIGMODEL_MAPPED_WEIGHTS=copy): a deleted one is named."""
    monkeypatch.setenv("BIGMODEL_MAPPED_WEIGHTS", "copy")
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    dispatch_model(model, {"": "disk"}, main_device="cpu", offload_dir=tmp_path)
    (tmp_path / "1.bias.dat").unlink()
    with pytest.raises(FileNotFoundError, match=r"1\.bias\.dat' is missing; offload the model again"):
        model(torch.ones(1, 3))
    assert model[0].weight.device.type == model[1].weight.device.type == "meta"


def test_offload_file_deleted_after_dispatch_leaves_a_mapped_model_its_values(tmp_path):
    """Mapped at dispatch: deleting (or replacing) a .dat file afterwards changes nothing for the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    x = torch.ones(1, 3)
    expected = model(x)
    dispatch_model(model, {"": "disk"}, main_device="cpu", offload_dir=tmp_path)
    (tmp_path / "1.bias.dat").unlink()
    assert torch.equal(model(x), expected)


def test_disk_offload_into_folder_with_stale_index(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    x = torch.ones(1, 3)
    expected = model(x)
    (tmp_path / "index.json").write_text(json.dumps({"0.weight": {"dtype": "float32", "shape": [3, 3]}}))
    disk_offload(model, tmp_path, execution_device="cpu")  # the stale entry (no .dat file) is rewritten
    assert (tmp_path / "0.weight.dat").is_file() and (tmp_path / "1.bias.dat").is_file()
    assert torch.equal(model(x), expected)


def test_disk_offload_index_with_other_shapes_is_rewritten(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    x = torch.ones(1, 3)
    expected = model(x)
    offload_state_dict(tmp_path, {"0.weight": torch.zeros(2, 2), "0.bias": torch.zeros(3, dtype=torch.float16)})
    disk_offload(model, tmp_path, execution_device="cpu")
    assert json.loads((tmp_path / "index.json").read_text())["0.weight"]["shape"] == [3, 3]
    assert torch.equal(model(x), expected)


def test_disk_offload_of_meta_model_with_incomplete_index_is_refused_untouched(tmp_path):
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    offload_state_dict(tmp_path, {"0.weight": torch.zeros(3, 3), "0.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"1\.weight \(not in the index\).*load the checkpoint first"):
        disk_offload(model, tmp_path, execution_device="cpu")
    assert not hasattr(model[0], "_hf_hook")


# ------------------------------------------------------------------ empty-weight contexts


@pytest.mark.parametrize("outer_buffers", [False, True])
@pytest.mark.parametrize("inner_buffers", [False, True])
def test_real_device_context_nested_in_empty_weights(outer_buffers, inner_buffers):
    with init_empty_weights(include_buffers=outer_buffers):
        with init_on_device("cpu", include_buffers=inner_buffers):
            inner = nn.BatchNorm1d(2)
            param = nn.Parameter(torch.ones(2))
        after = nn.BatchNorm1d(2)
    assert inner.weight.device.type == "cpu" and inner.weight.tolist() == [1.0, 1.0]
    assert inner.running_var.tolist() == [1.0, 1.0]
    assert param.tolist() == [1.0, 1.0]
    assert after.weight.device.type == "meta"
    assert after.running_var.device.type == ("meta" if outer_buffers else "cpu")


def test_empty_weights_context_does_not_leak_into_other_threads():
    built, entered, done = {}, threading.Event(), threading.Event()

    def other():
        entered.wait(5)
        built["other"] = nn.Linear(2, 2)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with init_empty_weights():
        entered.set()
        done.wait(5)
        built["inside"] = nn.Linear(2, 2)
    thread.join()
    assert built["other"].weight.device.type == "cpu"
    assert built["inside"].weight.device.type == "meta"


def test_incomplete_weights_map_is_refused_before_the_weights_are_replaced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    x = torch.randn(1, 3)
    expected = model(x)
    partial = {"0.weight": model[0].weight.detach().clone()}
    with pytest.raises(ValueError, match=r"weights_map has no value for 1 tensor\(s\) of Linear '0': \['bias'\]"):
        attach_align_device_hook(model, "cpu", offload=True, weights_map=partial)
    remove_hook_from_submodules(model)
    assert model[0].bias.device.type == "cpu"
    assert torch.equal(model(x), expected)
