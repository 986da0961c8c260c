"""get_max_memory converts the caller's size strings to ints in place, as the incumbent does.

transformers calls ``get_max_memory(max_memory)`` and then compares ``max_memory[device]``
with ints, so ``from_pretrained(device_map="auto", max_memory={"cpu": "10GiB"})`` needs the
caller's dict converted.
"""

from __future__ import annotations

import accelerate.utils
import pytest
from torch import nn

from bigmodel import get_balanced_memory, get_max_memory, infer_auto_device_map


@pytest.mark.parametrize(
    "budgets",
    [{"cpu": "10GiB"}, {"cpu": "1.5GB", "disk": "1000GB"}, {"cpu": 5, "disk": "2KiB"}, {0: "1GB", "cpu": "500MB"}],
)
def test_strings_become_ints_in_the_callers_dict_like_the_incumbent(budgets: dict) -> None:
    ours, theirs = dict(budgets), dict(budgets)
    result = get_max_memory(ours)
    accelerate.utils.get_max_memory(theirs)
    assert ours == theirs
    assert all(isinstance(v, int) for v in ours.values())
    assert result == ours
    assert result is not ours  # a new, ordered dict is returned; the caller's keeps its keys


def test_keys_keep_the_callers_spelling() -> None:
    budgets = {"cuda:0": "1KB", "cpu": "2KB"}
    assert get_max_memory(budgets) == {0: 1000, "cpu": 2000}
    assert budgets == {"cuda:0": 1000, "cpu": 2000}


def test_a_bad_size_leaves_the_callers_dict_unchanged() -> None:
    budgets = {"cpu": "2KB", "disk": "lots"}
    with pytest.raises(ValueError, match=r"max_memory\['disk'\]: Size 'lots'"):
        get_max_memory(budgets)
    assert budgets == {"cpu": "2KB", "disk": "lots"}


def test_planning_functions_convert_in_place_too() -> None:
    model = nn.Linear(4, 4)
    budgets = {"cpu": "1KB"}
    get_balanced_memory(model, max_memory=budgets)
    assert budgets == {"cpu": 1000}
    budgets = {"cpu": "1KB"}
    infer_auto_device_map(model, max_memory=budgets)
    assert budgets == {"cpu": 1000}
