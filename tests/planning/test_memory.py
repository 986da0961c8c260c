import pytest
import torch
from torch import nn

from bigmodel import compute_module_sizes, get_balanced_memory, get_max_memory
from bigmodel.core.devices import accelerator_count


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(250))  # 1000 bytes


class Stack(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(n)])


def test_detected_budgets_measure_cpu_and_every_accelerator():
    budgets = get_max_memory()
    assert budgets["cpu"] > 0
    assert [key for key in budgets if isinstance(key, int)] == list(range(accelerator_count()))
    assert list(budgets)[-1] == "cpu"


def test_given_budgets_are_converted_normalised_and_ordered():
    budgets = get_max_memory({"cpu": 10, "disk": "1KB", "cuda:2": "500MB", 0: "1GiB", torch.device("cuda", 1): "2kib"})
    assert budgets == {0: 2**30, 1: 2048, 2: 500 * 10**6, "cpu": 10, "disk": 1000}
    assert list(budgets) == [0, 1, 2, "cpu", "disk"]


@pytest.mark.parametrize("key", ["gpu", "gpu0", "cuda:x", -1, "meta", True])
def test_unknown_budget_key_names_the_key_and_the_accepted_forms(key):
    with pytest.raises(ValueError, match=r"max_memory key .* is not a device; use an accelerator index"):
        get_max_memory({key: 100, "cpu": 100})


def test_unparseable_budget_names_the_device_and_the_value():
    with pytest.raises(ValueError, match=r"max_memory\[0\]: Size '10 GiBs' is not a memory size.*'10GiB'"):
        get_max_memory({0: "10 GiBs"})


def test_same_device_twice_is_rejected():
    with pytest.raises(ValueError, match="names device 0 twice"):
        get_max_memory({0: 10, "cuda:0": 20})


def test_balanced_budgets_spread_the_model_and_leave_the_last_accelerator_whole():
    model = Stack(8)  # 8000 bytes, largest layer 1000
    budgets = get_balanced_memory(model, {0: 10**6, 1: 10**6, "cpu": 5})
    # even share 4000 + 1.25 * largest layer 1000
    assert budgets == {0: 5250, 1: 10**6, "cpu": 5}


def test_balanced_budgets_work_with_gaps_in_accelerator_ids():
    budgets = get_balanced_memory(Stack(8), {0: 10**6, 2: 10**6, 3: 10**6, "cpu": 5})
    share = 8000 // 3 + 1250  # the even share rounds down, as accelerate's does
    assert budgets == {0: share, 2: share, 3: 10**6, "cpu": 5}


def test_balanced_low_zero_keeps_the_first_accelerator_for_what_others_cannot_hold():
    model = Stack(8)
    assert get_balanced_memory(model, {0: 10**6, 1: 10**6, 2: 10**6}, low_zero=True)[0] == 0
    budgets = get_balanced_memory(model, {0: 10**6, 2: 3000, 3: 3000, "cpu": 0}, low_zero=True)
    assert budgets == {0: 2000, 2: 3000, 3: 3000, "cpu": 0}


def test_balanced_budgets_use_dtype_sizes():
    model = Stack(8)
    half = get_balanced_memory(model, {0: 10**6, 1: 10**6}, dtype=torch.float16)
    assert half[0] == 2000 + 625
    assert compute_module_sizes(model, dtype=torch.float16)[""] == 4000


def test_balanced_budgets_with_one_or_no_accelerator_are_unchanged():
    assert get_balanced_memory(Stack(2), {0: 123, "cpu": 456}) == {0: 123, "cpu": 456}
    assert get_balanced_memory(Stack(2), {"cpu": 456, "disk": 9}) == {"cpu": 456, "disk": 9}
    assert get_balanced_memory(Stack(2), {0: 0, 1: 500, "cpu": 1}) == {0: 0, 1: 500, "cpu": 1}


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Layer()
        self.b = Layer()


class Pairs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pairs = nn.ModuleList([Pair() for _ in range(4)])


def test_balanced_slack_counts_no_split_modules_whole():
    model = Pairs()  # 8000 bytes; a Pair is 2000 bytes, a Layer 1000
    assert get_balanced_memory(model, {0: 10**6, 1: 10**6})[0] == 4000 + 1250
    assert get_balanced_memory(model, {0: 10**6, 1: 10**6}, ["Pair"])[0] == 4000 + 2500
    assert get_balanced_memory(model, {0: 10**6, 1: 10**6}, "Pair")[0] == 4000 + 2500


def test_budgets_for_accelerators_this_machine_lacks_are_warned_about(caplog):
    absent = accelerator_count() + 4093  # an index no other test names (the warning is given once per process)
    with caplog.at_level("WARNING", logger="bigmodel.planning.memory"):
        assert get_max_memory({absent: "1GB", "cpu": 100}) == {absent: 10**9, "cpu": 100}  # still planned for
    assert caplog.text.count(f"names accelerator(s) [{absent}], which this machine does not have") == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="bigmodel.planning.memory"):
        get_max_memory({absent: "2GB", "cpu": 100})  # a plan asks again: said once already
        get_max_memory({"cpu": 100, "disk": 10})
    assert caplog.text == ""
