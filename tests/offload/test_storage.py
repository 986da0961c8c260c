import json
import os

import pytest
import torch
from safetensors.torch import save_file

from bigmodel import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
)
from bigmodel.offload.storage import OffloadWriter, save_offload_index

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.bool]


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_offload_weight_round_trips_bit_exactly(tmp_path, dtype):
    weight = (torch.randn(5, 7) * 3).to(dtype)
    index = offload_weight(weight, "layer.weight", tmp_path)
    assert index == {"layer.weight": {"dtype": str(dtype).removeprefix("torch."), "shape": [5, 7]}}
    assert (tmp_path / "layer.weight.dat").stat().st_size == weight.numel() * dtype.itemsize
    back = load_offloaded_weight(tmp_path / "layer.weight.dat", index["layer.weight"])
    assert back.dtype == dtype and back.shape == weight.shape and torch.equal(_bits(back), _bits(weight))


def test_offload_weight_scalars_empty_and_noncontiguous(tmp_path):
    index = offload_weight(torch.tensor(1.5), "s", tmp_path)
    index = offload_weight(torch.zeros(0, 4), "e", tmp_path, index)
    t = torch.arange(12.0).reshape(3, 4).t()
    index = offload_weight(t, "t", tmp_path, index)
    assert load_offloaded_weight(tmp_path / "s.dat", index["s"]).item() == 1.5
    assert load_offloaded_weight(tmp_path / "e.dat", index["e"]).shape == (0, 4)
    assert torch.equal(load_offloaded_weight(tmp_path / "t.dat", index["t"]), t)


def test_load_offloaded_weight_is_a_private_memory_map(tmp_path):
    index = offload_weight(torch.ones(4), "w", tmp_path)
    back = load_offloaded_weight(tmp_path / "w.dat", index["w"])
    assert back.untyped_storage().nbytes() == 16
    back.mul_(5)
    assert torch.equal(load_offloaded_weight(tmp_path / "w.dat", index["w"]), torch.ones(4))


def test_load_offloaded_weight_bad_entries(tmp_path):
    index = offload_weight(torch.ones(4), "w", tmp_path)
    with pytest.raises(ValueError, match=r"w\.dat.*holds 16 bytes.*needs 32"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": [8]})
    with pytest.raises(ValueError, match="'floaty' is not a torch dtype"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "floaty", "shape": [4]})
    with pytest.raises(FileNotFoundError, match=r"x\.dat.*missing"):
        load_offloaded_weight(tmp_path / "x.dat", index["w"])


