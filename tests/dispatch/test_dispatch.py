"""dispatch_model, cpu/disk offload, load_checkpoint_and_dispatch: bit-exact outputs, memory, compile."""

from __future__ import annotations

import gc
import json
import weakref

import psutil
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    get_state_dict_offloaded_model,
    has_offloaded_params,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    offload_state_dict,
    remove_hook_from_submodules,
)


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    _no_split_modules = ["Layer"]

    def __init__(self, vocab: int = 32, dim: int = 16, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Layer(dim) for _ in range(n_layers)])
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h * self.scale)


IDS = torch.tensor([[1, 5, 7, 2, 9]])
MAPS = {
    "all_cpu": {"": "cpu"},
    "cpu_disk": {"embed": "cpu", "layers.0": "cpu", "layers.1": "disk", "layers.2": "disk", "layers.3": "cpu",
                 "lm_head": "cpu", "scale": "cpu"},
    "all_disk": {"": "disk"},
    "layers_on_disk": {"embed": "cpu", "layers": "disk", "lm_head": "cpu", "scale": "cpu"},
}


def fresh(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().eval()


@pytest.fixture(scope="module")
def reference():
    model = fresh()
    with torch.no_grad():
        return model.state_dict(), model(IDS)


def loaded(state) -> TinyLM:
    model = fresh(1)
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("kind", sorted(MAPS))
def test_dispatch_outputs_bit_exact(kind, reference, tmp_path):
    state, expected = reference
    model = dispatch_model(loaded(state), MAPS[kind], offload_dir=tmp_path, force_hooks=True)
    assert model.hf_device_map == MAPS[kind]
    with torch.no_grad():
        for _ in range(2):  # the second pass runs with prefetch
            assert torch.equal(model(IDS), expected)
    if "disk" in MAPS[kind].values():
        assert (tmp_path / "index.json").is_file()
        assert has_offloaded_params(model.layers[1].up)


def test_single_device_map_just_moves_the_model(reference):
    model = dispatch_model(loaded(reference[0]), {"": "cpu"})
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    assert model.hf_device_map == {"": "cpu"}


def test_cpu_offload_and_disk_offload(reference, tmp_path):
    state, expected = reference
    with torch.no_grad():
        model = cpu_offload(loaded(state))
        assert model.layers[0].up.weight.is_meta
        assert torch.equal(model(IDS), expected) and torch.equal(model(IDS), expected)
        model = disk_offload(loaded(state), tmp_path)
        assert model.layers[0].up.weight.is_meta
        assert torch.equal(model(IDS), expected) and torch.equal(model(IDS), expected)
        # a model without values of its own (meta) reads the folder as is
        with init_empty_weights():
            empty = TinyLM().eval()
        model = disk_offload(empty, tmp_path)
        assert torch.equal(model(IDS), expected)


@pytest.mark.parametrize("entry", ["dispatch_model", "disk_offload"])
def test_stale_offload_folder_never_replaces_real_weights(entry, reference, tmp_path):
    """A folder written for other weights (same shapes) is rewritten from the model's own values."""
    state, expected = reference

    def offload(model):
        if entry == "disk_offload":
            return disk_offload(model, tmp_path)
        return dispatch_model(model, MAPS["layers_on_disk"], offload_dir=tmp_path)

    with torch.no_grad():
        assert torch.equal(offload(loaded(state))(IDS), expected)
        other = fresh(3)
        other_expected = other(IDS)
        assert not torch.equal(other_expected, expected)
        assert torch.equal(offload(other)(IDS), other_expected)
        # the same values again: the entries are reused, not rewritten (same file, same inode)
        dat = tmp_path / "layers.1.up.weight.dat"
        inode = dat.stat().st_ino
        third = fresh(3)
        assert torch.equal(offload(third)(IDS), other_expected)
        assert dat.stat().st_ino == inode


def test_cpu_offload_with_hook_chain(reference):
    state, expected = reference
    first, hook1 = cpu_offload_with_hook(loaded(state), "cpu")
    second, hook2 = cpu_offload_with_hook(nn.Identity(), "cpu", prev_module_hook=hook1)
    with torch.no_grad():
        assert torch.equal(second(first(IDS)), expected)
    hook2.offload()
    hook1.remove()
    assert not hasattr(first, "_hf_hook")


def test_disk_without_offload_dir_is_an_error(reference):
    with pytest.raises(ValueError, match="offload_dir"):
        dispatch_model(loaded(reference[0]), MAPS["cpu_disk"])


def test_uncovered_map_is_an_error(reference):
    with pytest.raises(ValueError, match="does not cover"):
        dispatch_model(loaded(reference[0]), {"embed": "cpu", "layers": "disk"}, offload_dir="unused")


def test_moving_an_offloaded_model_raises(reference, tmp_path):
    model = dispatch_model(loaded(reference[0]), MAPS["cpu_disk"], offload_dir=tmp_path)
    for call in (lambda: model.to("cpu"), lambda: model.to("meta"), lambda: model.cpu()):
        with pytest.raises(RuntimeError, match="remove_hook_from_submodules"):
            call()
    assert model.layers[1].up.weight.is_meta
    remove_hook_from_submodules(model)
    assert "to" not in model.__dict__ and "_apply" not in model.__dict__
    model.to(torch.float64)  # allowed again, weights back in the modules
    assert model.layers[1].up.weight.dtype == torch.float64


def test_remove_hooks_brings_weights_back(reference, tmp_path):
    state, expected = reference
    model = dispatch_model(loaded(state), MAPS["all_disk"], offload_dir=tmp_path)
    remove_hook_from_submodules(model)
    assert not any(t.is_meta for t in model.state_dict().values())
    assert model.lm_head.weight is model.embed.weight
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)


