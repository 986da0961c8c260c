"""A dispatched model is the model its checkpoint describes (issue 12): dtypes and buffer values
of disk modules, weight-shared blocks, dispatching again, and peft adapters added after dispatch."""

from __future__ import annotations

import pytest
import torch
from _tiny_hf import TWO_LAYERS_ON_DISK as LLAMA_MAP
from _tiny_hf import write_tiny_llama
from safetensors.torch import save_file, save_model
from torch import nn

from bigmodel import (
    align_module_device,
    dispatch_model,
    get_state_dict_offloaded_model,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    remove_hook_from_submodules,
)
from bigmodel.hooks import AlignDevicesHook, SequentialHook

# --------------------------------------------------------------------------- tiny transformers model

IDS = torch.tensor([[3, 5, 7, 9, 11]])


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "model", tokenizer=False)


def _empty_llama(folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_disk_modules_of_a_bfloat16_load_compute_in_bfloat16(llama_folder, tmp_path):
    ref = load_checkpoint_and_dispatch(_empty_llama(llama_folder), llama_folder, device_map={"": "cpu"},
                                       dtype=torch.bfloat16)  # fmt: skip
    model = load_checkpoint_and_dispatch(_empty_llama(llama_folder), llama_folder, device_map=LLAMA_MAP,
                                         offload_folder=tmp_path, dtype=torch.bfloat16)  # fmt: skip
    disk_weight = model.model.layers[1].self_attn.q_proj.weight
    assert disk_weight.device.type == "meta" and disk_weight.dtype == torch.bfloat16
    logits = _logits(model)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, _logits(ref))
    state = get_state_dict_offloaded_model(model)
    assert {v.dtype for k, v in state.items() if v.is_floating_point()} == {torch.bfloat16}


# --------------------------------------------------------------------------- integer buffers


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))

    def forward(self, x):
        return self.proj(x) * self.steps


class Counters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Counter(), Counter()

    def forward(self, x):
        return self.b(self.a(x))


X4 = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))


def _counters_checkpoint(folder, steps_dtype=torch.int64):
    torch.manual_seed(0)
    model = Counters()
    model.a.steps.copy_(torch.tensor([1, 2, 3, 4]))
    model.b.steps.copy_(torch.tensor([5, 6, 7, 8]))
    state = {k: v.to(steps_dtype) if k.endswith("steps") else v for k, v in model.state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    return model


def test_integer_buffer_of_a_disk_module_comes_back_with_the_checkpoint_value(tmp_path):
    plain = _counters_checkpoint(tmp_path / "ckpt")
    with init_empty_weights():
        model = Counters()  # its buffers are real (zeros): the checkpoint's values must win
    load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map={"a": "cpu", "b": "disk"},
                                 offload_folder=tmp_path / "offload", offload_buffers=True)  # fmt: skip
    assert torch.equal(model(X4), plain(X4))
    assert torch.equal(get_state_dict_offloaded_model(model)["b.steps"], torch.tensor([5, 6, 7, 8]))
    remove_hook_from_submodules(model)
    assert torch.equal(model.b.steps, torch.tensor([5, 6, 7, 8]))


@pytest.mark.parametrize("device_map", [None, {"a": "cpu", "b": "disk"}])
def test_integer_buffer_stored_as_float_takes_the_model_dtype(device_map, tmp_path):
    plain = _counters_checkpoint(tmp_path / "ckpt", steps_dtype=torch.float16)
    with init_empty_weights():
        model = Counters()
    load_checkpoint_in_model(model, tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "offload",
                             offload_buffers=True)  # fmt: skip
    assert model.a.steps.dtype == torch.int64 and model.b.steps.dtype == torch.int64
    assert torch.equal(model.a.steps, torch.tensor([1, 2, 3, 4]))
    if device_map is not None:
        dispatch_model(model, device_map, offload_dir=tmp_path / "offload", offload_buffers=True)
    state = get_state_dict_offloaded_model(model)
    assert state["b.steps"].dtype == torch.int64 and torch.equal(state["b.steps"], torch.tensor([5, 6, 7, 8]))
    assert torch.equal(model(X4), plain(X4))


