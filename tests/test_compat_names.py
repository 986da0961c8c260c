"""The names transformers, diffusers and peft import from accelerate's big-model API exist on the
same path in bigmodel, and the helpers added for them behave as accelerate's do.

The import list is read from the installed libraries' sources, so a new import in a new
release fails here until bigmodel has the name (or it is listed as training-side below).
"""

from __future__ import annotations

import ast
import collections
import gc
import importlib
import json
import weakref
from pathlib import Path
from typing import NamedTuple

import accelerate.utils
import pytest
import torch
from torch import nn

import bigmodel
import bigmodel.hooks
import bigmodel.utils
import bigmodel.utils.memory
import bigmodel.utils.modeling
import bigmodel.utils.offload

# accelerate names these libraries import that belong to training, distributed setup,
# configuration or backend detection: outside the big-model API bigmodel mirrors.
TRAINING_SIDE = {
    "accelerate": {"Accelerator", "FullyShardedDataParallelPlugin", "ParallelismConfig", "PartialState",
                   "skip_first_batches"},
    "accelerate.utils": {"DataLoaderConfiguration", "DeepSpeedPlugin", "DeepSpeedSchedulerWrapper",
                         "DistributedDataParallelKwargs", "DistributedType", "DummyOptim", "DummyScheduler",
                         "FullyShardedDataParallelPlugin", "GradientAccumulationPlugin", "TorchDynamoPlugin",
                         "find_executable_batch_size", "is_mlu_available", "is_npu_available", "is_xpu_available",
                         "load_fsdp_model", "load_fsdp_optimizer", "reduce", "release_memory", "save_fsdp_model",
                         "save_fsdp_optimizer"},
    "accelerate.utils.memory": {"release_memory", "should_reduce_batch_size"},
    "accelerate.utils.constants": {"FSDP_AUTO_WRAP_POLICY", "FSDP_SHARDING_STRATEGY"},
}  # fmt: skip
TRAINING_MODULES = {"accelerate.commands.config", "accelerate.logging", "accelerate.parallelism_config",
                    "accelerate.state", "accelerate.utils.dataclasses", "accelerate.utils.deepspeed",
                    "accelerate.utils.imports"}  # fmt: skip


def ecosystem_imports() -> dict[tuple[str, str], set[str]]:
    """(accelerate module, name) → the libraries that import it, from their installed sources."""
    found: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for package in ("transformers", "diffusers", "peft"):
        root = Path(importlib.import_module(package).__file__).parent
        for path in root.rglob("*.py"):
            source = path.read_text(encoding="utf-8")
            if "accelerate" not in source:
                continue
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("accelerate"):
                    for alias in node.names:
                        found[(node.module, alias.name)].add(package)
    return found


def test_every_big_model_name_the_ecosystem_imports_exists_on_the_same_path() -> None:
    imports = ecosystem_imports()
    assert ("accelerate.utils", "save_offload_index") in imports  # the scan does see the libraries' imports
    missing = []
    for module, name in sorted(imports):
        if module in TRAINING_MODULES or name in TRAINING_SIDE.get(module, ()):
            continue
        mirror = importlib.import_module("bigmodel" + module.removeprefix("accelerate"))
        if not hasattr(mirror, name):
            missing.append(f"{mirror.__name__}.{name} (imported by {sorted(imports[(module, name)])})")
    assert missing == []


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("utils", "save_offload_index"), ("utils.offload", "save_offload_index"),
        ("utils", "load_offloaded_weights"), ("utils.modeling", "load_offloaded_weights"),
        ("utils", "send_to_device"), ("utils", "CustomDtype"),
        ("utils.memory", "clear_device_cache"), ("hooks", "get_non_persistent_buffers"),
        ("big_modeling", "check_device_map"),
    ],
)  # fmt: skip
def test_name_on_the_incumbents_path(path: str, name: str) -> None:
    assert hasattr(importlib.import_module(f"accelerate.{path}"), name)  # the path is the incumbent's
    value = getattr(importlib.import_module(f"bigmodel.{path}"), name)
    assert value is getattr(bigmodel, name)


# ---- save_offload_index / load_offloaded_weights -------------------------------------------


def test_save_offload_index_merges_into_an_existing_index_like_accelerate(tmp_path: Path) -> None:
    first = {"a.weight": {"dtype": "float32", "shape": [2, 3]}}
    second = {"b.bias": {"dtype": "bfloat16", "shape": [4]}, "a.weight": {"dtype": "float16", "shape": [2, 3]}}
    for lib, folder in ((accelerate.utils, tmp_path / "acc"), (bigmodel.utils, tmp_path / "big")):
        folder.mkdir()
        lib.save_offload_index(first, str(folder))
        lib.save_offload_index(second, folder)
        lib.save_offload_index({}, folder)  # nothing to save
        lib.save_offload_index(None, folder)
    assert json.loads((tmp_path / "big" / "index.json").read_text()) == {**first, **second}
    assert json.loads((tmp_path / "big" / "index.json").read_text()) == json.loads(
        (tmp_path / "acc" / "index.json").read_text()
    )