def test_state_dict_of_offloaded_model(reference, tmp_path):
    state, _ = reference
    model = dispatch_model(loaded(state), MAPS["cpu_disk"], offload_dir=tmp_path)
    full = get_state_dict_offloaded_model(model)
    assert list(full) == list(state)
    for name, value in state.items():
        assert torch.equal(full[name], value), name


@pytest.mark.parametrize("kind", ["cpu_disk", "all_disk"])
def test_state_dict_of_offloaded_model_is_a_copy(kind, reference, tmp_path):
    state, expected = reference
    model = dispatch_model(loaded(state), MAPS[kind], offload_dir=tmp_path, force_hooks=True)
    full = get_state_dict_offloaded_model(model)
    full["layers.1.up.weight"].zero_()  # offloaded (disk): its value lives in the weights map
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)
    assert torch.equal(get_state_dict_offloaded_model(model)["layers.1.up.weight"], state["layers.1.up.weight"])


class TiedThreeParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.mid(self.emb(x)))


@pytest.mark.parametrize("device_map", [
    {"emb": "cpu", "mid": "disk", "head": "disk"},
    {"emb": "cpu", "mid": "cpu", "head": "disk"},
    {"emb": "disk", "mid": "cpu", "head": "cpu"},
])  # fmt: skip
def test_ties_with_an_offloaded_member_read_the_same_before_and_after_forward(device_map, tmp_path):
    torch.manual_seed(0)
    model = TiedThreeParts().eval()
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(x)
        dispatch_model(model, device_map, offload_dir=tmp_path)
        before = (model.head.weight is model.emb.weight, model.head.weight.is_meta, model.emb.weight.is_meta)
        assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
        after = (model.head.weight is model.emb.weight, model.head.weight.is_meta, model.emb.weight.is_meta)
    # The disk member holds the resident member's Parameter: one Parameter, as on the plain model.
    assert before == after == (True, False, False)
    remove_hook_from_submodules(model)
    assert model.head.weight is model.emb.weight
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_resident_ties_stay_tied_after_dispatch(reference, tmp_path):
    model = dispatch_model(loaded(reference[0]), MAPS["layers_on_disk"], offload_dir=tmp_path)
    assert model.lm_head.weight is model.embed.weight  # neither is offloaded
    with torch.no_grad():
        model(IDS)
    assert model.lm_head.weight is model.embed.weight


