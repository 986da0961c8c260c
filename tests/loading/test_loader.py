import json
import logging
import os
import sys
import types

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    OffloadedWeightsLoader,
    init_empty_weights,
    load_checkpoint_in_model,
)
from bigmodel.offload.storage import OffloadWriter

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
FORMATS = ["safetensors", "sharded", "bin", "sharded_bin", "folder"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("steps", torch.tensor([3, 4]))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


MIXED_MAP = {"embed": "cpu", "blocks.0": "disk", "blocks.1": "cpu", "head": "cpu"}


def _state(dtype=torch.float32, with_head=False):
    torch.manual_seed(0)
    sd = {k: v.clone() for k, v in Net().state_dict().items()}
    if not with_head:
        del sd["head.weight"]  # the usual layout for a tied head
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def _save(folder, sd, fmt):
    """Write ``sd`` in format ``fmt``; return the checkpoint path to pass to the loader."""
    folder.mkdir(exist_ok=True)
    if fmt in ("safetensors", "folder"):
        save_file(sd, folder / "model.safetensors")
        return folder if fmt == "folder" else folder / "model.safetensors"
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
        return folder / "pytorch_model.bin"
    ext = "safetensors" if fmt == "sharded" else "bin"
    weight_map = {}
    for i, prefix in enumerate(["embed", "blocks.0", "blocks.1"]):
        part = {k: v for k, v in sd.items() if k.startswith(prefix)}
        name = f"model-{i + 1:05d}-of-00003.{ext}"
        save_file(part, folder / name) if ext == "safetensors" else torch.save(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / f"model.{ext}.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder / f"model.{ext}.index.json"


def _meta_net(dtype=None):
    with init_empty_weights():
        net = Net()
    return net.to(dtype) if dtype is not None else net  # floating tensors only, on meta


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def _all_meta(model):
    return all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_mixed_cpu_and_disk(tmp_path, fmt, dtype):
    sd = _state(dtype)
    ckpt = _save(tmp_path / "ckpt", sd, fmt)
    model = _meta_net(dtype)  # built in the checkpoint's dtype, as from_config(torch_dtype=...) does
    load_checkpoint_in_model(model, ckpt, device_map=MIXED_MAP, offload_folder=tmp_path / "off")
    assert model.head.weight is model.embed.weight  # still tied
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    assert sorted(loader) == sorted(k for k in sd if k.startswith("blocks.0") and "steps" not in k)
    assert model.blocks[0].steps.device.type == "cpu"  # buffers go to CPU unless offload_buffers=True
    for name, value in sd.items():
        got = loader[name] if name in loader else model.state_dict()[name]
        assert got.dtype == value.dtype and torch.equal(_bits(got), _bits(value)), name
    assert model.blocks[0].linear.weight.device.type == "meta"
    dat = sorted(p for p in os.listdir(tmp_path / "off") if p.endswith(".dat"))
    if fmt in ("safetensors", "sharded", "folder"):
        assert dat == []  # disk tensors point into the checkpoint; nothing rewritten
        assert all("safetensors_file" in e for e in loader.index.values())
    else:
        assert dat == sorted(f"{k}.dat" for k in loader.index)


def test_cpu_tensors_are_used_in_place(tmp_path):
    path = _save(tmp_path / "ckpt", _state(), "safetensors")
    model = _meta_net()
    load_checkpoint_in_model(model, path, device_map={"": "cpu"})
    storage = model.blocks[1].linear.weight.untyped_storage()
    assert storage.nbytes() == path.stat().st_size  # a view of the mapped file, not a copy
    assert model.embed.weight.untyped_storage().data_ptr() == storage.data_ptr()


def test_all_disk_tied_weights_share_one_entry(tmp_path):
    sd = _state()
    path = _save(tmp_path / "ckpt", sd, "safetensors")
    model = _meta_net()
    load_checkpoint_in_model(model, path, device_map={"": "disk"}, offload_folder=tmp_path / "off", offload_buffers=True)
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert index["head.weight"]["weight_name"] == "embed.weight"
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "meta"
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    assert torch.equal(loader["head.weight"], sd["embed.weight"])
    assert os.listdir(tmp_path / "off") == ["index.json"]


def test_all_disk_tied_weights_from_bin_are_duplicated(tmp_path):
    sd = _state()
    path = _save(tmp_path / "ckpt", sd, "bin")
    load_checkpoint_in_model(_meta_net(), path, device_map={"": "disk"}, offload_folder=tmp_path / "off")
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    assert torch.equal(loader["head.weight"], sd["embed.weight"])
    assert "blocks.0.steps" not in loader  # buffers go to CPU unless offload_buffers=True


def test_dtype_casts_floats_only_and_keeps_fp32_modules(tmp_path):
    sd = _state()
    path = _save(tmp_path / "ckpt", sd, "safetensors")
    model = _meta_net()
    load_checkpoint_in_model(
        model, path, device_map=MIXED_MAP, offload_folder=tmp_path / "off", dtype="float16", keep_in_fp32_modules=["norm"]
    )
    assert model.blocks[1].linear.weight.dtype == torch.float16
    assert torch.equal(model.blocks[1].linear.weight, sd["blocks.1.linear.weight"].half())
    assert model.blocks[1].norm.weight.dtype == torch.float32
    assert model.blocks[1].steps.dtype == torch.int64
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    assert loader["blocks.0.linear.weight"].dtype == torch.float16
    assert loader["blocks.0.norm.weight"].dtype == torch.float32
    assert "safetensors_file" in loader.index["blocks.0.norm.weight"]  # unchanged dtype: a pointer
    assert (tmp_path / "off" / "blocks.0.linear.weight.dat").is_file()  # cast: a .dat file


def test_without_device_map_model_dtype_wins(tmp_path):
    path = _save(tmp_path / "ckpt", _state(), "safetensors")
    with init_empty_weights():
        model = Net().to(torch.bfloat16)
    load_checkpoint_in_model(model, path)
    assert model.blocks[0].linear.weight.dtype == torch.bfloat16 and model.blocks[0].steps.dtype == torch.int64
    assert torch.equal(model.embed.weight, _state()["embed.weight"].to(torch.bfloat16))
    assert model.head.weight is model.embed.weight
    load_checkpoint_in_model(model, path, dtype=torch.float16)
    assert model.blocks[0].linear.weight.dtype == torch.float16


def test_offload_state_dict_spills_and_brings_back(tmp_path):
    sd = _state()
    path = _save(tmp_path / "ckpt", sd, "bin")
    model = _meta_net()
    load_checkpoint_in_model(model, path, device_map={"": "cpu"}, dtype=torch.bfloat16, offload_state_dict=True)
    assert model.blocks[1].linear.weight.dtype == torch.bfloat16
    assert torch.equal(model.blocks[1].linear.weight, sd["blocks.1.linear.weight"].bfloat16())
    assert model.head.weight is model.embed.weight


def test_strict_lists_every_missing_and_unexpected_key(tmp_path):
    sd = _state()
    del sd["blocks.1.linear.bias"]
    sd.update({f"extra.{i:02d}": torch.ones(1) for i in range(25)})
    path = _save(tmp_path / "ckpt", sd, "safetensors")
    model = _meta_net()
    with pytest.raises(ValueError, match=r"missing keys \(1\): blocks\.1\.linear\.bias; unexpected keys \(25\): "
                       r"extra\.00, extra\.01, .*extra\.19 \.\.\. and 5 more"):  # fmt: skip
        load_checkpoint_in_model(model, path, device_map={"": "cpu"}, strict=True)
    assert _all_meta(model)
    with pytest.raises(ValueError, match="missing keys"):
        load_checkpoint_in_model(model, path, strict=True)


def test_not_strict_logs_and_loads_the_rest(tmp_path, caplog):
    sd = _state()
    del sd["blocks.1.linear.bias"]
    sd["extra"] = torch.ones(1)
    path = _save(tmp_path / "ckpt", sd, "safetensors")
    model = _meta_net()
    with caplog.at_level(logging.WARNING, logger="bigmodel"):
        load_checkpoint_in_model(model, path, device_map={"": "cpu"})
    assert "missing keys (1): blocks.1.linear.bias" in caplog.text and "unexpected keys (1): extra" in caplog.text
    assert torch.equal(model.blocks[1].linear.weight, sd["blocks.1.linear.weight"])
    assert model.blocks[1].linear.bias.device.type == "meta"


def test_shape_mismatch_raises_before_anything_is_placed(tmp_path):
    sd = _state()
    sd["blocks.1.linear.weight"] = torch.zeros(6, 7)
    path = _save(tmp_path / "ckpt", sd, "safetensors")
    model = _meta_net()
    with pytest.raises(ValueError, match=r"'blocks\.1\.linear\.weight': checkpoint \[6, 7\] vs model \[6, 6\]"):
        load_checkpoint_in_model(model, path, device_map=MIXED_MAP, offload_folder=tmp_path / "off")
    assert _all_meta(model)
    assert not (tmp_path / "off" / "index.json").exists()


def test_disk_without_offload_folder(tmp_path):
    path = _save(tmp_path / "ckpt", _state(), "safetensors")
    model = _meta_net()
    with pytest.raises(ValueError, match=r"on 'disk'.*blocks\.0\.linear\.weight.*pass offload_folder="):
        load_checkpoint_in_model(model, path, device_map=MIXED_MAP)
    assert _all_meta(model)


def test_unwritable_offload_folder(tmp_path):
    path = _save(tmp_path / "ckpt", _state(), "safetensors")
    (tmp_path / "file").write_text("x")
    model = _meta_net()
    with pytest.raises(PermissionError, match=r"'.*file/off' is not writable"):
        load_checkpoint_in_model(model, path, device_map=MIXED_MAP, offload_folder=tmp_path / "file" / "off")
    assert _all_meta(model)


def test_offload_folder_may_be_the_checkpoint_folder_and_only_gains_files(tmp_path):
    path = _save(tmp_path / "ckpt", _state(), "bin")
    before = path.read_bytes()
    load_checkpoint_in_model(_meta_net(), path, device_map=MIXED_MAP, offload_folder=tmp_path / "ckpt")
    assert path.read_bytes() == before
    assert "index.json" in os.listdir(tmp_path / "ckpt") and "blocks.0.linear.weight.dat" in os.listdir(tmp_path / "ckpt")


def test_existing_index_is_merged(tmp_path):
    OffloadWriter(tmp_path / "off").commit()
    from bigmodel import offload_state_dict

    offload_state_dict(tmp_path / "off", {"other": torch.ones(2)})
    path = _save(tmp_path / "ckpt", _state(), "bin")
    load_checkpoint_in_model(_meta_net(), path, device_map=MIXED_MAP, offload_folder=tmp_path / "off")
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert "other" in index and "blocks.0.linear.weight" in index


def test_failure_while_writing_leaves_previous_index(tmp_path, monkeypatch):
    from bigmodel import offload_state_dict

    offload_state_dict(tmp_path / "off", {"blocks.0.linear.weight": torch.ones(6, 6)})
    before = (tmp_path / "off" / "index.json").read_bytes()
    path = _save(tmp_path / "ckpt", _state(), "bin")
    ckpt_bytes = path.read_bytes()
    calls = []
    real_write = OffloadWriter.write

    def write_then_fill_disk(self, name, tensor):
        calls.append(name)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        real_write(self, name, tensor)

    monkeypatch.setattr(OffloadWriter, "write", write_then_fill_disk)
    with pytest.raises(OSError, match="No space left"):
        load_checkpoint_in_model(_meta_net(), path, device_map=MIXED_MAP, offload_folder=tmp_path / "off")
    assert (tmp_path / "off" / "index.json").read_bytes() == before
    assert sorted(os.listdir(tmp_path / "off")) == ["blocks.0.linear.weight.dat", "index.json"]
    assert torch.equal(OffloadedWeightsLoader(save_folder=tmp_path / "off")["blocks.0.linear.weight"], torch.ones(6, 6))
    assert path.read_bytes() == ckpt_bytes


def test_truncated_shard_places_nothing(tmp_path):
    path = _save(tmp_path / "ckpt", _state(), "sharded")
    shard = tmp_path / "ckpt" / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    model = _meta_net()
    with pytest.raises(ValueError, match=r"model-00003-of-00003\.safetensors.*truncated"):
        load_checkpoint_in_model(model, path, device_map=MIXED_MAP, offload_folder=tmp_path / "off")
    assert _all_meta(model) and not (tmp_path / "off" / "index.json").exists()


def test_broadcast_from_rank0_hands_off(tmp_path, monkeypatch):
    seen = {}
    fake = types.ModuleType("bigmodel.loading.distributed")
    fake.load_checkpoint_broadcast = lambda model, checkpoint, **kw: seen.update(kw, checkpoint=checkpoint)
    monkeypatch.setitem(sys.modules, "bigmodel.loading.distributed", fake)
    load_checkpoint_in_model(_meta_net(), "ckpt", device_map={"": "cpu"}, dtype=torch.float16, broadcast_from_rank0=True)
    assert seen == {
        "checkpoint": "ckpt",
        "device_map": {"": "cpu"},
        "dtype": torch.float16,
        "keep_in_fp32_modules": None,
        "strict": False,
        "full_state_dict": True,
    }


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_tiny_llama_round_trip(tmp_path, fmt):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    if fmt == "sharded":
        ref.save_pretrained(tmp_path / "ckpt", max_shard_size="8KB")  # drops the tied lm_head.weight
        assert len([f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".safetensors")]) > 1
    else:
        (tmp_path / "ckpt").mkdir()
        torch.save(ref.state_dict(), tmp_path / "ckpt" / "pytorch_model.bin")  # both tied names, one storage
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    load_checkpoint_in_model(model, tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "off", strict=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    for name, value in ref.state_dict().items():
        got = loader[name] if name.startswith("model.layers.0.") else model.state_dict()[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, value), name
    dat = [p for p in os.listdir(tmp_path / "off") if p.endswith(".dat")]
    assert (dat == []) == (fmt == "sharded")


def test_bad_dtype_and_device_raise_before_loading(tmp_path):
    path = _save(tmp_path / "ckpt", _state(), "safetensors")
    model = _meta_net()
    with pytest.raises(ValueError, match="dtype='int8' is not a floating torch dtype"):
        load_checkpoint_in_model(model, path, device_map={"": "cpu"}, dtype="int8")
    with pytest.raises(ValueError, match="is not a device spec"):
        load_checkpoint_in_model(model, path, device_map={"": "cpu", "blocks.1": "gpu!"})
    with pytest.raises(KeyError, match=r"does not cover 2 parameters/buffers of Net: embed\.weight, head\.weight"):
        load_checkpoint_in_model(model, path, device_map={"blocks": "cpu"})
    assert _all_meta(model)


def test_a_module_missing_from_the_map_is_a_value_error_naming_every_tensor(tmp_path):
    """accelerate raises ValueError for a tensor without a device; code catches that (found by a
    fresh-clone trial: bigmodel raised a bare KeyError naming one tensor)."""
    path = _save(tmp_path / "ckpt", _state(), "safetensors")
    model = _meta_net()
    uncovered = sorted(name for name in model.state_dict() if not name.startswith("blocks."))
    assert uncovered  # the map below leaves them out
    with pytest.raises(ValueError) as caught:
        load_checkpoint_in_model(model, path, device_map={"blocks": "cpu"})
    assert isinstance(caught.value, KeyError)  # what it raised before, still caught as such
    message = str(caught.value)
    assert f"does not cover {len(uncovered)} parameters/buffers of {type(model).__name__}" in message
    assert all(name in message for name in uncovered) and "Add them" in message
    assert _all_meta(model)


def test_progress_is_quiet_when_disabled_or_not_a_tty(monkeypatch, capsys):
    from bigmodel.core import progress as _progress

    monkeypatch.setenv(_progress.DISABLE_ENV, "1")
    assert not _progress.progress_enabled()
    monkeypatch.delenv(_progress.DISABLE_ENV)
    assert not _progress.progress_enabled()  # pytest captures stderr: not a TTY
    with _progress.ByteProgress(100, "Loading") as bar:
        bar.update(60)
        bar.update(40)
    assert bar.done == 100 and capsys.readouterr().err == ""


def test_memory_tensors_take_the_model_dtype_disk_keeps_the_checkpoint(tmp_path):
    """As with set_module_tensor_to_device: a float16 checkpoint in a float32 model loads as float32
    in memory; disk entries keep float16 and point into the safetensors file (cast at forward time)."""
    sd = _state(torch.float16)
    ckpt = _save(tmp_path / "ckpt", sd, "safetensors")
    model = _meta_net()
    load_checkpoint_in_model(model, ckpt, device_map=MIXED_MAP, offload_folder=tmp_path / "off")
    assert model.embed.weight.dtype == torch.float32
    assert torch.equal(model.embed.weight, sd["embed.weight"].float())
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off")
    assert loader["blocks.0.linear.weight"].dtype == torch.float16
    assert all("safetensors_file" in e for e in loader.index.values())


def test_keep_in_fp32_names_match_whole_segments_unlike_accelerate(tmp_path):
    """README: ``["norm"]`` keeps ``norm`` float32, not ``input_norm``; accelerate 1.15 keeps both."""
    model = nn.ModuleDict({"norm": nn.LayerNorm(2), "input_norm": nn.LayerNorm(2), "proj": nn.Linear(2, 2)})
    save_file({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")

    def dtypes(load):
        fresh = nn.ModuleDict({"norm": nn.LayerNorm(2), "input_norm": nn.LayerNorm(2), "proj": nn.Linear(2, 2)})
        load(fresh, str(tmp_path / "model.safetensors"), device_map={"": "cpu"}, dtype=torch.float16,
             keep_in_fp32_modules=["norm"])  # fmt: skip
        return {name: p.dtype for name, p in fresh.named_parameters() if name.endswith("weight")}

    ours = dtypes(load_checkpoint_in_model)
    assert ours == {"norm.weight": torch.float32, "input_norm.weight": torch.float16, "proj.weight": torch.float16}
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    theirs = dtypes(accelerate_modeling.load_checkpoint_in_model)
    assert theirs == {**ours, "input_norm.weight": torch.float32}