def test_save_offload_index_with_nothing_writes_nothing(tmp_path: Path) -> None:
    bigmodel.utils.save_offload_index({}, tmp_path)
    bigmodel.utils.save_offload_index(None, tmp_path)
    assert list(tmp_path.iterdir()) == []


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("scale", torch.arange(4, dtype=torch.bfloat16))


def test_load_offloaded_weights_fills_a_meta_model_on_cpu(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = Pair()
    index: dict = {}
    for name, tensor in source.state_dict().items():
        index = bigmodel.utils.offload_weight(tensor, name, tmp_path, index)
    bigmodel.utils.save_offload_index(index, tmp_path)
    for lib in (bigmodel.utils, accelerate.utils):
        with bigmodel.init_empty_weights(include_buffers=True):
            model = Pair()
        assert lib.load_offloaded_weights(model, index, str(tmp_path)) is None
        for name, tensor in source.state_dict().items():
            loaded = model.state_dict()[name]
            assert loaded.device.type == "cpu" and loaded.dtype == tensor.dtype and torch.equal(loaded, tensor), name
        assert isinstance(model.lin.weight, nn.Parameter)
    bigmodel.utils.load_offloaded_weights(model, {}, tmp_path)  # nothing to load is fine
    bigmodel.utils.load_offloaded_weights(model, None, tmp_path)


def test_load_offloaded_weights_names_a_missing_file(tmp_path: Path) -> None:
    with bigmodel.init_empty_weights():
        model = Pair()
    index = {"lin.weight": {"dtype": "float32", "shape": [2, 3]}}
    with pytest.raises((FileNotFoundError, ValueError), match="lin.weight"):
        bigmodel.utils.load_offloaded_weights(model, index, tmp_path)


# ---- send_to_device -------------------------------------------------------------------------


class Point(NamedTuple):
    x: torch.Tensor
    label: str


class HasTo:
    def __init__(self) -> None:
        self.moved_to = None

    def to(self, device, non_blocking=False):  # noqa: ANN001 - the duck-typed protocol
        self.moved_to = (device, non_blocking)
        return self


def test_send_to_device_matches_accelerate_on_nested_data() -> None:
    data = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": Point(torch.ones(1), "p"), "c": "text", "d": None}
    for skip in (None, "a", ["a", "b"]):
        ours = bigmodel.utils.send_to_device(data, "meta", skip_keys=skip)
        theirs = accelerate.utils.send_to_device(data, "meta", skip_keys=skip)
        assert type(ours) is type(theirs) is dict
        assert type(ours["b"]) is Point and ours["b"].label == "p"
        assert type(ours["a"][1]) is tuple and ours["a"][1][1] == 3
        for key in "ab":
            mine, incumbent = ours[key], theirs[key]
            flat_mine = [mine[0], mine[1][0]] if key == "a" else [mine.x]
            flat_theirs = [incumbent[0], incumbent[1][0]] if key == "a" else [incumbent.x]
            assert [t.device for t in flat_mine] == [t.device for t in flat_theirs], (skip, key)
        assert ours["c"] == "text" and ours["d"] is None


def test_send_to_device_uses_the_to_method_of_other_objects() -> None:
    thing = HasTo()
    assert bigmodel.utils.send_to_device(thing, "cpu", non_blocking=True) is thing
    assert thing.moved_to == ("cpu", True)


# ---- CustomDtype ----------------------------------------------------------------------------


def test_custom_dtype_members_and_sizes() -> None:
    assert {m.name: m.value for m in bigmodel.utils.CustomDtype} == {
        m.name: m.value for m in accelerate.utils.CustomDtype
    }
    for lib_dtype in (bigmodel.utils.CustomDtype, accelerate.utils.CustomDtype):  # diffusers passes accelerate's
        assert bigmodel.dtype_byte_size(lib_dtype.INT4) == 0.5
        assert bigmodel.dtype_byte_size(lib_dtype.INT2) == 0.25
        assert bigmodel.dtype_byte_size(lib_dtype.FP8) == 1
    model = nn.Linear(64, 64, bias=False)
    assert bigmodel.compute_module_sizes(model, dtype=accelerate.utils.CustomDtype.INT4)[""] == 64 * 64 // 2
    device_map = bigmodel.infer_auto_device_map(
        nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), max_memory={"cpu": 5000},
        dtype=bigmodel.utils.CustomDtype.INT4,
    )  # fmt: skip
    assert device_map == {"": "cpu"}  # 2 x 2,080 bytes at 4 bits fit in 5,000 bytes


# ---- clear_device_cache ---------------------------------------------------------------------


class Node:
    pass


def test_clear_device_cache_collects_garbage_only_when_asked() -> None:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        node = Node()
        node.cycle = node
        alive = weakref.ref(node)
        del node
        bigmodel.utils.memory.clear_device_cache()
        assert alive() is not None  # no collection without garbage_collection=True
        bigmodel.utils.memory.clear_device_cache(garbage_collection=True)
        assert alive() is None
    finally:
        if was_enabled:
            gc.enable()


def test_get_non_persistent_buffers_from_hooks_path() -> None:
    model = nn.Module()
    model.register_buffer("kept", torch.ones(1))
    model.register_buffer("cache", torch.ones(1), persistent=False)
    assert bigmodel.hooks.get_non_persistent_buffers(model) == {"cache"}