# --------------------------------------------------------------------------- weight-shared blocks


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return (x + self.down(torch.relu(self.up(x)))) * self.scale


class Looped(nn.Module):
    """One block run three times (registered under three names), between two plain blocks."""

    _no_split_modules = ["Scaled"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = Scaled()
        shared = Scaled()
        self.layers = nn.ModuleList([shared, shared, shared])
        self.post = Scaled()

    def forward(self, x):
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.post(x)


X8 = torch.randn(2, 8, generator=torch.Generator().manual_seed(4))


def _aliases(model: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _device_of(name: str, device_map: dict) -> object:
    while name not in device_map:
        name = name.rpartition(".")[0]
    return device_map[name]


@pytest.mark.parametrize("no_split", [None, ["Scaled"]])
@pytest.mark.parametrize("cpu_budget", [1300, 2300, 2700, 3500])
def test_a_block_registered_under_several_names_is_planned_and_dispatched(cpu_budget, no_split, tmp_path):
    ref = Looped()(X8)
    model = Looped()
    device_map = infer_auto_device_map(model, max_memory={"cpu": cpu_budget, "disk": 10**9},
                                       no_split_module_classes=no_split, offload_buffers=True)  # fmt: skip
    for group in _aliases(model):  # every name of one tensor gets the same device
        assert len({str(_device_of(name, device_map)) for name in group}) == 1, (group, device_map)
    dispatch_model(model, device_map, offload_dir=tmp_path, offload_buffers=True)
    assert torch.equal(model(X8), ref)
    hook = model.layers[0].__dict__.get("_hf_hook")
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    assert len([h for h in hooks if isinstance(h, AlignDevicesHook)]) <= 1  # hooked once, not once per name
    remove_hook_from_submodules(model)
    assert torch.equal(model(X8), ref)


def test_a_block_registered_under_several_names_loads_from_a_deduplicated_checkpoint(tmp_path):
    plain = Looped()
    save_model(plain, str(tmp_path / "model.safetensors"))  # keeps one name per shared tensor
    with init_empty_weights():
        model = Looped()
    load_checkpoint_and_dispatch(model, tmp_path, device_map="auto", max_memory={"cpu": 2300, "disk": 10**9},
                                 offload_folder=tmp_path / "offload")  # fmt: skip
    assert "disk" in model.hf_device_map.values()
    assert torch.equal(model(X8), plain(X8))


# --------------------------------------------------------------------------- dispatching again


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = Block(), Block(), Block()

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("second_map", [
    {"a": "cpu", "b": "disk", "c": "cpu"},
    {"a": "cpu", "b": "cpu", "c": "disk"},
    {"a": "disk", "b": "disk", "c": "disk"},
])  # fmt: skip
def test_dispatch_again_without_offload_dir_reuses_the_weights_the_hooks_reach(second_map, tmp_path):
    ref = Net()(X8)
    model = dispatch_model(Net(), {"a": "cpu", "b": "disk", "c": "cpu"}, offload_dir=tmp_path / "offload")
    dispatch_model(model, second_map)
    assert model.hf_device_map == second_map
    assert torch.equal(model(X8), ref)
    remove_hook_from_submodules(model)
    assert torch.equal(model(X8), ref)


def test_dispatch_again_without_offload_dir_keeps_modules_added_after_dispatch(tmp_path):
    model = dispatch_model(Net(), {"a": "cpu", "b": "disk", "c": "cpu"}, offload_dir=tmp_path / "offload")
    extra = nn.Linear(8, 8)
    model.b.extra = extra  # e.g. an adapter injected into an offloaded block
    expected = nn.Linear(8, 8)
    expected.load_state_dict(extra.state_dict())
    dispatch_model(model, {"a": "cpu", "b": "disk", "c": "cpu"})
    out = model.b.extra(X8)
    assert torch.equal(out, expected(X8))


# --------------------------------------------------------------------------- peft adapters


@pytest.fixture
def disk_dispatched_llama(llama_folder, tmp_path):
    model = load_checkpoint_and_dispatch(_empty_llama(llama_folder), llama_folder, device_map=LLAMA_MAP,
                                         offload_folder=tmp_path / "offload")  # fmt: skip
    return model, _logits(model), tmp_path / "offload"


def _lora(model):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4))