@pytest.mark.parametrize("call", ["cpu", "to_meta", "to_device_and_dtype", "to_empty", "wrapper"])
def test_every_device_move_of_an_offloaded_model_is_refused(call, reference, tmp_path):
    model = dispatch_model(loaded(reference[0]), MAPS["cpu_disk"], offload_dir=tmp_path)
    actions = {
        "cpu": lambda: model.cpu(), "to_meta": lambda: model.to("meta"),
        "to_device_and_dtype": lambda: model.to("cpu", torch.float64), "to_empty": lambda: model.to_empty(device="cpu"),
        "wrapper": lambda: nn.Sequential(model).to("meta"),  # a parent's move reaches the model too
    }  # fmt: skip
    name = {"to_meta": "to", "to_device_and_dtype": "to", "wrapper": "to"}.get(call, call)
    with pytest.raises(RuntimeError, match=rf"Cannot call \.{name}\(\) on a TinyLM .*remove_hook_from_submodules"):
        actions[call]()
    assert model.embed.weight.dtype == torch.float32 and model.layers[1].up.weight.is_meta
    remove_hook_from_submodules(model)
    assert "_apply" not in model.__dict__


@pytest.mark.parametrize("call", ["float", "double", "bfloat16", "type", "wrapper"])
def test_every_cast_of_an_offloaded_model_goes_through(call, reference, tmp_path):
    state, _ = reference
    model = dispatch_model(loaded(state), MAPS["cpu_disk"], offload_dir=tmp_path)
    plain = loaded(state)
    actions = {
        "float": lambda m: m.float(), "double": lambda m: m.double(), "bfloat16": lambda m: m.bfloat16(),
        "type": lambda m: m.type(torch.float64), "wrapper": lambda m: nn.Sequential(m).to(torch.float64),
    }  # fmt: skip
    actions[call](model)
    actions[call](plain)
    assert model.layers[1].up.weight.is_meta and model.layers[1].up.weight.dtype == plain.layers[1].up.weight.dtype
    with torch.no_grad():
        assert torch.equal(model(IDS), plain(IDS))


def test_move_guard_names_no_backend():
    import inspect
    import re

    import bigmodel.dispatch.redispatch as redispatch

    assert not re.search(r"\b(cuda|xpu|npu|mps|hpu|mlu)\b", inspect.getsource(redispatch))


@pytest.mark.parametrize("kind", ["cpu_disk", "all_disk"])
def test_del_frees_memory_without_gc(kind, reference, tmp_path):
    model = dispatch_model(loaded(reference[0]), MAPS[kind], offload_dir=tmp_path)
    with torch.no_grad():
        model(IDS)
        model(IDS)
    alive = weakref.ref(model)
    hook = weakref.ref(model.layers[2].up._hf_hook)
    gc.collect()
    gc.disable()
    try:
        del model
        assert alive() is None and hook() is None
    finally:
        gc.enable()


def test_cpu_offload_frees_weights_without_gc(reference):
    model = cpu_offload(loaded(reference[0]))
    weight = weakref.ref(model.layers[0].up._hf_hook.weights_map["weight"])
    with torch.no_grad():
        model(IDS)
    gc.collect()
    gc.disable()
    try:
        del model
        assert weight() is None
    finally:
        gc.enable()


def test_many_forwards_leave_memory_flat(reference, tmp_path):
    model = dispatch_model(loaded(reference[0]), MAPS["cpu_disk"], offload_dir=tmp_path)

    def live_tensors() -> int:
        gc.collect()
        return sum(1 for obj in gc.get_objects() if type(obj) in (torch.Tensor, nn.Parameter))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: avoid thread-pool contention on a busy machine
    try:
        with torch.no_grad():
            for _ in range(20):
                model(IDS)
            before, rss_before = live_tensors(), psutil.Process().memory_info().rss
            for _ in range(1000):
                model(IDS)
            after, rss_after = live_tensors(), psutil.Process().memory_info().rss
    finally:
        torch.set_num_threads(threads)
    assert after - before <= 2, (before, after)
    assert rss_after - rss_before < 16 * 2**20, (rss_before, rss_after)  # loose: noise, not a leak


