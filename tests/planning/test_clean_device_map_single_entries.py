"""clean_device_map merges a module's entries only when there are at least two of them.

accelerate 1.15 merges the entries under a module when they share one device *and* there is more
than one of them; a module reached by a single entry (a one-child wrapper, a ModuleList of one
block, a single-child model) keeps that entry's key. The keys of the map are observable
(``model.hf_device_map``, maps saved and reloaded, code indexing the map by module name).
"""

import accelerate.utils.modeling as incumbent
import pytest
import torch
from torch import nn

from bigmodel import clean_device_map, infer_auto_device_map


class Leaf(nn.Module):
    def __init__(self, numel: int = 250) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))  # 4 * numel bytes


class Wrapper(nn.Module):
    """One child only: a ModuleList holding one leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([Leaf()])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Leaf()
        self.b = Wrapper()
        self.c = Leaf()
        self.d = Leaf()


MAPS = [
    {"a": "cpu", "b.inner.0": "disk", "c.x": "disk", "c.y": "disk"},
    {"b.inner.0.lin": "disk"},
    {"a.x": "cpu", "a.y": "cpu"},
    {"a.x.p": 0, "a.x.q": 0, "a.y": 1, "b.z": 1, "b.w": 1},
    {"a.x.p": 0, "a.y": 0, "b.z.q": 1},
    {"layers.1": 0, "layers.10": 1, "layers.11": 1},
    {"": "cpu"},
]


def test_a_single_entry_under_a_module_keeps_its_key():
    assert clean_device_map({"a": "cpu", "b.inner.0": "disk", "c.x": "disk", "c.y": "disk"}) == {
        "a": "cpu",
        "b.inner.0": "disk",
        "c": "disk",
    }
    assert clean_device_map({"b.inner.0.lin": "disk"}) == {"b.inner.0.lin": "disk"}
    assert clean_device_map({"a.x": "cpu", "a.y": "cpu"}) == {"": "cpu"}


@pytest.mark.parametrize("device_map", MAPS)
@pytest.mark.parametrize("module_name", ["", "a", "b"])
def test_clean_device_map_gives_the_incumbents_entries(device_map, module_name):
    expected = dict(incumbent.clean_device_map(dict(device_map), module_name))
    assert clean_device_map(dict(device_map), module_name) == expected


@pytest.mark.parametrize("budget", [400, 600, 1600, 2400, 10_000])
@pytest.mark.parametrize("no_split", [None, ["Leaf"]])
def test_planned_maps_keep_single_child_keys_as_the_incumbent_does(budget, no_split):
    expected = dict(incumbent.infer_auto_device_map(Net(), {"cpu": budget}, no_split_module_classes=no_split))
    assert infer_auto_device_map(Net(), {"cpu": budget}, no_split_module_classes=no_split) == expected


def test_a_model_with_one_child_on_one_device_is_that_childs_entry():
    model = nn.Sequential(nn.Linear(4, 4))
    assert infer_auto_device_map(model, {"cpu": 10**6}) == {"0": "cpu"}
    assert dict(incumbent.infer_auto_device_map(model, {"cpu": 10**6})) == {"0": "cpu"}


def test_the_planned_map_is_of_the_incumbents_type_in_module_order():
    """accelerate returns an ``OrderedDict``: code that checks the type (or calls ``move_to_end``) sees the same."""
    ours, theirs = infer_auto_device_map(Net(), {"cpu": 600}), incumbent.infer_auto_device_map(Net(), {"cpu": 600})
    assert type(ours) is type(theirs)
    assert list(ours.items()) == list(theirs.items())