def test_offload_state_dict_merges_index(tmp_path):
    offload_state_dict(tmp_path, {"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.bfloat16)})
    offload_state_dict(tmp_path, {"c": torch.arange(4)})
    index = json.loads((tmp_path / "index.json").read_text())
    assert sorted(index) == ["a", "b", "c"] and index["b"] == {"dtype": "bfloat16", "shape": [3]}
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_writer_abort_leaves_previous_index(tmp_path):
    offload_state_dict(tmp_path, {"a": torch.ones(2)})
    before = (tmp_path / "index.json").read_bytes()
    writer = OffloadWriter(tmp_path)
    writer.write("a", torch.full((2,), 7.0))
    writer.write("b", torch.ones(3))
    writer.abort()
    assert (tmp_path / "index.json").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.dat", "index.json"]
    assert torch.equal(OffloadedWeightsLoader(save_folder=tmp_path)["a"], torch.ones(2))


def test_writer_refuses_unwritable_folder(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    try:
        if os.access(target, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(PermissionError, match=r"Offload folder .*ro' is not writable.*offload_folder"):
            OffloadWriter(target)
    finally:
        target.chmod(0o700)


def test_loader_reads_both_entry_kinds_zero_copy(tmp_path):
    st = tmp_path / "ckpt.safetensors"
    save_file({"x": torch.randn(3, 3).to(torch.bfloat16)}, st)
    folder = tmp_path / "off"
    index = offload_weight(torch.arange(6).reshape(2, 3), "y", folder)
    index["x"] = {"safetensors_file": str(st), "weight_name": "x", "dtype": "bfloat16"}
    index["x16"] = {"safetensors_file": str(st), "weight_name": "x", "dtype": "float16"}
    save_offload_index(index, folder)
    loader = OffloadedWeightsLoader(state_dict={"mem": torch.ones(1)}, save_folder=folder)
    assert sorted(loader) == ["mem", "x", "x16", "y"] and len(loader) == 4 and "x" in loader
    from safetensors.torch import load_file

    ref = load_file(st)["x"]
    assert torch.equal(loader["x"], ref)
    assert loader["x"].untyped_storage().nbytes() == st.stat().st_size  # a view of the mapped file
    assert loader["x16"].dtype == torch.float16 and torch.equal(loader["x16"], ref.to(torch.float16))
    assert torch.equal(loader["y"], torch.arange(6).reshape(2, 3))
    assert torch.equal(loader["mem"], torch.ones(1))
    with pytest.raises(KeyError):
        loader["nope"]


def test_loader_device_and_index_without_folder(tmp_path):
    st = tmp_path / "ckpt.safetensors"
    save_file({"x": torch.ones(2)}, st)
    loader = OffloadedWeightsLoader(index={"x": {"safetensors_file": str(st), "weight_name": "x", "dtype": "float32"}}, device="meta")
    assert loader["x"].device.type == "meta"
    with pytest.raises(ValueError, match="pass save_folder="):
        OffloadedWeightsLoader(index={"y": {"dtype": "float32", "shape": [2]}})


def test_prefixed_dataset_and_extract():
    weights = {"layers.0.w": 1, "layers.0.b": 2, "layers.1.w": 3, "layers.10.w": 4}
    view = PrefixedDataset(weights, "layers.1.")
    assert view["w"] == 3 and "w" in view and "b" not in view
    assert list(view) == ["layers.1.w"] and len(view) == 1  # the dataset's names, as accelerate iterates them
    assert extract_submodules_state_dict(weights, ["layers.1"]) == {"layers.1.w": 3}
    assert extract_submodules_state_dict(weights, ["layers.0", "layers.10"]) == {
        "layers.0.w": 1,
        "layers.0.b": 2,
        "layers.10.w": 4,
    }


def test_extracted_entries_come_grouped_by_submodule_name_as_in_accelerate():
    """accelerate 1.15 takes each name's entries in turn: a caller iterating the result sees the names' order."""
    weights = {"a.b.w": 1, "a.bc.w": 2, "a.b": 3, "c.w": 4, "a.b.c.d": 5, "d.w": 6}
    names = ["c", "a.b", "a.b.c"]
    extracted = extract_submodules_state_dict(weights, names)
    assert list(extracted.items()) == [("c.w", 4), ("a.b.w", 1), ("a.b", 3), ("a.b.c.d", 5)]
    assert list(extract_submodules_state_dict(weights, [""])) == list(weights)  # "" is the whole model
    accelerate_offload = pytest.importorskip("accelerate.utils.offload")
    assert list(extracted.items()) == list(accelerate_offload.extract_submodules_state_dict(weights, names).items())


def test_extracted_entries_match_accelerate_on_any_names():
    """Random dotted names and submodule names (prefix look-alikes: "1" and "10", "a" and "ab")."""
    accelerate_offload = pytest.importorskip("accelerate.utils.offload")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    name = st.lists(st.sampled_from(["a", "ab", "b", "0", "1", "10"]), min_size=1, max_size=4).map(".".join)

    @settings(max_examples=300, deadline=None)
    @given(keys=st.lists(name, max_size=8, unique=True), names=st.lists(name, max_size=4))
    def check(keys, names):
        state = {key: index for index, key in enumerate(keys)}
        ours = extract_submodules_state_dict(state, names)
        assert list(ours.items()) == list(accelerate_offload.extract_submodules_state_dict(state, names).items())

    check()


def test_offload_weight_without_an_index_returns_a_new_one(tmp_path):
    """README (session 10): accelerate 1.15 returns None here; the entry is written either way."""
    index = offload_weight(torch.ones(2, 3, dtype=torch.bfloat16), "w", tmp_path)
    assert index == {"w": {"dtype": "bfloat16", "shape": [2, 3]}}
    assert offload_weight(torch.zeros(4), "v", tmp_path, index) is index and list(index) == ["w", "v"]
    assert torch.equal(load_offloaded_weight(str(tmp_path / "w.dat"), index["w"]), torch.ones(2, 3, dtype=torch.bfloat16))


def test_writer_refuses_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(PermissionError, match=r"Offload folder .*a_file/off' is not writable"):
        OffloadWriter(tmp_path / "a_file" / "off")


def _mappings_of(path) -> int:
    """How many memory maps of ``path`` this process holds (Linux /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(str(path)))


linux_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")


@linux_maps
def test_loader_maps_each_file_once_and_releases_it_when_collected(tmp_path):
    import gc

    st = tmp_path / "ckpt.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(64)}, st)
    folder = tmp_path / "off"
    index = offload_weight(torch.randn(128, 64), "w", folder)
    index.update({name: {"safetensors_file": str(st), "weight_name": name, "dtype": "float32"} for name in "ab"})
    save_offload_index(index, folder)
    dat = (folder / "w.dat").resolve()
    loader = OffloadedWeightsLoader(save_folder=folder)
    first = [loader[name] for name in ("w", "a", "b")]
    again = [loader[name] for name in ("w", "a", "b")]
    assert _mappings_of(dat) == 1 and _mappings_of(st.resolve()) == 1
    for x, y in zip(first, again):
        assert x is not y and x.data_ptr() == y.data_ptr()  # new views of one mapping
    again[0].resize_(3)  # a caller changing its view's metadata does not change the cached view
    assert loader["w"].shape == (128, 64)
    gc.collect()
    gc.disable()
    try:
        del loader, first, again, x, y
        assert _mappings_of(dat) == 0 and _mappings_of(st.resolve()) == 0  # no reference cycle keeps them
    finally:
        gc.enable()


def test_loader_does_not_keep_cast_copies(tmp_path):
    st = tmp_path / "ckpt.safetensors"
    save_file({"x": torch.randn(8, 8)}, st)
    index = {"x16": {"safetensors_file": str(st), "weight_name": "x", "dtype": "float16"}}
    loader = OffloadedWeightsLoader(index=index)
    one, two = loader["x16"], loader["x16"]
    assert one.dtype == torch.float16 and torch.equal(one, two)
    assert one.data_ptr() != two.data_ptr() and not loader._mapped  # a copy per read, none held in RAM


@linux_maps
def test_loader_concurrent_reads_map_once(tmp_path):
    import threading

    values = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}
    offload_state_dict(tmp_path, values)
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    start = threading.Barrier(4)
    errors: list = []

    def read() -> None:
        start.wait()
        for _ in range(20):
            for name, expected in values.items():
                if not torch.equal(loader[name], expected):
                    errors.append(name)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [_mappings_of((tmp_path / f"{name}.dat").resolve()) for name in values] == [1] * 8