def save_checkpoint(state, folder):
    folder.mkdir()
    unique = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: stored once
    save_file({k: v.contiguous() for k, v in unique.items()}, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("device_map", [MAPS["cpu_disk"], MAPS["all_disk"], "sequential"])
def test_load_checkpoint_and_dispatch(device_map, reference, tmp_path):
    state, expected = reference
    checkpoint = save_checkpoint(state, tmp_path / "ckpt")
    with init_empty_weights():
        model = TinyLM().eval()
    budgets = {"cpu": 3000, "disk": 10**9} if device_map == "sequential" else None
    model = load_checkpoint_and_dispatch(
        model, checkpoint, device_map=device_map, max_memory=budgets, offload_folder=tmp_path / "off"
    )
    if device_map == "sequential":
        assert "disk" in model.hf_device_map.values()
        assert all(k == "layers" or not k.startswith("layers.") or k.count(".") == 1 for k in model.hf_device_map)
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)
        assert torch.equal(model(IDS), expected)


def test_load_checkpoint_unknown_string_map(reference, tmp_path):
    checkpoint = save_checkpoint(reference[0], tmp_path / "ckpt")
    with pytest.raises(ValueError, match="sequential"):
        load_checkpoint_and_dispatch(fresh(), checkpoint, device_map="everywhere")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_runs_dispatched_model(backend, reference, tmp_path):
    state, expected = reference
    model = dispatch_model(loaded(state), MAPS["cpu_disk"], offload_dir=tmp_path)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        assert torch.equal(compiled(IDS), expected)
        assert torch.equal(compiled(IDS), expected)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_del_releases_the_offload_file_mappings_without_gc(reference, tmp_path):
    state, expected = reference
    model = dispatch_model(loaded(state), MAPS["all_disk"], offload_dir=tmp_path)
    dat = str((tmp_path / "layers.2.up.weight.dat").resolve())

    def mapped() -> int:
        with open("/proc/self/maps") as maps:
            return sum(1 for line in maps if line.rstrip().endswith(dat))

    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(IDS), expected)
    assert mapped() == 1  # mapped once, reused by every forward
    gc.collect()
    gc.disable()
    try:
        del model
        assert mapped() == 0
    finally:
        gc.enable()


@pytest.fixture
def transfer_calls(monkeypatch):
    """Record the accelerator transfer layer's use by dispatch: pinning and the device stager."""
    from bigmodel.dispatch import dispatch as _dispatch
    from bigmodel.dispatch import redispatch as _redispatch
    from bigmodel.dispatch import whole_model as _offload_entry
    from bigmodel.hooks import cpu_offload as _cpu_offload

    calls: dict = {"pinned": [], "staged": 0}
    real_pin = _dispatch.pin_tensors

    def pin(tensors, enabled=True, **kwargs):
        calls["pinned"].append(sorted(tensors))
        return real_pin(tensors, enabled, **kwargs)

    class Stager(_redispatch.DeviceStager):
        def __call__(self, values, device):
            calls["staged"] += 1
            return super().__call__(values, device)

    for module in (_dispatch, _offload_entry, _cpu_offload):  # every module that pins (PinnedCpuOffload is in cpu_offload)
        monkeypatch.setattr(module, "pin_tensors", pin)
    monkeypatch.setattr(_redispatch, "DeviceStager", Stager)
    return calls


def _as_accelerator(monkeypatch) -> None:
    """Make dispatch treat the CPU execution device as an accelerator (the transfer layer is the identity on CPU)."""
    from bigmodel.dispatch import dispatch as _dispatch
    from bigmodel.dispatch import redispatch as _redispatch
    from bigmodel.dispatch import whole_model as _offload_entry

    for module in (_dispatch, _offload_entry, _redispatch):
        monkeypatch.setattr(module, "_runs_on_accelerator", lambda device: device is not None and device != "disk")


