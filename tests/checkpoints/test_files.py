import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from bigmodel import load_state_dict
from bigmodel.checkpoints.files import (
    SafetensorsFile,
    iter_checkpoint_tensors,
    read_tensor_infos,
    resolve_checkpoint_files,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool]


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g).to(dtype),
        "a.bias": torch.randn(3, generator=g).to(dtype),
        "steps": torch.tensor([1, 2, 3]),
    }


def _sharded(folder, tensors, names=("a.weight",)):
    """Two safetensors shards and an index: ``names`` in shard 1, the rest in shard 2."""
    first = {k: v for k, v in tensors.items() if k in names}
    second = {k: v for k, v in tensors.items() if k not in names}
    save_file(first, folder / "model-00001-of-00002.safetensors")
    save_file(second, folder / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _write_index(folder, weight_map):
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


# ---------------------------------------------------------------- resolution


def test_resolve_single_files(tmp_path):
    save_file(_tensors(), tmp_path / "model.safetensors")
    torch.save(_tensors(), tmp_path / "weights.pt")
    assert resolve_checkpoint_files(tmp_path / "model.safetensors") == [(tmp_path / "model.safetensors").resolve()]
    assert resolve_checkpoint_files(tmp_path / "weights.pt") == [(tmp_path / "weights.pt").resolve()]


def test_resolve_folder_prefers_safetensors(tmp_path):
    save_file(_tensors(), tmp_path / "model.safetensors")
    torch.save(_tensors(), tmp_path / "pytorch_model.bin")
    assert [p.name for p in resolve_checkpoint_files(tmp_path)] == ["model.safetensors"]


def test_resolve_folder_with_index_lists_shards_in_order(tmp_path):
    _sharded(tmp_path, _tensors())
    names = [p.name for p in resolve_checkpoint_files(tmp_path)]
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_resolve_folder_with_bin_only(tmp_path):
    torch.save(_tensors(), tmp_path / "pytorch_model.bin")
    assert [p.name for p in resolve_checkpoint_files(tmp_path)] == ["pytorch_model.bin"]


def test_resolve_empty_folder_names_what_was_found(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds no weights.*config\.json"):
        resolve_checkpoint_files(tmp_path)


def test_resolve_folder_with_several_candidates(tmp_path):
    save_file(_tensors(), tmp_path / "a.safetensors")
    save_file(_tensors(), tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match=r"several candidate.*a\.safetensors.*b\.safetensors"):
        resolve_checkpoint_files(tmp_path)


def test_resolve_folder_prefers_standard_names(tmp_path):
    torch.save(_tensors(), tmp_path / "pytorch_model.bin")
    torch.save({"lr": torch.ones(1)}, tmp_path / "training_args.bin")
    torch.save({"state": torch.ones(1)}, tmp_path / "optimizer.pt")
    assert [p.name for p in resolve_checkpoint_files(tmp_path)] == ["pytorch_model.bin"]


def test_resolve_missing_and_unknown(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint_files(tmp_path / "nope.safetensors")
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"unknown type.*\.safetensors"):
        resolve_checkpoint_files(tmp_path / "weights.npz")


@pytest.mark.parametrize("shard", ["../x.safetensors", "sub/../../x.safetensors", "/etc/x.safetensors"])
def test_index_refuses_paths_leaving_the_folder(tmp_path, shard):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(_tensors(), tmp_path / "x.safetensors")
    index = _write_index(folder, {"a.weight": shard})
    with pytest.raises(ValueError, match=r"entry 'a\.weight'.*outside the checkpoint folder"):
        resolve_checkpoint_files(index)


def test_index_refuses_symlink_leaving_the_folder(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(_tensors(), tmp_path / "x.safetensors")
    os.symlink(tmp_path / "x.safetensors", folder / "link.safetensors")
    index = _write_index(folder, {"a.weight": "link.safetensors"})
    with pytest.raises(ValueError, match=r"entry 'a\.weight'.*resolves outside"):
        resolve_checkpoint_files(index)


def test_index_names_missing_shard(tmp_path):
    index = _write_index(tmp_path, {"a.weight": "model-00009.safetensors"})
    with pytest.raises(FileNotFoundError, match=r"shard 'model-00009\.safetensors' \(for 'a\.weight'\) is missing"):
        resolve_checkpoint_files(index)


def test_index_that_is_not_an_index(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="weight_map"):
        resolve_checkpoint_files(index)


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_safetensors_views_are_bit_exact(tmp_path, dtype):
    tensors = {"x": torch.randn(4, 6).to(dtype), "scalar": torch.tensor(2.5).to(dtype), "empty": torch.zeros(0, 3)}
    save_file(tensors, tmp_path / "m.safetensors")
    loaded = dict(iter_checkpoint_tensors([tmp_path / "m.safetensors"]))
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8))


def test_safetensors_tensors_are_views_of_one_mapping(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), path)
    handle = SafetensorsFile(path)
    a, b = handle.tensor("a.weight"), handle.tensor("a.bias")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == path.stat().st_size
    a.add_(1)  # private mapping: writes never reach the file
    assert torch.equal(SafetensorsFile(path).tensor("a.weight"), _tensors()["a.weight"])


