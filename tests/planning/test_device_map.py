import logging

import pytest
import torch
from torch import nn

from bigmodel import (
    check_device_map,
    clean_device_map,
    compute_module_sizes,
    find_tied_parameters,
    infer_auto_device_map,
    init_empty_weights,
)
from bigmodel.planning.device_map import STRING_MAPS, resolve_device_map
from bigmodel.planning.fill import scan_model


class Block(nn.Module):
    """Two 440-byte Linear layers beside a 4-byte scalar buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)


class Blocks(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])


class Layer(nn.Module):
    def __init__(self, numel: int = 250) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))  # 4 * numel bytes


class Layers(nn.Module):
    def __init__(self, *numels: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(n) for n in numels])


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 10)  # 2000 bytes
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(10, 50, bias=False)
        self.head.weight = self.embed.weight


def test_split_module_gives_its_own_buffer_a_device():
    device_map = infer_auto_device_map(Blocks(3), {0: 450, 1: 10_000})
    assert device_map == {"blocks.0.scale": 0, "blocks.0.a": 0, "blocks.0.b": 1, "blocks.1": 1, "blocks.2": 1}
    check_device_map(Blocks(3), device_map)


def test_whole_model_on_one_device_is_one_entry():
    assert infer_auto_device_map(TiedLM(), {0: 10_000, "cpu": 10}) == {"": 0}
    # a model with one child keeps that child's key (accelerate merges two entries or more only)
    assert infer_auto_device_map(Blocks(3), {0: 10_000, "cpu": 10}) == {"blocks": 0}
    assert infer_auto_device_map(Blocks(3), {0: 10_000}, clean_result=False) == {"blocks": 0}


def test_offloading_keeps_room_on_the_main_accelerator_for_the_largest_offloaded_layer():
    # Without the room, accelerator 0 would take two layers; it keeps 1000 bytes free instead.
    device_map = infer_auto_device_map(Layers(250, 250, 250, 250), {0: 2500, "cpu": 10_000})
    assert device_map == {"layers.0": 0, "layers.1": "cpu", "layers.2": "cpu", "layers.3": "cpu"}


def test_nothing_offloaded_means_nothing_reserved():
    assert infer_auto_device_map(Layers(250, 250), {0: 1000, 1: 1000, "cpu": 0}) == {"layers.0": 0, "layers.1": 1}


def test_cpu_keeps_room_for_disk_layers_when_it_is_the_execution_device():
    device_map = infer_auto_device_map(Layers(250, 250, 250), {"cpu": 2500, "disk": 10**9})
    assert device_map == {"layers.0": "cpu", "layers.1": "disk", "layers.2": "disk"}


def test_buffers_of_offloaded_modules_need_room_unless_offloaded_too():
    model = Blocks(3)  # each block 884 bytes: largest layer 440, buffers 4
    budgets = {0: 1768 + 440, "cpu": 10**6}
    offloaded = infer_auto_device_map(model, budgets, offload_buffers=True)
    assert offloaded == {"blocks.0": 0, "blocks.1": 0, "blocks.2": "cpu"}
    # The offloaded buffer blocks.2.scale stays on accelerator 0: 4 more bytes to keep free there.
    kept = infer_auto_device_map(model, budgets)
    assert kept == {"blocks.0": 0, "blocks.1.scale": 0, "blocks.1.a": 0, "blocks.1.b": "cpu", "blocks.2": "cpu"}


def test_gap_accelerator_ids_work_for_every_string_map():
    model = Layers(*[250] * 8)
    for name in STRING_MAPS:
        device_map = resolve_device_map(model, name, {0: 5000, 2: 5000, "cpu": 10_000})
        check_device_map(model, device_map)
        assert set(device_map.values()) <= {0, 2, "cpu"}, name
        assert 2 in device_map.values(), name
    balanced = resolve_device_map(model, "balanced", {0: 10**6, 2: 10**6})
    # even share 4000 bytes + 1.25 largest layer: five layers on 0, the rest on 2
    assert list(balanced.values()) == [0] * 5 + [2] * 3
    assert resolve_device_map(model, "sequential", {0: 10**6, 2: 10**6}) == {"layers": 0}


def test_balanced_map_uses_both_accelerators():
    model = Layers(*[250] * 8)
    device_map = resolve_device_map(model, "auto", {1: 10**6, 3: 10**6})
    assert set(device_map.values()) == {1, 3}
    low_zero = resolve_device_map(model, "balanced_low_0", {0: 10**6, 1: 10**6, 2: 10**6})
    assert 0 not in low_zero.values()


def test_unknown_string_map_lists_the_accepted_ones():
    with pytest.raises(ValueError, match=r"'fastest' is not a known map; use a dict or one of \['auto', 'balanced'"):
        resolve_device_map(Layers(1), "fastest")


def test_dict_map_is_checked():
    model = Layers(1, 1)
    assert resolve_device_map(model, {"layers.0": 0, "layers.1": "cpu"}) == {"layers.0": 0, "layers.1": "cpu"}
    with pytest.raises(ValueError, match=r"device_map\['layers.1'\]: Device 'gpu' is not a device spec"):
        resolve_device_map(model, {"layers.0": 0, "layers.1": "gpu"})
    with pytest.raises(ValueError, match=r"does not cover 1 parameters/buffers of Layers: layers.1.weight\. Add them"):
        resolve_device_map(model, {"layers.0": 0})


def test_what_fits_nowhere_else_goes_to_the_implicit_disk():
    model = Layers(250, 250, 500)
    expected = {"layers.0": 0, "layers.1": "cpu", "layers.2": "disk"}
    assert infer_auto_device_map(model, {0: 3100, "cpu": 1500}) == expected  # "disk" is always the last device
    assert infer_auto_device_map(model, {0: 3100, "cpu": 1500, "disk": 10**6}) == expected
    with pytest.raises(ValueError, match=r"Module 'layers.2' \(2,000 bytes\) fits on no device .* Raise the \"disk\""):
        infer_auto_device_map(model, {0: 3100, "cpu": 1500, "disk": 1000})


def test_empty_budgets_are_rejected_with_an_example():
    with pytest.raises(ValueError, match=r"max_memory is empty; give at least one device budget, e\.g\. \{0: "):
        infer_auto_device_map(Layers(1), {})


def test_models_without_children_or_tensors_get_one_entry():
    assert infer_auto_device_map(nn.Module(), {0: 0}) == {"": 0}
    assert infer_auto_device_map(nn.Linear(2, 2), {0: 1, "cpu": 100}) == {"": "cpu"}
    assert infer_auto_device_map(nn.Linear(2, 2), {"disk": 100}) == {"": "disk"}


def test_disk_budget_is_honoured():
    budgets = r"the budgets \{'cpu': 100, 'disk': 1,000\} \(bytes\)"
    expected = r"\(2,000 bytes\) fits on no device with " + budgets + r"\. Raise the \"disk\" budget"
    with pytest.raises(ValueError, match=expected):
        infer_auto_device_map(Layers(250, 500), {"cpu": 100, "disk": 1000})


def test_no_split_name_matching_nothing_warns_with_the_fix():
    with pytest.warns(UserWarning, match=r"\['NoSuchLayer'\] match no module of Layers.*e\.g\. \[.*'Layer'") as caught:
        infer_auto_device_map(Layers(1), {0: 100}, no_split_module_classes=["NoSuchLayer"])
    assert [w.filename for w in caught] == [__file__]  # attributed to the caller's line


def test_a_model_list_naming_some_absent_classes_plans_without_a_warning(caplog, recwarn):
    """transformers' ``_no_split_modules`` can name classes a configuration lacks (BartForCausalLM: the encoder
    layer); accelerate 1.15 plans silently, so bigmodel warns only when no name matches (logs the rest)."""
    with caplog.at_level(logging.INFO, logger="bigmodel.planning.device_map"):
        device_map = infer_auto_device_map(Blocks(3), {0: 450, 1: 10_000}, no_split_module_classes=["Block", "Gone"])
    assert device_map == {"": 1} and not [w for w in recwarn if issubclass(w.category, UserWarning)]
    assert "['Gone'] match no module of Blocks" in caplog.text


def test_bart_for_causal_lm_with_its_own_no_split_list_matches_accelerate_silently(recwarn):
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=1,
                                     decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                     vocab_size=128, max_position_embeddings=64)  # fmt: skip
    with init_empty_weights():
        model = transformers.BartForCausalLM(config)
    no_split = sorted(model._no_split_modules)
    assert no_split == ["BartDecoderLayer", "BartEncoderLayer"]  # no encoder in a causal LM
    ours = infer_auto_device_map(model, max_memory={"cpu": 100_000}, no_split_module_classes=no_split)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]
    accelerate = pytest.importorskip("accelerate")
    assert ours == dict(accelerate.infer_auto_device_map(model, max_memory={"cpu": 100_000}, no_split_module_classes=no_split))


def test_no_split_module_moves_whole_to_the_next_device():
    device_map = infer_auto_device_map(Blocks(3), {0: 450, 1: 10_000}, no_split_module_classes=["Block"])
    assert device_map == {"": 1}
    device_map = infer_auto_device_map(Blocks(3), {0: 900, 1: 10_000}, no_split_module_classes=["Block"])
    assert device_map == {"blocks.0": 0, "blocks.1": 1, "blocks.2": 1}


def test_dtype_and_special_dtypes_change_the_sizes():
    model = Layers(250, 250, 250, 250)  # 4000 bytes in float32
    assert infer_auto_device_map(model, {0: 2000, 1: 10**6})["layers.2"] == 1
    assert infer_auto_device_map(model, {0: 2000, 1: 10**6}, dtype=torch.float16) == {"layers": 0}
    special = {"layers.0.weight": torch.float32}
    assert infer_auto_device_map(model, {0: 2000, 1: 10**6}, dtype="float16", special_dtypes=special) == {
        "layers.0": 0,  # 1000 bytes in float32, then two 500-byte float16 layers fill the 2000 bytes
        "layers.1": 0,
        "layers.2": 0,
        "layers.3": 1,
    }


def test_tied_parameters_share_a_device_and_are_counted_once():
    model = TiedLM()
    device_map = infer_auto_device_map(model, {0: 2100, 1: 10**6}, ["Block"], clean_result=False)
    # embed (2000 bytes) and head (tied to it, 0 more bytes) fit together on 0; the blocks do not.
    assert device_map == {"embed": 0, "blocks.0": 1, "blocks.1": 1, "head": 0}
    assert list(device_map) == ["embed", "blocks.0", "blocks.1", "head"]  # module order, not placement order
    assert infer_auto_device_map(model, {0: 1999, 1: 10**6}, ["Block"]) == {"": 1}


def test_fallback_allocation_fills_a_device_the_next_layer_skips():
    model = Layers(250, 25, 250)
    assert infer_auto_device_map(model, {0: 200, 1: 10**6}) == {"": 1}
    assert infer_auto_device_map(model, {0: 200, 1: 10**6}, fallback_allocation=True) == {
        "layers.0": 1,
        "layers.1": 0,
        "layers.2": 1,
    }


def test_verbose_logs_through_logging(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="bigmodel.planning.device_map"):
        infer_auto_device_map(Layers(1, 1), {0: 100}, verbose=True)
    assert "Device map: {'layers': 0}" in caplog.text
    assert capsys.readouterr().out == ""


def test_clean_device_map_merges_children_sharing_a_device():
    assert clean_device_map({"a.x": 0, "a.y": 0, "b": 1}) == {"a": 0, "b": 1}
    assert clean_device_map({"a.x": 0, "a.y": 0, "b": 0}) == {"": 0}
    assert clean_device_map({"layers.1": 0, "layers.10": 1, "layers.11": 1}) == {
        "layers.1": 0,
        "layers.10": 1,
        "layers.11": 1,
    }
    nested = {"a.x.p": 0, "a.x.q": 0, "a.y": 1, "b.z": 1, "b.w": 1}
    assert clean_device_map(dict(nested), "a") == {"a.x": 0, "a.y": 1, "b.z": 1, "b.w": 1}
    assert clean_device_map(dict(nested)) == {"a.x": 0, "a.y": 1, "b": 1}


def test_check_device_map_names_uncovered_buffers_too():
    model = Blocks(1)
    check_device_map(model, {"": "cpu"})
    with pytest.raises(ValueError, match=r"does not cover 1 parameters/buffers of Blocks: blocks.0.scale"):
        check_device_map(model, {"blocks.0.a": 0, "blocks.0.b": 0})


def test_max_memory_none_plans_over_measured_memory():
    assert infer_auto_device_map(Layers(1)) in ({"layers": 0}, {"layers": "cpu"})


def test_scan_model_agrees_with_sizes_and_ties():
    model = TiedLM()
    assert scan_model(model, None, None) == (compute_module_sizes(model), find_tied_parameters(model))
    special = {"blocks.0.a.weight": torch.float8_e4m3fn}
    assert scan_model(model, torch.float16, special)[0] == compute_module_sizes(model, torch.float16, special)


def test_llama_shaped_transformers_model_keeps_decoder_layers_whole():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
    )
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    sizes = compute_module_sizes(model)
    layer = sizes["model.layers.0"]
    budgets = {0: sizes["model.embed_tokens"] + 2 * layer + layer, 2: 3 * layer, "cpu": 2 * layer, "disk": 10**9}
    device_map = infer_auto_device_map(model, budgets, no_split_module_classes=["LlamaDecoderLayer"])
    check_device_map(model, device_map)
    assert not any(name.startswith("model.layers.") and name.count(".") > 2 for name in device_map)
    assert {0, 2, "cpu"} <= set(device_map.values())
    tied = find_tied_parameters(model)
    for group in tied:
        owners = {next(v for k, v in device_map.items() if n == k or n.startswith(k + ".")) for n in group}
        assert len(owners) == 1


def test_a_spec_naming_no_device_is_caught_as_a_value_error_and_as_torchs_runtime_error():
    """torch raises RuntimeError for an unknown device string, so code written for the incumbent (whose
    maps go to torch) catches RuntimeError; bigmodel's documented ValueError is caught the same way."""
    from bigmodel.core.devices import torch_device

    model = Layers(1, 1)
    for bad in ("gpu", "Disk", "cuda:x"):
        with pytest.raises(RuntimeError, match=f"Device '{bad}' is not a device spec"):
            torch_device(bad)
        with pytest.raises(ValueError, match=f"Device '{bad}' is not a device spec"):
            torch_device(bad)
    with pytest.raises(RuntimeError, match=r"device_map\['layers.1'\]: Device 'gpu' is not a device spec"):
        resolve_device_map(model, {"layers.0": 0, "layers.1": "gpu"})
    if not torch.accelerator.is_available():
        with pytest.raises(RuntimeError, match="names an accelerator but torch sees none"):
            torch_device(0)


def test_numpy_integer_device_indices_are_taken_as_ints():
    """A device map built with numpy (np.argmin over free memory, say) holds numpy integers: accelerate
    takes them; they become plain ints (no other value of the map changes)."""
    np = pytest.importorskip("numpy")
    from bigmodel.core.devices import normalize_device

    assert normalize_device(np.int64(1)) == 1 and type(normalize_device(np.int64(1))) is int
    with pytest.raises(ValueError, match="is negative"):
        normalize_device(np.int32(-1))
    model = Layers(1, 1)
    resolved = resolve_device_map(model, {"layers.0": np.int64(0), "layers.1": "cpu"})
    assert resolved == {"layers.0": 0, "layers.1": "cpu"} and type(resolved["layers.0"]) is int