def test_cpu_execution_never_pins_or_stages(reference, tmp_path, transfer_calls):
    from bigmodel.dispatch import prefetch as _prefetch

    state, expected = reference
    models = [
        dispatch_model(loaded(state), MAPS["cpu_disk"], offload_dir=tmp_path / "a"),
        cpu_offload(loaded(state)),
        disk_offload(loaded(state), tmp_path / "b"),
    ]
    chained, _ = cpu_offload_with_hook(loaded(state), "cpu")
    assert type(chained._hf_hook).__name__ == "CpuOffload"
    with torch.no_grad():
        for model in models + [chained]:
            for _ in range(3):
                assert torch.equal(model(IDS), expected)
    for model in models:
        assert model.layers[1].up._hf_hook.prefetcher.stage is _prefetch.stage
    assert transfer_calls == {"pinned": [], "staged": 0}


def test_accelerator_execution_pins_cpu_weights_once_and_stages(reference, tmp_path, transfer_calls, monkeypatch):
    _as_accelerator(monkeypatch)
    state, expected = reference
    model = dispatch_model(loaded(state), MAPS["cpu_disk"], main_device="cpu", offload_dir=tmp_path)
    on_cpu = ("embed.", "layers.0.", "layers.3.", "lm_head.", "scale")
    assert transfer_calls["pinned"] == [sorted(k for k in state if k.startswith(on_cpu))]  # never the disk part
    prefetcher = model.layers[1].up._hf_hook.prefetcher
    assert type(prefetcher.stage).__name__ == "Stager" and not prefetcher.in_place
    prefetcher.min_bytes = 0  # the test model's modules are below the default threshold
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(IDS), expected)
    assert transfer_calls["staged"] > 0 and len(transfer_calls["pinned"]) == 1


@pytest.mark.parametrize("kind", ["cpu_offload", "disk_offload"])
def test_whole_model_offload_to_accelerator_pins_and_stages(kind, reference, tmp_path, transfer_calls, monkeypatch):
    _as_accelerator(monkeypatch)
    state, expected = reference
    if kind == "cpu_offload":
        model = cpu_offload(loaded(state), execution_device="cpu")
        assert transfer_calls["pinned"] == [sorted(state)]
    else:
        model = disk_offload(loaded(state), tmp_path, execution_device="cpu")
        assert transfer_calls["pinned"] == []  # disk values go through the stager's staging buffer instead
    model.layers[1].up._hf_hook.prefetcher.min_bytes = 0
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(IDS), expected)
    assert transfer_calls["staged"] > 0


def test_cpu_offload_with_hook_to_accelerator_pins_once(reference, transfer_calls, monkeypatch):
    from bigmodel.hooks.cpu_offload import PinnedCpuOffload

    _as_accelerator(monkeypatch)
    state, expected = reference
    first, hook1 = cpu_offload_with_hook(loaded(state), "cpu")
    second, hook2 = cpu_offload_with_hook(nn.Identity(), "cpu", prev_module_hook=hook1)
    assert isinstance(first._hf_hook, PinnedCpuOffload)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(second(first(IDS)), expected)
            hook2.offload()
    assert transfer_calls["pinned"] == [sorted(
        name for name, _ in [*first.named_parameters(), *first.named_buffers()]
    )]  # once for the first model (the Identity has no tensors), not per forward or offload
    hook1.remove()
    assert not hasattr(first, "_hf_hook") and torch.equal(first(IDS), expected)


