"""``no_split_module_classes`` given as classes plans as with their names; other entries are refused.

accelerate 1.15 compares each entry with ``type(module).__name__``, so a class object matches
nothing and the modules are split without a word; bigmodel takes a class for its name.
"""

from __future__ import annotations

import pytest
from torch import nn

from bigmodel import get_balanced_memory, infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])


def _net() -> Net:
    with init_empty_weights():
        return Net()


@pytest.mark.parametrize("given", [[Block], Block, (Block,), [Block, "Block"]])
def test_a_class_object_plans_as_its_name(given: object) -> None:
    by_name = infer_auto_device_map(_net(), max_memory={"cpu": 700}, no_split_module_classes=["Block"])
    assert "blocks.0.a" not in by_name  # the block is not split
    assert infer_auto_device_map(_net(), max_memory={"cpu": 700}, no_split_module_classes=given) == by_name


@pytest.mark.parametrize("entry", [None, 3, Block()])
def test_an_entry_that_is_no_class_is_refused_naming_it(entry: object) -> None:
    with pytest.raises(TypeError, match=r"no_split_module_classes holds .* which is not a class name; give module"):
        infer_auto_device_map(_net(), max_memory={"cpu": 700}, no_split_module_classes=["Block", entry])


def test_balanced_budgets_count_a_class_object_like_its_name() -> None:
    budgets = {0: 10**6, 1: 10**6, "cpu": 10**6}
    by_name = get_balanced_memory(_net(), dict(budgets), ["Block"])
    assert get_balanced_memory(_net(), dict(budgets), [Block]) == by_name


def test_load_checkpoint_and_dispatch_takes_a_class(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in Net().state_dict().items()}, tmp_path / "model.safetensors")
    model = load_checkpoint_and_dispatch(
        _net(), tmp_path, device_map="auto", max_memory={"cpu": 700}, no_split_module_classes=[Block],
        offload_folder=tmp_path / "offload",
    )  # fmt: skip
    assert "blocks.0.a" not in model.hf_device_map
