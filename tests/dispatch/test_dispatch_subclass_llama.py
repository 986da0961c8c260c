"""A tiny transformers Llama quantized with torchao, dispatched with layers in RAM and on disk.

Its ``nn.Linear`` weights are torchao ``Int8Tensor`` subclasses.  Planned, dispatched, and loaded
from a checkpoint of the quantized model (``torch.save`` of its state dict, read back with
``weights_only=True``) into a model built on ``meta`` and quantized there: the logits are
bit-identical to the quantized model run in memory without hooks.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
torchao_quantization = pytest.importorskip("torchao.quantization")

from bigmodel import dispatch_model, infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402
from bigmodel.utils import compute_module_sizes  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 3, 7, 11]])
NO_SPLIT = ["LlamaDecoderLayer"]


def _config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip


def quantized_llama(meta: bool = False):
    torch.manual_seed(0)
    if meta:
        with init_empty_weights():
            model = transformers.LlamaForCausalLM(_config())
    else:
        model = transformers.LlamaForCausalLM(_config())
    torchao_quantization.quantize_(model.eval(), torchao_quantization.Int8WeightOnlyConfig())
    return model


@pytest.fixture(scope="module")
def reference():
    model = quantized_llama()
    with torch.no_grad():
        return model, model(IDS).logits


def _plan(model) -> dict:
    """Embeddings and one layer in RAM, the rest on disk (budget in the quantized bytes; the planner keeps
    room for the largest layer besides)."""
    sizes = compute_module_sizes(model)
    cpu = sizes["model.embed_tokens"] + 2 * sizes["model.layers.0"] + sizes["lm_head"]
    device_map = infer_auto_device_map(model, max_memory={"cpu": cpu, "disk": 10**9}, no_split_module_classes=NO_SPLIT)
    assert device_map["model.layers.0"] == "cpu" and device_map["model.layers.3"] == "disk"
    return device_map


def test_layer_sizes_are_the_int8_bytes(reference):
    model, _ = reference
    sizes = compute_module_sizes(model)
    up = model.model.layers[0].mlp.up_proj.weight  # [64, 32] int8 + per-row float32 scale + int8 zero point
    assert sizes["model.layers.0.mlp.up_proj.weight"] == 64 * 32 + 64 * 4 + 64
    assert sizes["model.layers.0.mlp.up_proj.weight"] < up.numel() * up.element_size()


def test_dispatch_model_keeps_the_logits_bit_identical(reference, tmp_path):
    _, expected = reference
    model = quantized_llama()
    device_map = _plan(model)
    dispatch_model(model, device_map, main_device="cpu", offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["model.layers.3.mlp.up_proj.weight"]["subclass"]["class"] == "torchao.quantization:Int8Tensor"
    assert "subclass" not in index["model.layers.3.input_layernorm.weight"]  # plain tensors stay plain


def test_load_checkpoint_and_dispatch_a_quantized_checkpoint_into_a_meta_model(reference, tmp_path):
    source, expected = reference
    checkpoint = tmp_path / "pytorch_model.bin"
    torch.save(source.state_dict(), checkpoint)
    model = quantized_llama(meta=True)  # quantized on meta: the layout without any value
    device_map = _plan(model)
    model = load_checkpoint_and_dispatch(model, str(checkpoint), device_map=device_map,
                                         offload_folder=str(tmp_path / "offload"))
    assert type(model.model.layers[0].mlp.up_proj.weight) is torchao_quantization.Int8Tensor  # in RAM, as loaded
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)


def test_a_user_file_named_like_a_part_in_the_checkpoint_folder_is_never_overwritten(reference, tmp_path):
    source, expected = reference
    checkpoint = tmp_path / "pytorch_model.bin"
    torch.save(source.state_dict(), checkpoint)
    stray = tmp_path / "model.layers.3.mlp.up_proj.weight#qdata.dat"  # what the offload would write for that part
    stray.write_bytes(b"the user's own bytes")
    with pytest.raises(ValueError, match=r"'model\.layers\.3\.mlp\.up_proj\.weight#qdata\.dat' already exists .*"
                                         r"never overwrites a file it did not write; pass another offload_folder"):
        load_checkpoint_and_dispatch(quantized_llama(meta=True), str(checkpoint), device_map=_plan(quantized_llama(meta=True)),
                                     offload_folder=str(tmp_path))
    assert stray.read_bytes() == b"the user's own bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [stray.name, "pytorch_model.bin"]  # nothing written
    stray.unlink()
    for _ in range(2):  # the second time the folder holds the offload's own part files: they are rewritten
        model = quantized_llama(meta=True)
        model = load_checkpoint_and_dispatch(model, str(checkpoint), device_map=_plan(model), offload_folder=str(tmp_path))
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, expected)
    assert stray.is_file()  # written by the offload this time
