"""use_bigmodel(): what it replaces, where, and that undoing it restores every attribute exactly."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import accelerate
import accelerate.big_modeling
import accelerate.hooks
import accelerate.utils
import pytest
import torch

import bigmodel
from bigmodel.integrations import ecosystem, use_bigmodel

CONSUMERS = [
    ("transformers.integrations.accelerate", "dispatch_model"),
    ("transformers.integrations.accelerate", "accelerate_max_memory"),  # imported under another name
    ("transformers.integrations.accelerate", "clean_device_map"),
    ("transformers.integrations.accelerate", "get_max_layer_size"),
    ("transformers.integrations.peft", "dispatch_model"),
    ("transformers.modeling_utils", "add_hook_to_module"),
    ("transformers.generation.utils", "AlignDevicesHook"),
    ("diffusers.models.modeling_utils", "dispatch_model"),
    ("diffusers.models.modeling_utils", "save_offload_index"),
    ("diffusers.models.modeling_utils", "load_offloaded_weights"),
    ("diffusers.models.model_loading_utils", "infer_auto_device_map"),
    ("diffusers.models.model_loading_utils", "set_module_tensor_to_device"),
    ("diffusers.models.model_loading_utils", "offload_weight"),
    ("diffusers.pipelines.pipeline_loading_utils", "get_max_memory"),
    ("peft.peft_model", "dispatch_model"),
    ("peft.peft_model", "infer_auto_device_map"),
    ("peft.peft_model", "AlignDevicesHook"),
    ("peft.tuners.tuners_utils", "named_module_tensors"),
    ("peft.tuners.tuners_utils", "offload_state_dict"),
    ("peft.utils.other", "add_hook_to_module"),
]
NOT_PATCHED = [  # accelerate's training side and generic helpers stay accelerate's
    ("accelerate", "Accelerator"),
    ("accelerate", "PartialState"),
    ("accelerate.utils", "send_to_device"),
    ("accelerate.utils", "extract_model_from_parallel"),
    ("accelerate.utils", "CustomDtype"),
]


def snapshot() -> dict[tuple[str, str], object]:
    """Every patched accelerate attribute, every consumer attribute above, and the untouched names."""
    names = [(m, n) for m, names in ecosystem.PATCH_TABLE.items() for n in names] + CONSUMERS + NOT_PATCHED
    return {(m, n): vars(importlib.import_module(m)).get(n, "<absent>") for m, n in names}


@pytest.fixture(scope="module", autouse=True)
def consumers_imported() -> None:
    for module, _ in CONSUMERS:
        importlib.import_module(module)


def test_patch_table_names_exist_in_accelerate_and_in_bigmodel() -> None:
    assert ecosystem.PATCH_TABLE, "the table lists what is replaced"
    for module, names in ecosystem.PATCH_TABLE.items():
        for name in names:
            assert hasattr(importlib.import_module(module), name), (module, name)
            assert hasattr(bigmodel, name), name


def test_on_replaces_accelerate_and_consumer_names_and_undo_restores_them_exactly() -> None:
    before = snapshot()
    patch = use_bigmodel()
    try:
        assert patch.active
        for module, names in ecosystem.PATCH_TABLE.items():
            for name in names:
                assert getattr(importlib.import_module(module), name) is getattr(bigmodel, name), (module, name)
        for module, name in CONSUMERS:
            value = getattr(importlib.import_module(module), name)
            assert type(value).__module__.startswith("bigmodel") or value.__module__.startswith("bigmodel"), (
                module,
                name,
            )
        for module, name in NOT_PATCHED:
            assert vars(importlib.import_module(module))[name] is before[(module, name)], (module, name)
    finally:
        patch.undo()
    assert not patch.active
    after = snapshot()
    assert after.keys() == before.keys()
    changed = [key for key in before if after[key] is not before[key]]
    assert changed == []


def test_bigmodel_hook_classes_accelerate_lacks_are_there_while_on() -> None:
    # peft and diffusers rebuild a hook with getattr(accelerate.hooks, type(hook).__name__).
    assert not hasattr(accelerate.hooks, "PinnedCpuOffload")
    with use_bigmodel():
        assert accelerate.hooks.PinnedCpuOffload.__module__ == "bigmodel.hooks.cpu_offload"
    assert not hasattr(accelerate.hooks, "PinnedCpuOffload")


def test_a_name_replaced_again_after_switching_on_is_left_to_its_owner(caplog: pytest.LogCaptureFixture) -> None:
    original = accelerate.big_modeling.check_device_map

    def theirs(*args, **kwargs) -> None:
        return None

    patch = use_bigmodel()
    try:
        accelerate.big_modeling.check_device_map = theirs  # e.g. a library patching it while a model loads
        patch.undo()
        assert accelerate.big_modeling.check_device_map is theirs
        assert "accelerate.big_modeling.check_device_map was replaced again" in caplog.text
    finally:
        accelerate.big_modeling.check_device_map = original
        patch.undo()


def test_context_manager_nesting_and_double_undo() -> None:
    original = accelerate.dispatch_model
    with use_bigmodel() as outer:
        with use_bigmodel() as inner:
            assert accelerate.dispatch_model is bigmodel.dispatch_model
        assert not inner.active
        assert accelerate.dispatch_model is bigmodel.dispatch_model  # the outer one still holds
        inner.undo()  # a second undo of the same handle does nothing
        assert accelerate.dispatch_model is bigmodel.dispatch_model
    assert not outer.active
    assert accelerate.dispatch_model is original
    assert not ecosystem.is_active()


def test_accelerate_training_side_still_works_while_active() -> None:
    with use_bigmodel():
        assert accelerate.Accelerator.__module__ == "accelerate.accelerator"
        accelerator = accelerate.Accelerator(cpu=True)
        assert accelerate.PartialState().num_processes == 1
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = accelerator.prepare(model, optimizer)
        before = model.weight.detach().clone()
        accelerator.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        assert torch.equal(model.weight.detach(), before - 0.5)  # d(sum)/dW = 1 for an input of ones


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_called_before_the_libraries_are_imported_then_undone() -> None:
    out = _run(
        "import sys, bigmodel\n"
        "from bigmodel.integrations import use_bigmodel\n"
        "assert 'transformers' not in sys.modules and 'peft' not in sys.modules\n"
        "patch = use_bigmodel()\n"
        "import transformers.integrations.accelerate as hf, peft.peft_model as pm, diffusers.models.modeling_utils as dm\n"
        "assert hf.dispatch_model is bigmodel.dispatch_model and pm.AlignDevicesHook is bigmodel.AlignDevicesHook\n"
        "assert dm.save_offload_index is bigmodel.save_offload_index\n"
        "patch.undo()\n"
        "import accelerate, accelerate.hooks, accelerate.utils\n"
        "assert hf.dispatch_model is accelerate.dispatch_model and accelerate.dispatch_model.__module__ == 'accelerate.big_modeling'\n"
        "assert pm.AlignDevicesHook is accelerate.hooks.AlignDevicesHook and accelerate.hooks.AlignDevicesHook.__module__ == 'accelerate.hooks'\n"
        "assert dm.save_offload_index is accelerate.utils.save_offload_index\n"
        "print('ok')\n"
    )
    assert out.strip() == "ok"


def test_not_called_leaves_the_libraries_alone() -> None:
    out = _run(
        "import sys, bigmodel, bigmodel.integrations\n"
        "[getattr(bigmodel, n) for n in bigmodel.__all__]\n"
        "assert 'accelerate' not in sys.modules, 'importing bigmodel imported accelerate'\n"
        "import transformers.integrations.accelerate as hf, peft.peft_model as pm\n"
        "assert hf.dispatch_model.__module__ == 'accelerate.big_modeling'\n"
        "assert pm.infer_auto_device_map.__module__ == 'accelerate.utils.modeling'\n"
        "print('ok')\n"
    )
    assert out.strip() == "ok"


def test_installed_files_are_never_written() -> None:
    roots = [Path(importlib.import_module(p).__file__).parent for p in ("accelerate", "transformers", "diffusers", "peft")]

    def state() -> dict[Path, tuple[int, int]]:
        return {
            p: (p.stat().st_mtime_ns, p.stat().st_size)
            for root in roots
            for p in root.rglob("*.py")
        }

    before = state()
    with use_bigmodel():
        importlib.import_module("diffusers.pipelines.pipeline_utils")
    assert state() == before