def test_an_offload_index_lacking_a_value_the_model_holds_reads_it_from_memory(tmp_path) -> None:
    """transformers passes an index of the checkpoint's tensors only; a tensor it initialised itself (a new
    head) is in memory.  Its hook reads that value (accelerate 1.15: KeyError at the forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    expected = model(x)
    offload_state_dict(tmp_path, {k: v for k, v in model.state_dict().items() if not k.startswith("2.")})
    index = json.loads((tmp_path / "index.json").read_text())
    dispatch_model(model, {"": "disk"}, offload_dir=tmp_path, offload_index=index)
    assert model[2].weight.device.type == "meta"
    assert torch.equal(model(x), expected)
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("offload", ["cpu_offload", "dispatch_model"])
def test_a_refused_offload_leaves_no_module_half_offloaded(offload, tmp_path) -> None:
    """A state_dict lacking the last module's bias is refused when that module is hooked; the modules
    hooked before it must not stay offloaded (they did: hooks left on, weights on meta, and
    ``model.to(...)`` then failed with torch's set_data error).  An offload index lacking a value the
    model holds in memory is not refused (the hook reads it from memory), so with dispatch_model the
    bias is on ``meta`` too: it has no value anywhere."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    expected = model(x)
    partial = {k: v for k, v in model.state_dict().items() if k != "2.bias"}
    bias = model[2].bias
    with pytest.raises(ValueError, match=r"weights_map has no value for 1 tensor\(s\) of Linear '2': \['bias'\]"):
        if offload == "cpu_offload":
            cpu_offload(model, execution_device="cpu", state_dict=partial)
        else:
            offload_state_dict(tmp_path, partial)
            index = json.loads((tmp_path / "index.json").read_text())
            model[2].bias = nn.Parameter(bias.detach().to("meta"))
            dispatch_model(model, {"": "disk"}, offload_dir=tmp_path, offload_index=index)
    assert [name for name, m in model.named_modules() if hasattr(m, "_hf_hook")] == []
    model[2].bias = bias
    assert all(p.device.type == "cpu" for p in model.parameters())
    model.to(torch.float64).to(torch.float32)
    assert torch.equal(model(x), expected)


def test_a_refused_device_move_is_caught_as_not_implemented_too():
    """The incumbent's refusals of ``.cpu()``/``.to(device)`` on an offloaded model are NotImplementedError
    (torch's copy out of meta) or RuntimeError; bigmodel's is a NotImplementedError, so both catch it."""
    from torch import nn

    from bigmodel import cpu_offload

    model = cpu_offload(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), execution_device="cpu")
    for move in (model.cpu, lambda: model.to("cpu")):
        with pytest.raises(NotImplementedError, match=r"Cannot call \.(cpu|to)\(\) on a Sequential"):
            move()


def test_a_redispatch_to_a_folder_it_cannot_write_leaves_the_dispatched_model_as_it_was(tmp_path):
    """The new offload folder is checked before the old hooks come off: the model keeps its hooks, its
    map and its values (before, it was left unhooked, its disk part back in RAM, with the old map)."""
    from torch import nn

    from bigmodel import dispatch_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    expected = model(x)
    first = {"0": "cpu", "1": "disk"}
    dispatch_model(model, first, main_device="cpu", offload_dir=tmp_path / "first")
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    with pytest.raises(PermissionError, match="is not writable: it is a file"):
        dispatch_model(model, {"0": "disk", "1": "disk"}, main_device="cpu", offload_dir=not_a_folder)
    assert model.hf_device_map == first
    assert model[1].weight.device.type == "meta" and hasattr(model[1], "_hf_hook")  # still offloaded
    assert torch.equal(model(x), expected)
    dispatch_model(model, {"0": "disk", "1": "disk"}, main_device="cpu", offload_dir=tmp_path / "second")
    assert torch.equal(model(x), expected)  # a writable folder: re-dispatched


class _WithOwnTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((3,), 2.0))
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.register_buffer("shift", torch.ones(3))

    def forward(self, x):
        return self.second(self.first(x) * self.scale) + self.shift


def test_offloaded_state_dict_is_the_models_own_state_dict_root_tensors_included(tmp_path):
    """README (session 10): every entry of ``state_dict()``, in its order; accelerate 1.15 leaves out the root's
    own ``scale`` and ``shift``."""
    torch.manual_seed(0)
    model = _WithOwnTensors()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    dispatch_model(model, {"first": "disk", "second": "cpu", "scale": "cpu", "shift": "cpu"}, offload_dir=tmp_path)
    state = get_state_dict_offloaded_model(model)
    assert list(state) == list(expected) == ["scale", "shift", "first.weight", "first.bias", "second.weight",
                                             "second.bias"]  # fmt: skip
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils.modeling import get_state_dict_offloaded_model as accelerates_state_dict

    theirs = _WithOwnTensors()
    accelerate.dispatch_model(theirs, {"first": "disk", "second": "cpu", "scale": "cpu", "shift": "cpu"},
                              offload_dir=tmp_path / "theirs")  # fmt: skip
    assert list(accelerates_state_dict(theirs)) == ["first.weight", "first.bias", "second.weight", "second.bias"]