def test_read_tensor_infos_from_headers(tmp_path):
    index = _sharded(tmp_path, _tensors(torch.bfloat16))
    infos = read_tensor_infos(resolve_checkpoint_files(index))
    assert infos["a.weight"].shape == (3, 5) and infos["a.weight"].dtype == torch.bfloat16
    assert infos["a.weight"].file.name == "model-00001-of-00002.safetensors"
    assert infos["steps"].dtype == torch.int64 and infos["steps"].is_safetensors


def test_truncated_safetensors_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a valid safetensors file.*truncated"):
        read_tensor_infos([path])


def test_corrupted_header_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    data = bytearray(path.read_bytes())
    data[10:14] = b"\xff\xfe{{"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a valid safetensors"):
        load_state_dict(path)


def test_torch_pickle_is_memory_mapped(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    torch.save(_tensors(torch.bfloat16), path)
    loaded = load_state_dict(path)
    assert all(torch.equal(loaded[k], v) for k, v in _tensors(torch.bfloat16).items())
    infos = read_tensor_infos([path])
    assert infos["a.bias"].shape == (3,) and not infos["a.bias"].is_safetensors


class _RunsCode:
    def __reduce__(self):
        return (print, ("this pickle runs code",))


def test_pickle_that_runs_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.bin"
    torch.save({"a": _RunsCode()}, path)
    with pytest.raises(pickle.UnpicklingError, match=r"Refusing to load .*evil\.bin.*could run code"):
        load_state_dict(path)
    assert "this pickle runs code" not in capsys.readouterr().out


def test_load_state_dict_device_map_keeps_disk_on_cpu(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    loaded = load_state_dict(path, device_map={"a": "disk", "steps": "cpu"})
    assert {t.device.type for t in loaded.values()} == {"cpu"}
    assert torch.equal(loaded["a.weight"], _tensors()["a.weight"])
    with pytest.raises(ValueError, match="use load_checkpoint_in_model"):
        load_state_dict(_sharded(tmp_path, _tensors()))


def test_legacy_pickle_and_pth(tmp_path):
    legacy = tmp_path / "old.pth"
    torch.save(_tensors(torch.float16), legacy, _use_new_zipfile_serialization=False)
    assert resolve_checkpoint_files(legacy) == [legacy.resolve()]
    loaded = dict(iter_checkpoint_tensors([legacy]))
    assert all(torch.equal(loaded[k], v) for k, v in _tensors(torch.float16).items())


def test_pickle_that_is_not_a_state_dict(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.ones(1)], path)
    with pytest.raises(ValueError, match=r"list\.pt.*holds a list, not a state dict"):
        load_state_dict(path)
    (tmp_path / "junk.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"junk\.bin.*not a readable torch checkpoint.*Unsupported operand"):
        load_state_dict(tmp_path / "junk.bin")


# ---------------------------------------------------------------- files other frameworks saved


@pytest.mark.parametrize(("fmt", "framework"), [("tf", "TensorFlow"), ("flax", "Flax")])
def test_safetensors_saved_by_another_framework_is_refused(tmp_path, fmt, framework):
    """accelerate 1.15 raises ValueError for such a file; bigmodel did load its tensors as PyTorch's."""
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path, metadata={"format": fmt})
    with pytest.raises(ValueError, match=rf"model\.safetensors.*saved by {framework}.*'{fmt}'"):
        load_state_dict(path)
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    with pytest.raises(ValueError):
        accelerate_modeling.load_state_dict(str(path))


def test_a_model_load_from_another_frameworks_file_changes_nothing(tmp_path):
    from torch import nn

    from bigmodel import load_checkpoint_in_model

    model = nn.Linear(5, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_file({"weight": torch.ones(3, 5), "bias": torch.ones(3)}, tmp_path / "model.safetensors",
              metadata={"format": "tf"})  # fmt: skip
    with pytest.raises(ValueError, match="saved by TensorFlow"):
        load_checkpoint_in_model(model, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"format": "mlx"}, {"note": "no format"}])
def test_safetensors_of_pytorch_or_unknown_format_load(tmp_path, metadata):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path, metadata=metadata)
    assert all(torch.equal(load_state_dict(path)[k], v) for k, v in _tensors().items())
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    if metadata is not None and metadata.get("format") != "pt":  # README (session 10): accelerate refuses these
        with pytest.raises(OSError):
            accelerate_modeling.load_state_dict(str(path))
