"""An offloaded module computing in place with its weights map's memory (CPU, mmap views or a dict) is
given the same Parameter at each forward, as a plain model is, while nothing it is built from changed;
every change (in the forward, model-wide, in the weights map, grad and inference modes) still reaches it."""

from __future__ import annotations

import copy

import pytest
import torch
from _offloaded_llama import IDS, dispatched, folder, reference  # noqa: F401  (fixtures)
from torch import nn

from bigmodel import (
    align_module_device,
)
from bigmodel.hooks import AlignDevicesHook, add_hook_to_module

transformers = pytest.importorskip("transformers")

Q = "model.layers.1.self_attn.q_proj"


def _held_weights(module: nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Records ``module.weight`` as the module holds it in each of its forwards (inside its hooks)."""
    seen: list[torch.Tensor] = []
    cls = type(module)
    forward = cls.forward

    def recording(self, *args, **kwargs):
        if self is module:
            seen.append(self.weight)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", recording)
    return seen


@pytest.mark.parametrize("block_hooks", ["1", "0"])  # one hook run per block, or per submodule
def test_the_same_parameter_at_each_forward(folder, tmp_path, reference, monkeypatch, block_hooks):
    monkeypatch.setenv("BIGMODEL_BLOCK_HOOKS", block_hooks)
    model = dispatched(folder, tmp_path)
    assert bool(model.get_submodule("model.layers.1")._hf_hook.members) is (block_hooks == "1")
    seen = _held_weights(model.get_submodule(Q), monkeypatch)
    with torch.no_grad():
        expected = reference(IDS).logits
        for _ in range(3):
            torch.testing.assert_close(model(IDS).logits, expected)
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2]
    assert type(seen[0]) is nn.Parameter and seen[0].device.type == "cpu"
    assert model.get_submodule(Q).weight.is_meta  # between forwards: the placeholder
    torch.testing.assert_close(seen[0], reference.get_submodule(Q).weight)


def test_changes_made_in_a_forward_do_not_outlive_it(folder, tmp_path, reference, monkeypatch):
    model = dispatched(folder, tmp_path)
    q = model.get_submodule(Q)
    calls = []

    def change(mod, args):
        calls.append(1)
        if len(calls) == 2:
            mod.weight.data = torch.zeros_like(mod.weight)  # re-pointed
        if len(calls) == 3:
            mod.weight.requires_grad_(False)

    q.register_forward_pre_hook(change)
    seen = _held_weights(q, monkeypatch)
    with torch.no_grad():
        expected = reference(IDS).logits
        model(IDS)
        assert not torch.allclose(model(IDS).logits, expected)  # the zeroed weight is used in that forward
        torch.testing.assert_close(model(IDS).logits, expected)  # and only there
        torch.testing.assert_close(model(IDS).logits, expected)
    assert not seen[3].requires_grad or seen[3] is not seen[2]
    assert seen[3].requires_grad is q.weight.requires_grad  # as the placeholder says


def test_model_wide_changes_reach_the_forward(folder, tmp_path, reference, monkeypatch):
    model = dispatched(folder, tmp_path)
    q = model.get_submodule(Q)
    seen = _held_weights(q, monkeypatch)
    model.requires_grad_(False)
    with torch.no_grad():
        model(IDS)
    model(IDS)  # recording gradients: a Parameter that requires none is put in again
    assert seen[1] is seen[0] and not seen[1].requires_grad

    with torch.no_grad():
        model.to(torch.float64)
        out = model(IDS).logits
    assert seen[2].dtype == torch.float64 and out.dtype == torch.float64
    torch.testing.assert_close(out, copy.deepcopy(reference).to(torch.float64)(IDS).logits.detach())
    with torch.no_grad():
        model.to(torch.float32)
        model(IDS)
        model(IDS)
    assert seen[3].dtype == torch.float32 and seen[4] is seen[3]


def test_gradients_never_outlive_their_forward(folder, tmp_path, reference, monkeypatch):
    model = dispatched(folder, tmp_path)
    q = model.get_submodule(Q)
    seen = _held_weights(q, monkeypatch)
    with torch.no_grad():
        model(IDS)
    model(IDS).logits.sum().backward()  # recording: a new Parameter, never kept
    assert seen[1] is not seen[0] and seen[1].requires_grad and seen[1].grad is not None
    with torch.no_grad():
        model(IDS)
    assert seen[2].grad is None and seen[2] is not seen[1]


def test_inference_mode_values_are_never_kept(folder, tmp_path, reference, monkeypatch):
    model = dispatched(folder, tmp_path)
    model.requires_grad_(False)
    seen = _held_weights(model.get_submodule(Q), monkeypatch)
    with torch.inference_mode():
        model(IDS)
    embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
    model(inputs_embeds=embeds).logits.sum().backward()  # an inference tensor here could not be saved for backward
    assert not seen[1].is_inference() and embeds.grad is not None
    with torch.inference_mode():  # a kept value may be used in inference mode, as a plain model's
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits.detach())
    assert seen[2] is seen[1]


def test_weights_map_changes_reach_the_forward(folder, tmp_path, reference, monkeypatch):
    model = dispatched(folder, tmp_path)
    q = model.get_submodule(Q)
    with torch.no_grad():
        model(IDS)
        with align_module_device(q):
            q.weight.mul_(2)  # stored in the weights map at the end of the context
        out = model(IDS).logits
    changed = copy.deepcopy(reference)
    with torch.no_grad():
        changed.get_submodule(Q).weight.mul_(2)
        torch.testing.assert_close(out, changed(IDS).logits)

    seen = []

    class Recording(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.weight)
            return super().forward(x)

    linear = Recording(3, 2)
    add_hook_to_module(linear, AlignDevicesHook("cpu", offload=True))
    x = torch.ones(1, 3)
    with torch.no_grad():
        linear(x)
        linear(x)
        linear._hf_hook.weights_map["weight"] = torch.zeros(2, 3)  # a dict weights map: a new value
        torch.testing.assert_close(linear(x), linear._hf_hook.weights_map["bias"].expand(1, 2))
    assert seen[0] is seen[1] and seen[2] is not seen[1]


def test_a_deep_copy_keeps_nothing(folder, tmp_path, reference, monkeypatch):
    model = dispatched(folder, tmp_path)
    with torch.no_grad():
        model(IDS)
        clone = copy.deepcopy(model)
        seen = _held_weights(model.get_submodule(Q), monkeypatch)
        clone_seen = _held_weights(clone.get_submodule(Q), monkeypatch)
        torch.testing.assert_close(clone(IDS).logits, reference(IDS).logits)
        model(IDS)
        clone(IDS)
    assert clone_seen[0] is not seen[0] and clone_seen[1] is clone_seen[0]


def test_a_member_load_that_raises_leaves_every_member_as_it_was(folder, tmp_path):
    from bigmodel.hooks.forward import HookedForward

    model = dispatched(folder, tmp_path)
    layer = model.get_submodule("model.layers.1")
    v_proj = layer.self_attn.v_proj
    v_proj._hf_hook.weights_map = {}  # its value cannot be read: the block's forward raises there
    with torch.no_grad(), pytest.raises(KeyError):
        model(IDS)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        member = layer.get_submodule(name)
        assert type(member.__dict__.get("forward")) is HookedForward, name  # its hooks run again outside
        assert member.weight.is_meta, name  # the placeholder is back


def test_a_changed_execution_device_is_used(monkeypatch):
    # accelerate puts the weights map's value on hook.execution_device at each forward: a kept CPU value
    # must not be put in once the hook computes elsewhere ("meta" stands in for an accelerator here).
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    expected_weight = linear.weight.detach().clone()
    seen = _held_weights(linear, monkeypatch)
    add_hook_to_module(linear, AlignDevicesHook(execution_device="cpu", offload=True))
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = linear(x)
        linear(x)
        linear._hf_hook.execution_device = "meta"
        assert linear(x).device.type == "meta"
        assert seen[-1].device.type == "meta"
        with align_module_device(linear, "meta"):  # a forward inside the context computes where it says
            assert linear(x).device.type == "meta"
        linear._hf_hook.execution_device = "cpu"
        torch.testing.assert_close(linear(x), expected)
        torch.testing.assert_close(linear(x), expected)
    torch.testing.assert_close(seen[-1], expected_weight)
    assert seen[-1] is seen[-2]  # kept again once it computes on the CPU again


def test_a_weights_map_value_changed_in_place_in_shape_or_strides_is_used():
    # The dict entry stays the same object viewing the same memory, but in-place metadata ops change
    # what it holds: accelerate reads the entry at each forward, so the change reaches the forward.
    # A value no longer of the tensor's shape is refused, naming it, as accelerate refuses it
    # ("Trying to set a tensor of shape torch.Size([1, 4]) in "bias" ..."); it used to be broadcast.
    torch.manual_seed(0)
    linear, plain = nn.Linear(4, 4), nn.Linear(4, 4)
    plain.load_state_dict(linear.state_dict())
    add_hook_to_module(linear, AlignDevicesHook("cpu", offload=True))
    x = torch.randn(2, 4)
    with torch.no_grad():
        linear(x)
        linear(x)
        linear._hf_hook.weights_map["weight"].t_()
        plain.weight.t_()
        torch.testing.assert_close(linear(x), plain(x))
        torch.testing.assert_close(linear(x), plain(x))
        linear._hf_hook.weights_map["bias"].unsqueeze_(0)
        with pytest.raises(ValueError, match=r"Offloaded tensor 'bias' has shape \[1, 4\] .* but \[4\] in the model"):
            linear(x)


def test_set_module_tensor_to_device_on_an_offloaded_tensor(folder, tmp_path, reference):
    # accelerate's set_module_tensor_to_device puts the value in the module's slot (a plain Parameter);
    # its hook puts the weights map's value in at the next forward.  It used to raise a TypeError here
    # (the placeholder's class was rebuilt with its hook reference as a keyword).
    from bigmodel.utils import set_module_tensor_to_device

    model = dispatched(folder, tmp_path)
    name = f"{Q}.weight"
    new = torch.randn_like(reference.get_parameter(name))
    with torch.no_grad():
        model(IDS)
        model(IDS)
        set_module_tensor_to_device(model, name, "cpu", value=new)
        held = model.get_parameter(name)
        assert type(held) is nn.Parameter and torch.equal(held, new)
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)
    assert model.get_parameter(name).is_meta