def _plain_llama(folder):
    return load_checkpoint_and_dispatch(_empty_llama(folder), folder, device_map={"": "cpu"})


def _train_step(model) -> None:
    """One SGD step on the adapters (the only trainable parameters of a peft model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.device.type == "cpu" for p in params)
    model(IDS, labels=IDS).loss.backward()
    with torch.no_grad():
        for param in params:
            param -= 0.5 * param.grad


def test_get_peft_model_on_a_disk_dispatched_model_gives_the_base_logits(disk_dispatched_llama):
    """peft moves each new adapter to ``weight.device`` of its base layer: ``meta`` for an offloaded weight.
    With use_bigmodel() on, peft sees the hook's execution device there while it injects adapters."""
    from bigmodel.integrations import use_bigmodel

    model, base, _ = disk_dispatched_llama
    with use_bigmodel():
        peft_model = _lora(model)
    assert not [n for n, p in peft_model.named_parameters() if "lora_" in n and p.device.type == "meta"]
    base_layer = peft_model.base_model.model.model.layers[1].self_attn.q_proj.base_layer
    assert base_layer.weight.is_meta  # the offloaded weight is still a placeholder
    logits = _logits(peft_model)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, base)  # lora_B starts at zero: the adapters add nothing yet
    assert torch.equal(_logits(peft_model.unload()), base)
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    assert not hasattr(BaseTuner.inject_adapter, "__wrapped__")  # undone with use_bigmodel
    assert not hasattr(BaseTunerLayer._move_adapter_to_device_of_base_layer, "__wrapped__")


def test_a_peft_model_of_a_disk_dispatched_model_trains_as_the_plain_one(llama_folder, disk_dispatched_llama):
    from bigmodel.integrations import use_bigmodel

    model, base, _ = disk_dispatched_llama
    torch.manual_seed(3)
    reference = _lora(_plain_llama(llama_folder))
    torch.manual_seed(3)
    with use_bigmodel():
        peft_model = _lora(model)
    for _ in range(2):
        _train_step(reference)
        _train_step(peft_model)
    expected = _logits(reference)
    assert not torch.equal(expected, base)  # the adapters learned something
    assert torch.equal(_logits(peft_model), expected)
    with use_bigmodel():  # peft onloads an offloaded layer to merge into it only through accelerate's hook class
        merged = peft_model.merge_and_unload()
    merged_reference = reference.merge_and_unload()
    assert torch.allclose(_logits(merged_reference), expected, atol=1e-5)  # merged: rounded differently
    assert torch.equal(_logits(merged), _logits(merged_reference))


def test_inject_adapters_with_the_hooks_removed_then_dispatch_again(disk_dispatched_llama):
    """What peft's own ``PeftModel.from_pretrained`` does on an offloaded model: remove the hooks (the
    weights come back, as views of the offload folder), inject, dispatch again over the same folder."""
    model, base, folder = disk_dispatched_llama
    remove_hook_from_submodules(model)
    peft_model = _lora(model)
    dispatch_model(peft_model, {f"base_model.model.{k}": v for k, v in LLAMA_MAP.items()}, offload_dir=folder)
    assert peft_model.base_model.model.model.layers[1].self_attn.q_proj.lora_A.default.weight.is_meta  # offloaded
    logits = _logits(peft_model)
    assert torch.isfinite(logits).all() and torch.equal(logits, base)
    lora_a = peft_model.base_model.model.model.layers[1].self_attn.q_proj.lora_A.default
    with align_module_device(lora_a):
        assert torch.isfinite(lora_a.weight).all() and lora_a.weight.abs().sum() > 0  # its initial values, kept
