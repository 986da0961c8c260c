"""Quantized offload storage (offload_quantization=int8/int4/float8): stored small, dequantized where it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
pytest.importorskip("transformers")

from _gguf_files import half_on_disk, tiny_llama

from bigmodel import cpu_offload, disk_offload, dispatch_model, init_empty_weights
from bigmodel.offload.quantized import FORMS, QuantizedWeight, quantize

IDS = torch.tensor([[3, 5, 7, 11, 13, 17]])


@pytest.mark.parametrize(
    ("form", "ratio", "error"),
    [("int8", 3.9, 0.01), ("int4", 7.0, 0.12), ("float8", 3.9, 0.04)],
)
def test_quantize_stores_fewer_bytes_and_dequantizes_close(
    form: str, ratio: float, error: float
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(128, 256)
    stored = quantize(weight, form)
    assert weight.nbytes / stored.nbytes >= ratio
    back = stored.dequantize()
    assert back.shape == weight.shape and back.dtype == torch.float32
    relative = ((back - weight).norm() / weight.norm()).item()
    assert 0 < relative < error
    assert torch.equal(stored.to("cpu").dequantize(), back)


def test_unknown_form_is_refused_with_the_accepted_ones(tmp_path: Path) -> None:
    model = tiny_llama()
    with pytest.raises(
        ValueError, match="offload_quantization='int3'.*int8, int4, float8"
    ):
        disk_offload(model, tmp_path, offload_quantization="int3")


@pytest.mark.parametrize("form", FORMS)
def test_dispatch_stores_linear_weights_quantized_on_disk(
    tmp_path: Path, form: str
) -> None:
    reference = tiny_llama()
    with torch.no_grad():
        expected = reference(IDS).logits
    model = tiny_llama()
    dispatch_model(
        model, half_on_disk(), offload_dir=tmp_path, offload_quantization=form
    )
    index = json.loads((tmp_path / "index.json").read_text())
    up = index["model.layers.3.mlp.up_proj.weight"]
    assert (
        up["quantization"]["form"] == form
        and up["dtype"] == "float32"
        and up["shape"] == [64, 32]
    )
    assert (
        "quantization" not in index["model.layers.3.input_layernorm.weight"]
    )  # norms stay full precision
    stored = sum(
        p.stat().st_size
        for p in tmp_path.rglob("model.layers.3.mlp.up_proj.weight*.dat")
    )
    assert stored <= 64 * 32 * 4 / 3.5
    with torch.no_grad():
        logits = model(IDS).logits
    assert not torch.equal(logits, expected)
    torch.testing.assert_close(
        logits, expected, rtol=0, atol=0.05 if form == "int4" else 0.02
    )


def test_quantized_folder_is_reused_and_a_stale_one_is_rewritten(
    tmp_path: Path,
) -> None:
    dispatch_model(
        tiny_llama(), half_on_disk(), offload_dir=tmp_path, offload_quantization="int8"
    )
    file = tmp_path / "model.layers.3.mlp.up_proj.weight.dat"
    first = file.stat().st_ino, file.stat().st_mtime_ns
    dispatch_model(
        tiny_llama(), half_on_disk(), offload_dir=tmp_path, offload_quantization="int8"
    )
    assert (
        file.stat().st_ino,
        file.stat().st_mtime_ns,
    ) == first  # same source bytes: reused as it is
    changed = tiny_llama()
    with torch.no_grad():
        changed.model.layers[3].mlp.up_proj.weight.mul_(2)
    dispatch_model(
        changed, half_on_disk(), offload_dir=tmp_path, offload_quantization="int8"
    )
    assert file.stat().st_ino != first[0]  # other source bytes: quantized again
    model = tiny_llama()
    dispatch_model(
        model, half_on_disk(), offload_dir=tmp_path, offload_quantization="int4"
    )
    index = json.loads((tmp_path / "index.json").read_text())
    assert (
        index["model.layers.3.mlp.up_proj.weight"]["quantization"]["form"] == "int4"
    )  # another form: rewritten


def test_cpu_offload_keeps_weights_quantized_in_ram() -> None:
    reference = tiny_llama()
    with torch.no_grad():
        expected = reference(IDS).logits
    model = tiny_llama()
    cpu_offload(model, execution_device="cpu", offload_quantization="int8")
    hook = model.model.layers[0].mlp.up_proj._hf_hook
    stored = hook.weights_map.dataset.packed("model.layers.0.mlp.up_proj.weight")
    assert isinstance(stored, QuantizedWeight) and stored.data.dtype == torch.int8
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=0.02)


def test_load_checkpoint_and_dispatch_quantizes_the_disk_part(tmp_path: Path) -> None:
    from bigmodel import load_checkpoint_and_dispatch

    reference = tiny_llama()
    reference.save_pretrained(str(tmp_path / "ckpt"))
    with init_empty_weights():
        model = type(reference)(reference.config)
    model = load_checkpoint_and_dispatch(
        model, str(tmp_path / "ckpt"), device_map=half_on_disk(), offload_folder=tmp_path / "off",
        offload_quantization="int4",
    )  # fmt: skip
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert (
        index["model.layers.2.self_attn.q_proj.weight"]["quantization"]["form"]
        == "int4"
    )
    assert "model.layers.0.self_attn.q_proj.weight" not in index
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS).logits, reference(IDS).logits, rtol=0, atol=0.05
        )


def test_load_pretrained_takes_the_same_option(tmp_path: Path) -> None:
    from bigmodel import load_pretrained

    reference = tiny_llama()
    reference.save_pretrained(str(tmp_path / "ckpt"))
    model = load_pretrained(
        tmp_path / "ckpt",
        device_map=half_on_disk(),
        offload_folder=tmp_path / "off",
        offload_quantization="float8",
    )
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert (
        index["model.layers.3.mlp.down_proj.weight"]["quantization"]["form"] == "float8"
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS).logits, reference(IDS).logits, rtol=0, atol=0.02
        )


def test_plain_modules_without_linear_weights_are_left_alone(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(10, 32), nn.LayerNorm(32))
    disk_offload(model, tmp_path, execution_device="cpu", offload_quantization="int8")
    index = json.loads((tmp_path / "index.json").read_text())
    assert all("quantization" not in entry for entry in index.values())


def test_a_user_file_named_like_a_quantized_part_in_the_checkpoint_folder_is_kept(tmp_path: Path) -> None:
    from bigmodel import load_checkpoint_and_dispatch

    reference = tiny_llama()
    reference.save_pretrained(str(tmp_path))
    stray = tmp_path / "model.layers.2.self_attn.q_proj.weight@scale.dat"
    stray.write_bytes(b"the user's own bytes")
    before = sorted(p.name for p in tmp_path.iterdir())
    with init_empty_weights():
        model = type(reference)(reference.config)
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.self_attn\.q_proj\.weight@scale\.dat' already exists"):
        load_checkpoint_and_dispatch(model, str(tmp_path), device_map=half_on_disk(), offload_folder=tmp_path,
                                     offload_quantization="int8")  # fmt: skip
    assert stray.read_bytes() == b"the user's own bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
