"""One hook per block of a device map: inside a block's forward its submodules run no hook work of their own.

A decode step of a model with offloaded decoder layers runs, per layer, one hook that puts all the
layer's offloaded weights in and takes them out again (counted here, never timed); each submodule
keeps its own hook for calls made outside its block's forward.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from _tiny_hf import write_tiny_llama
from torch import nn

from bigmodel import (
    align_module_device,
    attach_layerwise_casting_hooks,
    get_state_dict_offloaded_model,
    has_offloaded_params,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    remove_hook_from_submodules,
)
from bigmodel.hooks import AlignDevicesHook
from bigmodel.hooks.forward import HookedForward

transformers = pytest.importorskip("transformers")

MAP = {
    "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
    "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
}  # fmt: skip
OFFLOADED = ("model.layers.1", "model.layers.2")
IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", tokenizer=False, tie=True)


def _reference(folder: Path) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _dispatched(folder: Path, tmp_path: Path, **kwargs) -> nn.Module:
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    model.eval()
    return load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(tmp_path / "off"),
                                        **kwargs)  # fmt: skip


class _PreForwards:
    """Counts the AlignDevicesHook pre_forwards that run, per block of MAP (module → its block's name)."""

    def __init__(self, model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        self.blocks = {id(sub): block for block in MAP for sub in model.get_submodule(block).modules()}
        self.counts: Counter[str] = Counter()
        original = AlignDevicesHook.pre_forward

        def counting(hook, module, *args, **kwargs):
            self.counts[self.blocks.get(id(module), "")] += 1
            return original(hook, module, *args, **kwargs)

        monkeypatch.setattr(AlignDevicesHook, "pre_forward", counting)


def _decode_step(model: nn.Module) -> tuple[torch.Tensor, object]:
    """A prompt forward, then one decode step with its KV cache: the decode step's logits (and the cache)."""
    with torch.no_grad():
        out = model(IDS, use_cache=True)
        step = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    return step.logits, step.past_key_values


def test_a_decode_step_runs_one_hook_per_block(folder, tmp_path, monkeypatch):
    reference = _reference(folder)
    model = _dispatched(folder, tmp_path)
    expected, _ = _decode_step(reference)
    with torch.no_grad():
        out = model(IDS, use_cache=True)
    counter = _PreForwards(model, monkeypatch)
    with torch.no_grad():
        step = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    assert torch.equal(step.logits, expected)
    for block in OFFLOADED + ("model.layers.0", "model.layers.3"):
        assert counter.counts[block] == 1, (block, counter.counts)
    # Each submodule keeps its own hook (for calls outside the block's forward), its forward hooked between forwards.
    down = model.model.layers[1].mlp.down_proj
    assert has_offloaded_params(down) and isinstance(down.__dict__["forward"], HookedForward)
    assert down.weight.device.type == "meta"
    assert isinstance(model.model.layers[1].self_attn.__dict__["forward"], HookedForward)


def test_generate_matches_and_the_prefetcher_orders_blocks(folder, tmp_path):
    reference = _reference(folder)
    model = _dispatched(folder, tmp_path)
    with torch.no_grad():
        expected = reference.generate(IDS, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(IDS, max_new_tokens=6, do_sample=False), expected)
    hook = model.model.layers[1].__dict__["_hf_hook"]
    assert [len(h.offloaded_names) for h in (hook,)] == [0]  # the layer has no tensors of its own
    assert hook.prefetcher is not None and hook.prefetcher.order_length == len(OFFLOADED)
    assert hook.staged_bytes == sum(p.numel() * 4 for p in model.model.layers[1].parameters())


def test_a_submodule_called_outside_its_block_runs_its_own_hook(folder, tmp_path, monkeypatch, caplog):
    reference = _reference(folder)
    model = _dispatched(folder, tmp_path)
    x = torch.randn(1, 3, 32)
    counter = _PreForwards(model, monkeypatch)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        got = model.model.layers[2].mlp(x)
        assert torch.equal(got, reference.model.layers[2].mlp(x))
    assert counter.counts["model.layers.2"] == 4  # mlp's io hook, then gate/up/down's offloading hooks
    assert "outside its module's forward" not in caplog.text
    with align_module_device(model.model.layers[2].mlp.up_proj):
        assert torch.equal(model.model.layers[2].mlp.up_proj.weight, reference.model.layers[2].mlp.up_proj.weight)
    assert model.model.layers[2].mlp.up_proj.weight.device.type == "meta"


def test_state_dict_ties_and_hook_removal(folder, tmp_path):
    reference = _reference(folder)
    model = _dispatched(folder, tmp_path, offload_buffers=True)
    _decode_step(model)
    state = get_state_dict_offloaded_model(model)
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    remove_hook_from_submodules(model)
    assert not [name for name, sub in model.named_modules() if "_hf_hook" in sub.__dict__ or "forward" in sub.__dict__]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.state_dict().items())
    assert torch.equal(_decode_step(model)[0], _decode_step(reference)[0])


class _Doubled(nn.Module):
    """Wraps a layer as an adapter library does after dispatch (the wrapped layer becomes ``base_layer``)."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer

    def forward(self, x):
        return 2 * self.base_layer(x)


def test_a_submodule_wrapped_after_dispatch_still_gets_its_weights(folder, tmp_path, monkeypatch):
    reference = _reference(folder)
    model = _dispatched(folder, tmp_path)
    for m in (reference, model):
        m.model.layers[1].mlp.down_proj = _Doubled(m.model.layers[1].mlp.down_proj)
    counter = _PreForwards(model, monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
    assert counter.counts["model.layers.1"] == 1


def test_layerwise_casting_after_dispatch_runs_on_the_cast_layers(folder, tmp_path, monkeypatch):
    reference = _reference(folder)
    model = _dispatched(folder, tmp_path)
    for m in (reference, model):
        attach_layerwise_casting_hooks(m, torch.bfloat16, torch.float32)
    counter = _PreForwards(model, monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
    # The block's hook, then the own hooks of the 7 Linears (casting hooks appended to their offloading hooks);
    # the norms (not a layer class layerwise casting supports) still get their weights from the block's hook.
    assert counter.counts["model.layers.1"] == 1 + 7


def test_a_failed_forward_gives_the_submodules_their_hooks_back(folder, tmp_path):
    model = _dispatched(folder, tmp_path)
    layer = model.model.layers[1]

    def boom(module, args):
        raise RuntimeError("boom")

    handle = layer.mlp.up_proj.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(IDS)
    handle.remove()
    for sub in (layer.mlp.up_proj, layer.mlp.gate_proj, layer.self_attn.q_proj, layer.mlp):
        assert isinstance(sub.__dict__["forward"], HookedForward)
    assert all(p.device.type == "meta" for p in layer.parameters())
    assert torch.equal(_decode_step(model)[0], _decode_step(_reference(folder))[0])


def test_per_submodule_hooks_with_the_switch_off(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMODEL_BLOCK_HOOKS", "0")
    model = _dispatched(folder, tmp_path)
    counter = _PreForwards(model, monkeypatch)
    with torch.no_grad():
        model(IDS)
    assert counter.counts["model.layers.1"] == 12  # the layer, attention, mlp, 7 Linears, 2 norms


def test_a_forward_set_on_a_submodule_before_dispatch_still_runs_in_its_block(folder, tmp_path):
    reference = _reference(folder)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    model.eval()
    for m in (reference, model):
        down = m.model.layers[1].mlp.down_proj
        down.forward = lambda x, down=down: 3 * torch.nn.functional.linear(x, down.weight)
    load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(tmp_path / "off"))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_a_member_load_that_raises_gives_every_member_back(folder, tmp_path):
    model = _dispatched(folder, tmp_path)
    layer = model.get_submodule("model.layers.1")
    layer.self_attn.v_proj._hf_hook.weights_map = {}  # its value cannot be read: the block's pre-forward raises there
    with torch.no_grad(), pytest.raises(KeyError):
        model(IDS)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        member = layer.get_submodule(name)
        assert type(member.__dict__.get("forward")) is HookedForward, name  # its own hooks run again outside
        assert member.weight.is_meta, name  # the placeholder is back, the value freed
