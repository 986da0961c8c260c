"""A hand-written device map that leaves out a module holding only non-persistent buffers.

transformers' Llama keeps ``model.rotary_emb.inv_freq`` as a non-persistent buffer (not in the
state dict); a map written from the state dict's names omits ``model.rotary_emb``. accelerate
accepts such a map (its check covers state-dict names); bigmodel did not.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from bigmodel import dispatch_model, init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.dispatch.uncovered import place_uncovered_buffers
from bigmodel.utils import check_device_map

IDS = torch.tensor([[1, 5, 9, 2, 7]])


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _map_without_rotary(model: LlamaForCausalLM, disk_from: int) -> dict[str, str]:
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" if i < disk_from else "disk" for i in range(layers)})
    return device_map


def test_check_device_map_passes_non_persistent_buffers_left_out():
    model = _model()
    assert "model.rotary_emb.inv_freq" not in model.state_dict()
    check_device_map(model, _map_without_rotary(model, disk_from=99))


def test_a_persistent_buffer_left_out_is_still_refused_by_name():
    model = _model()
    model.model.rotary_emb.register_buffer("kept", torch.ones(2))  # persistent: in the state dict
    with pytest.raises(ValueError, match=r"model\.rotary_emb\.kept"):
        check_device_map(model, _map_without_rotary(model, disk_from=99))


def test_dispatch_with_disk_layers_and_rotary_left_out_gives_the_reference_logits(tmp_path):
    model = _model()
    with torch.no_grad():
        reference = model(IDS).logits
    dispatched = dispatch_model(model, _map_without_rotary(model, disk_from=1), offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(dispatched(IDS).logits, reference)


def test_load_checkpoint_and_dispatch_with_rotary_left_out(tmp_path):
    model = _model()
    with torch.no_grad():
        reference = model(IDS).logits
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    with init_empty_weights():
        empty = LlamaForCausalLM(model.config).eval()
    loaded = load_checkpoint_and_dispatch(empty, tmp_path / "model.safetensors", _map_without_rotary(model, 1),
                                          offload_folder=tmp_path / "offload")  # fmt: skip
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference)


def test_uncovered_buffers_move_to_the_main_device_and_covered_ones_do_not():
    model = _model()
    device_map = _map_without_rotary(model, disk_from=99)
    moved = place_uncovered_buffers(model, device_map, "meta")  # meta stands for an accelerator here
    assert moved == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert model.model.rotary_emb.inv_freq.device.type == "meta"
    assert "inv_freq" in model.model.rotary_emb._buffers  # still a registered buffer
    assert model.model.embed_tokens.weight.device.type == "cpu"
