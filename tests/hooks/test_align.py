"""AlignDevicesHook, attach_* functions, placeholders, CpuOffload, align_module_device, moving inputs."""

from __future__ import annotations

import collections
import dataclasses
import logging

import pytest
import torch
from torch import nn

from bigmodel import (
    AlignDevicesHook,
    CpuOffload,
    OffloadedWeightsLoader,
    UserCpuOffloadHook,
    add_hook_to_module,
    align_module_device,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    dispatch_model,
    has_offloaded_params,
    offload_state_dict,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from bigmodel.hooks.moving import find_device, send_inputs_to_device, send_to_device


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("shift", torch.full((dim,), 0.5))

    def forward(self, x):
        return self.norm(self.linear(x)) + self.shift


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ReadsChildWeight(nn.Module):
    """Uses its child's weight directly, not through the child's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x @ self.proj.weight.T * self.gate


def make(cls=Net, seed=0):
    torch.manual_seed(seed)
    return cls().eval()


# ------------------------------------------------------------------ moving inputs

Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    extra: dict


def test_send_to_device_keeps_container_types_and_skip_keys():
    t = torch.ones(2)
    obj = {"x": (t, [t]), "p": Pair(t, 3), "d": Batch(t, {"cache": t}), "cache": t, "s": "text"}
    moved = send_to_device(obj, "meta", skip_keys="cache")
    assert moved["x"][0].is_meta and moved["x"][1][0].is_meta and isinstance(moved["x"][1], list)
    assert isinstance(moved["p"], Pair) and moved["p"].a.is_meta and moved["p"].b == 3
    assert isinstance(moved["d"], Batch) and moved["d"].ids.is_meta
    assert moved["d"].extra["cache"] is t and moved["cache"] is t
    assert moved["s"] == "text"
    assert find_device(moved["p"]) == torch.device("meta")
    assert send_to_device(t, "cpu") is t  # already there: no copy


def test_send_inputs_to_device_returns_inputs_as_is_when_nothing_moves():
    t = torch.ones(2)
    cpu = torch.device("cpu")
    args, kwargs = (t, (t, None), 3), {"mask": t, "flag": True, "cache": object()}
    moved_args, moved_kwargs = send_inputs_to_device(args, kwargs, cpu)
    assert moved_args is args and moved_kwargs is kwargs  # no walk result rebuilt

    # Anything that must move, or a container send_to_device rebuilds, takes the full path.
    moved_args, moved_kwargs = send_inputs_to_device((t, [t]), {"mask": t}, torch.device("meta"))
    assert moved_args[0].is_meta and moved_args[1][0].is_meta and moved_kwargs["mask"].is_meta
    listed = [t]
    assert send_inputs_to_device((listed,), {}, cpu)[0][0] is not listed  # a list is copied, as before
    assert send_inputs_to_device((), {"d": {"a": t}}, cpu)[1]["d"]["a"] is t

    class Movable:
        def __init__(self) -> None:
            self.calls = []

        def to(self, device):
            self.calls.append(device)
            return self

    movable = Movable()
    send_inputs_to_device((), {"m": movable}, cpu)
    assert movable.calls == [cpu]  # objects with .to() are still asked to move


def test_send_inputs_to_device_leaves_skip_keys_alone():
    t = torch.ones(2)
    args, kwargs = send_inputs_to_device((t,), {"cache": t, "x": t}, torch.device("meta"), skip_keys="cache")
    assert args[0].is_meta and kwargs["x"].is_meta and kwargs["cache"] is t
    kwargs = {"cache": t}
    assert send_inputs_to_device((), kwargs, torch.device("meta"), skip_keys=["cache"])[1] is kwargs
    assert send_inputs_to_device((t,), {}, None)[0][0] is t


def test_send_to_device_model_output():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = CausalLMOutputWithPast(logits=torch.ones(1, 2), loss=torch.zeros(()))
    moved = send_to_device(out, "meta")
    assert isinstance(moved, CausalLMOutputWithPast)
    assert moved.logits.is_meta and moved["loss"].is_meta


# ------------------------------------------------------------------ AlignDevicesHook


def test_offload_hook_uses_weights_in_place_and_restores_meta():
    seen = {}

    class Recording(nn.Linear):
        def forward(self, x):
            seen.update(ptr=self.weight.data_ptr(), device=self.weight.device)
            return super().forward(x)

    model = make(Block)
    model.linear.__class__ = Recording
    x = torch.randn(2, 8)
    expected = model(x)
    weights = {k: v.clone() for k, v in model.linear.state_dict().items()}
    add_hook_to_module(model.linear, AlignDevicesHook("cpu", offload=True, weights_map=weights))
    assert model.linear.weight.is_meta and has_offloaded_params(model.linear)
    assert torch.equal(model(x), expected)
    assert seen == {"ptr": weights["weight"].data_ptr(), "device": torch.device("cpu")}
    assert model.linear.weight.is_meta and model.linear.bias.is_meta
    assert model.linear.state_dict()["weight"].is_meta


def test_offload_hook_builds_weights_map_and_detach_brings_values_back():
    model = make(Block)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook("cpu", offload=True, offload_buffers=True, place_submodules=True))
    assert all(t.is_meta for t in model.state_dict().values())
    remove_hook_from_module(model)
    assert not any(t.is_meta for t in model.state_dict().values())
    for name, value in model.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert type(model.linear.weight) is nn.Parameter and model.linear.weight.requires_grad


def test_casts_value_to_module_dtype():
    model = nn.Linear(4, 4).to(torch.float64)
    weights = {k: v.to(torch.float32) for k, v in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook("cpu", offload=True, weights_map=weights))
    assert model(torch.ones(1, 4, dtype=torch.float64)).dtype == torch.float64


def test_skip_keys_and_execution_device_move_inputs():
    captured = {}

    class Capture(nn.Module):
        def forward(self, x, cache=None):
            captured.update(x=x.device, cache=cache.device)
            return x

    module = Capture()
    add_hook_to_module(module, AlignDevicesHook("meta", skip_keys=["cache"]))
    module(torch.ones(1), cache=torch.ones(1))
    assert captured == {"x": torch.device("meta"), "cache": torch.device("cpu")}


def test_io_same_device_moves_output_back():
    class Fresh(nn.Module):
        def forward(self, x):
            return {"out": torch.ones(x.shape)}

    module = Fresh()
    add_hook_to_module(module, AlignDevicesHook("cpu", io_same_device=True))
    assert module(torch.ones(1, device="meta"))["out"].device == torch.device("meta")
    module._hf_hook.io_same_device = False
    assert module(torch.ones(1, device="meta"))["out"].device == torch.device("cpu")


def test_tied_values_materialised_once_per_device():
    shared = torch.randn(4, 4)
    tied = {shared.data_ptr(): {}}
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    hook_a = AlignDevicesHook("meta", offload=True, weights_map={"weight": shared}, tied_params_map=tied)
    hook_b = AlignDevicesHook("meta", offload=True, weights_map={"weight": shared}, tied_params_map=tied)
    add_hook_to_module(a, hook_a)
    add_hook_to_module(b, hook_b)
    hook_a.pre_forward(a)
    hook_b.pre_forward(b)  # nested in a's forward: reuses a's copy on the device
    assert a.weight is b.weight
    hook_b.post_forward(b, None)
    hook_a.post_forward(a, None)
    assert tied[shared.data_ptr()] == {}


def test_parent_reading_child_weight_works_and_warns(caplog):
    model = make(ReadsChildWeight)
    x = torch.randn(2, 8)
    expected = model(x)
    attach_align_device_hook(model, "cpu", offload=True, weights_map=model.state_dict())
    assert model.proj.weight.is_meta
    with caplog.at_level(logging.WARNING, logger="bigmodel.hooks.align_hook"):
        assert torch.equal(model(x), expected)
    assert "'proj.weight'" in caplog.text and "preload_module_classes" in caplog.text
    assert model.proj.weight.is_meta


def test_preload_module_classes_loads_subtree():
    model = make(ReadsChildWeight)
    x = torch.randn(2, 8)
    expected = model(x)
    attach_align_device_hook(
        model, "cpu", offload=True, weights_map=model.state_dict(), preload_module_classes=["ReadsChildWeight"]
    )
    assert model._hf_hook.place_submodules and not hasattr(model.proj, "_hf_hook")
    assert torch.equal(model(x), expected)


def test_attach_align_device_hook_prefixes_weights_map():
    model = make()
    x = torch.randn(2, 8)
    expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attach_align_device_hook(model, "cpu", offload=True, weights_map=state, offload_buffers=True)
    assert model.blocks[1].linear._hf_hook.module_name == "blocks.1.linear"
    assert model.blocks[0].shift.is_meta
    assert torch.equal(model(x), expected)
    remove_hook_from_submodules(model)
    assert torch.equal(model.blocks[2].linear.weight, state["blocks.2.linear.weight"])


def test_attach_on_blocks_with_per_block_dicts(tmp_path):
    model = make()
    x = torch.randn(2, 8)
    expected = model(x)
    state = model.state_dict()
    offload_state_dict(tmp_path, {k: v for k, v in state.items() if k.startswith("blocks.1.")})
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    devices = {"blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "cpu", "head": "cpu", "": "cpu"}
    offload = {"blocks.0": False, "blocks.1": True, "blocks.2": False, "head": False}
    attach_align_device_hook_on_blocks(model, devices, offload, weights_map=loader)
    assert model._hf_hook.io_same_device
    assert has_offloaded_params(model.blocks[1].linear) and not has_offloaded_params(model.blocks[0].linear)
    assert model.blocks[1].norm.weight.is_meta
    assert torch.equal(model(x), expected)


def test_attach_execution_device_hook_skips_hooked_and_preloaded():
    model = make()
    add_hook_to_module(model.head, AlignDevicesHook("cpu", offload=True))
    attach_execution_device_hook(model, "cpu", preload_module_classes=["Block"])
    assert model.head._hf_hook.offload  # kept
    assert isinstance(model.blocks[0]._hf_hook, AlignDevicesHook)
    assert not hasattr(model.blocks[0].linear, "_hf_hook")  # Block is preloaded: not descended into


# ------------------------------------------------------------------ align_module_device


def test_align_module_device_changes_persist_in_dict_map():
    model = make(Block)
    state = {k: v.clone() for k, v in model.linear.state_dict().items()}
    add_hook_to_module(model.linear, AlignDevicesHook("cpu", offload=True, weights_map=state))
    with align_module_device(model.linear):
        assert not model.linear.weight.is_meta
        model.linear.weight.data.mul_(2)
    assert model.linear.weight.is_meta
    assert torch.equal(model.linear._hf_hook.weights_map["weight"], state["weight"])
    with align_module_device(model.linear, "cpu"):
        doubled = model.linear.weight.clone()
    assert torch.equal(model.linear._hf_hook.weights_map["weight"], doubled)


def test_align_module_device_on_disk_never_writes_the_file(tmp_path):
    layer = nn.Linear(4, 4)
    offload_state_dict(tmp_path, layer.state_dict())
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    before = (tmp_path / "weight.dat").read_bytes()
    add_hook_to_module(layer, AlignDevicesHook("cpu", offload=True, weights_map=loader))
    with align_module_device(layer):
        layer.weight.data.zero_()
    assert (tmp_path / "weight.dat").read_bytes() == before
    assert torch.count_nonzero(loader["weight"]) == 0  # kept, in memory


def test_align_module_device_without_hook_is_a_noop():
    layer = nn.Linear(2, 2)
    with align_module_device(layer):
        assert layer.weight.device.type == "cpu"
    assert not has_offloaded_params(layer)


# ------------------------------------------------------------------ CpuOffload


def test_cpu_offload_hook_chain_offloads_previous_model():
    calls = []

    class Recording(UserCpuOffloadHook):
        def offload(self):
            calls.append("offload")
            super().offload()

    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    hook = CpuOffload("cpu")
    add_hook_to_module(first, hook)
    add_hook_to_module(second, CpuOffload("cpu", prev_module_hook=Recording(first, hook)))
    second(first(torch.ones(1, 2)))
    assert calls == ["offload"]
    Recording(first, hook).remove()
    assert not hasattr(first, "_hf_hook")


# ------------------------------------------------------------------ review fixes


@pytest.mark.parametrize("make_mapping", [collections.UserDict, collections.OrderedDict, "batch_encoding"])
def test_find_device_walks_any_mapping_and_io_same_device_moves_it_back(make_mapping):
    if make_mapping == "batch_encoding":
        from transformers import BatchEncoding as make_mapping
    assert find_device(make_mapping({"a": "text", "b": torch.ones(1, device="meta")})) == torch.device("meta")
    assert find_device([make_mapping({"a": 1}), (torch.ones(1),)]) == torch.device("cpu")

    class Returns(nn.Module):
        def forward(self, inputs):
            return make_mapping({"out": torch.ones(2)})

    module = Returns()
    add_hook_to_module(module, AlignDevicesHook("cpu", io_same_device=True))
    out = module(make_mapping({"ids": torch.ones(1, device="meta")}))
    assert isinstance(out, make_mapping) and out["out"].device == torch.device("meta")


def test_align_module_device_without_own_hook_leaves_offloaded_children_alone(tmp_path):
    from bigmodel import cpu_offload, dispatch_model

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    cpu_offload(model, "cpu")  # every child offloaded, the root has no offloading hook
    with align_module_device(model, "cpu"):  # the move guard refuses model.to() on it
        assert model[0].weight.is_meta and has_offloaded_params(model[0])

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.register_parameter("gate", nn.Parameter(torch.ones(4)))
    dispatch_model(model, {"gate": "cpu", "0": "disk", "1": "cpu"}, offload_dir=tmp_path)
    gate = model.gate
    with align_module_device(model, "meta"):  # only the root's own parameter moves
        assert model.gate.is_meta and model[0].weight.is_meta and not model[1].weight.is_meta
    assert model.gate is gate and torch.equal(gate, torch.ones(4))
    assert has_offloaded_params(model[0])


def test_align_module_device_without_hook_keeps_ties_and_parameter_objects():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.arange(4.0))
            self.b = self.a
            self.register_buffer("buf", torch.ones(2))
            self.child = nn.Linear(2, 2)

    module = Tied()
    a, child_weight = module.a, module.child.weight
    with align_module_device(module, "meta"):
        assert module.a is module.b and module.a.is_meta  # a stand-in (torch cannot swap .data to meta)
        assert module.child.weight.device.type == "cpu"  # only the module's own parameters move
    assert module.a is a and module.b is a and module.child.weight is child_weight
    assert torch.equal(a, torch.arange(4.0))


# API.md: attach_align_device_hook_on_blocks takes attach_align_device_hook's arguments and defaults.
ON_BLOCKS_DEFAULTS = {
    "execution_device": None, "offload": False, "weights_map": None, "offload_buffers": False, "module_name": "",
    "skip_keys": None, "preload_module_classes": None, "tied_params_map": None,
}


def test_attach_on_blocks_defaults_follow_the_api_contract():
    import inspect
    import pathlib
    import re

    params = inspect.signature(attach_align_device_hook_on_blocks).parameters
    assert list(params) == ["module", *ON_BLOCKS_DEFAULTS]
    assert {name: params[name].default for name in ON_BLOCKS_DEFAULTS} == ON_BLOCKS_DEFAULTS
    contract = pathlib.Path(__file__).resolve().parents[3] / "shared" / "API.md"
    if contract.is_file():  # the lead's checkout: compare with the contract's text itself
        body = re.search(r"`attach_align_device_hook\((.*?)\)`", contract.read_text(), re.S).group(1)
        written = dict(p.strip().split("=", 1) for p in body.replace("\n", " ").split(",") if "=" in p)
        assert {k: repr(v).replace("''", '""') for k, v in ON_BLOCKS_DEFAULTS.items()} == written


def test_align_devices_hook_repr_lists_its_settings():
    hook = AlignDevicesHook("cpu", offload=True, skip_keys=["cache"])
    assert repr(hook) == (
        "AlignDevicesHook(execution_device=cpu, offload=True, io_same_device=False, offload_buffers=False, "
        "place_submodules=False, skip_keys=['cache'])"
    )


def test_attach_on_blocks_single_device_forms():
    resident, offloaded = make(), make()
    x = torch.randn(2, 8)
    expected = resident(x)
    attach_align_device_hook_on_blocks(resident, "cpu")  # offload defaults to False: one hook, whole subtree
    hook = resident._hf_hook
    assert hook.place_submodules and hook.io_same_device and not hook.offload
    assert not hasattr(resident.blocks[0].linear, "_hf_hook")
    attach_align_device_hook_on_blocks(offloaded, "cpu", offload=True, weights_map=offloaded.state_dict())
    assert has_offloaded_params(offloaded.blocks[0].linear) and not hasattr(offloaded, "_hf_hook")
    assert torch.equal(resident(x), expected) and torch.equal(offloaded(x), expected)


def test_an_object_with_its_own_to_is_moved_even_after_its_class_was_seen():
    from bigmodel.hooks.moving import send_inputs_to_device

    class Cache:  # no container, no .to on the class: given back as it is
        pass

    plain, own = Cache(), Cache()
    own.to = lambda device, non_blocking=False: ("moved", device)
    cpu = torch.device("cpu")
    for _ in range(2):
        _, kwargs = send_inputs_to_device((), {"cache": plain}, cpu)
        assert kwargs["cache"] is plain
    _, kwargs = send_inputs_to_device((), {"cache": own}, cpu)
    assert kwargs["cache"] == ("moved", cpu)


@pytest.mark.parametrize("attach", ["hook", "dispatch", "send_to_device"])
def test_skip_keys_that_are_no_keys_are_refused_when_the_hook_is_made(attach):
    """An int (or other non-iterable) used to be accepted, then broke every forward with
    "'int' object is not iterable"; it is a TypeError naming skip_keys before any forward."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"skip_keys=5 \(int\) is neither a key nor a list of keys"):
        if attach == "hook":
            AlignDevicesHook("cpu", skip_keys=5)
        elif attach == "dispatch":
            dispatch_model(model, {"": "cpu"}, skip_keys=5, force_hooks=True)
        else:
            send_to_device({"a": torch.ones(1)}, "cpu", skip_keys=5)
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 4)), model(torch.ones(1, 4)))
    hook = AlignDevicesHook("cpu", skip_keys=(k for k in ["cache"]))  # an iterable is kept, not consumed
    assert list(hook.skip_keys) == ["cache"]


@pytest.mark.parametrize("library", ["bigmodel", "accelerate"])
def test_a_weights_map_without_a_value_is_a_key_error(library):
    """accelerate's hook raises KeyError when it looks up the missing value (at the forward); bigmodel
    refuses when the hook is attached, with an error that is a KeyError and a ValueError naming it."""
    hooks = pytest.importorskip(f"{library}.hooks")
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(KeyError) as caught:
        hooks.attach_align_device_hook(model, "cpu", offload=True, weights_map={"0.weight": torch.ones(2, 2)})
        model(torch.ones(1, 2))
    if library == "bigmodel":
        assert isinstance(caught.value, ValueError)
        assert str(caught.value).startswith("weights_map has no value for 1 tensor(s) of Linear '0': ['bias']")
        assert all(p.device.type == "cpu" for p in model.parameters())  # refused before any tensor was replaced
