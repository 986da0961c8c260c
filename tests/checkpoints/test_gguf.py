"""GGUF checkpoints: names mapped by transformers' GGUF tables, dequantized tensor by tensor onto their devices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from _gguf_files import half_on_disk, set_tensor_type, tiny_llama, write_tiny_gguf

from bigmodel import (
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)


def empty_like(model):
    import transformers

    with init_empty_weights():
        empty = transformers.LlamaForCausalLM(model.config)
    empty.tie_weights()
    return empty.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_float32_gguf_loads_bit_exact_into_a_meta_model(
    tmp_path: Path, tie: bool
) -> None:
    reference = tiny_llama(tie=tie)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", reference)
    model = empty_like(reference)
    load_checkpoint_in_model(model, path, strict=True)
    loaded = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded[name], value), name
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1", "Q5_0", "BF16"])
def test_quantized_gguf_dequantizes_like_transformers(
    tmp_path: Path, quant: str
) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reference = tiny_llama()
    path = write_tiny_gguf(tmp_path / "q.gguf", reference, quant=quant)
    expected = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=empty_like(reference)
    )["tensors"]
    model = empty_like(reference)
    load_checkpoint_in_model(model, path)
    loaded = model.state_dict()
    assert set(expected) <= set(loaded)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    error = (
        loaded["model.layers.0.mlp.up_proj.weight"]
        - reference.state_dict()["model.layers.0.mlp.up_proj.weight"]
    )
    assert 0 < error.abs().max() < 0.1  # really quantized (BF16 included), and close


def test_gguf_dispatch_with_half_the_layers_on_disk(tmp_path: Path) -> None:
    reference = tiny_llama()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", reference, quant="Q8_0")
    whole = empty_like(reference)
    load_checkpoint_in_model(whole, path)
    model = load_checkpoint_and_dispatch(
        empty_like(reference),
        str(path),
        device_map=half_on_disk(reference.config.num_hidden_layers),
        offload_folder=tmp_path / "off",
    )
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, whole(ids).logits)
    written = {p.name for p in (tmp_path / "off").rglob("*.dat")}
    assert "model.layers.3.mlp.up_proj.weight.dat" in written
    assert not any(name.startswith("model.layers.0.") for name in written)


def _assert_refused(tmp_path: Path, path: Path, reference, *patterns: str) -> None:
    model = empty_like(reference)
    with pytest.raises(ValueError) as info:
        load_checkpoint_and_dispatch(
            model,
            str(path),
            device_map=half_on_disk(reference.config.num_hidden_layers),
            offload_folder=tmp_path / "o",
        )
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)
    assert not (tmp_path / "o").exists() or not any(
        (tmp_path / "o").iterdir()
    )  # nothing written
    assert all(
        p.device.type == "meta" for p in model.parameters()
    )  # the model untouched


def test_unknown_quantization_type_names_the_tensor(tmp_path: Path) -> None:
    reference = tiny_llama()
    path = write_tiny_gguf(tmp_path / "bad.gguf", reference, quant="Q8_0")
    set_tensor_type(path, "blk.2.ffn_up.weight", 200)
    _assert_refused(tmp_path, path, reference, "blk.2.ffn_up.weight", "200")


def test_truncated_tensor_names_the_tensor(tmp_path: Path) -> None:
    reference = tiny_llama()
    path = write_tiny_gguf(tmp_path / "full.gguf", reference, quant="Q8_0")
    last = gguf.GGUFReader(str(path)).tensors[-1].name
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-300])
    _assert_refused(tmp_path, tmp_path / "cut.gguf", reference, last, "truncated")


def test_tensor_matching_no_parameter_names_the_tensor(tmp_path: Path) -> None:
    reference = tiny_llama()
    extra = {"blk.1.mystery.weight": np.ones(32, dtype=np.float32)}
    path = write_tiny_gguf(tmp_path / "odd.gguf", reference, extra=extra)
    _assert_refused(tmp_path, path, reference, "blk.1.mystery.weight")


def test_wrong_shape_names_the_parameter(tmp_path: Path) -> None:
    reference = tiny_llama()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", reference)
    import transformers

    config = reference.config
    config.intermediate_size = 96
    with init_empty_weights():
        other = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        load_checkpoint_in_model(other, path)


def test_load_pretrained_accepts_a_gguf_file(tmp_path: Path) -> None:
    from bigmodel import load_pretrained

    reference = tiny_llama()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", reference)
    model = load_pretrained(
        path, max_memory={"cpu": 60_000}, offload_folder=tmp_path / "off"
    )
    assert "disk" in set(model.hf_device_map.values())
    ids = torch.tensor([[3, 5, 7, 11]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5
        )
