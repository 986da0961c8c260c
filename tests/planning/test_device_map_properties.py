"""Invariants of infer_auto_device_map on random module trees and budgets (hypothesis).

The checks below recompute everything from the model itself (tensor bytes = numel * element
size), independently of the planner's own bookkeeping.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from bigmodel import compute_module_sizes, find_tied_parameters, infer_auto_device_map
from bigmodel.planning.fill import scan_model

BLOCK_CLASSES = {name: type(name, (nn.Module,), {}) for name in ("BlockA", "BlockB", "BlockC")}
LEAF = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 6), st.integers(1, 6), st.booleans()),
    st.tuples(st.just("embedding"), st.integers(1, 8), st.integers(1, 4)),
)


def _block(children):
    return st.tuples(
        st.just("block"),
        st.sampled_from(sorted(BLOCK_CLASSES)),
        st.sampled_from(["none", "scalar", "vector", "param"]),
        st.lists(children, min_size=1, max_size=4),
    )


TREE = st.lists(st.recursive(LEAF, _block, max_leaves=12), min_size=1, max_size=5)


def build(spec) -> nn.Module:
    kind = spec[0]
    if kind == "linear":
        return nn.Linear(spec[1], spec[2], bias=spec[3])
    if kind == "embedding":
        return nn.Embedding(spec[1], spec[2])
    _, cls, own, children = spec
    module = BLOCK_CLASSES[cls]()
    if own == "scalar":
        module.register_buffer("scale", torch.ones(()))
    elif own == "vector":
        module.register_buffer("stats", torch.ones(3), persistent=False)
    elif own == "param":
        module.gain = nn.Parameter(torch.ones(2))
    for index, child in enumerate(children):
        module.add_module(f"c{index}", build(child))
    return module


def build_model(top, ties) -> nn.Module:
    model = nn.Module()
    for index, spec in enumerate(top):
        model.add_module(f"m{index}", build(spec))
    holders = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    for a, b in ties:  # planning reads sizes only, so tied tensors need not have matching shapes
        source, target = holders[a % len(holders)], holders[b % len(holders)]
        if source is not target:
            target.weight = source.weight
    return model


@st.composite
def budgets(draw, total: int):
    ids = draw(st.lists(st.integers(0, 3), min_size=0, max_size=4, unique=True))
    limits = {i: draw(st.integers(0, total)) for i in sorted(ids)}
    limits["cpu"] = draw(st.integers(0, 2 * total))
    disk = draw(st.sampled_from(["absent", "ample", "tight"]))  # absent: "disk" is last and unbounded
    if disk == "ample":
        limits["disk"] = 10 * total + 1
    elif disk == "tight":
        limits["disk"] = draw(st.integers(0, total))
    return limits


def owner(name: str, device_map) -> str:
    candidate = name
    while candidate not in device_map:
        if not candidate:
            raise AssertionError(f"{name} is not covered by {device_map}")
        candidate = candidate.rpartition(".")[0] if "." in candidate else ""
    return candidate


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def layer_bytes(module: nn.Module) -> int:
    unique = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(tensor_bytes(t) for t in unique.values())


def check_invariants(model, device_map, limits, no_split, offload_buffers) -> None:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    keys = list(device_map)
    # Covered exactly once: every tensor has an owning entry, and no entry lies inside another.
    assert not any(k != j and (not k or j.startswith(k + ".")) for k in keys for j in keys), device_map
    assert set(device_map.values()) <= set(limits), (device_map, limits)
    device_of = {name: device_map[owner(name, device_map)] for name, _ in named}
    # Budgets: bytes of distinct tensors per device.
    used: dict[object, int] = {}
    seen: set[int] = set()
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            used[device_of[name]] = used.get(device_of[name], 0) + tensor_bytes(tensor)
    for device, size in used.items():
        assert size <= limits[device], (device, size, limits, device_map)
    # Ties share a device.
    for group in find_tied_parameters(model):
        assert len({device_of[name] for name in group}) == 1, (group, device_map)
    # No-split modules are never split.
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if type(module).__name__ in no_split:
            assert not any(k.startswith(name + ".") for k in keys), (name, device_map)
    check_offload_room(model, device_map, limits, no_split, offload_buffers, used, modules)


def largest_layer(name: str, module: nn.Module | None, no_split) -> int:
    if module is None:
        return 0
    if not module._modules or type(module).__name__ in no_split:
        return layer_bytes(module)
    own = sum(tensor_bytes(t) for t in [*module._parameters.values(), *module._buffers.values()] if t is not None)
    return max([own, *(largest_layer(n, m, no_split) for n, m in module.named_children())])


def check_offload_room(model, device_map, limits, no_split, offload_buffers, used, modules) -> None:
    accelerators = [d for d in limits if isinstance(d, int) and d in device_map.values()]
    execution = accelerators[0] if accelerators else "cpu"
    if execution not in limits:
        return
    offloaded = ("cpu", "disk") if isinstance(execution, int) else ("disk",)
    need, buffers, any_offloaded = 0, 0, False
    tensors = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    buffer_names = {name for name, _ in model.named_buffers()}
    for key, device in device_map.items():
        if device not in offloaded:
            continue
        any_offloaded = True
        if key in modules:
            need = max(need, largest_layer(key, modules[key], no_split))
            buffers += sum(tensor_bytes(b) for b in modules[key].buffers())
        else:
            need = max(need, tensor_bytes(tensors[key]))
            buffers += tensor_bytes(tensors[key]) if key in buffer_names else 0
    if not any_offloaded:
        return
    need += 0 if offload_buffers else buffers
    room = limits[execution] - used.get(execution, 0)
    # The cpu may be unable to keep the room at all (its budget is below it): then it holds nothing.
    assert room >= need or (execution == "cpu" and used.get("cpu", 0) == 0), (execution, room, need, device_map)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    top=TREE,
    ties=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=2),
    no_split=st.sets(st.sampled_from(sorted(BLOCK_CLASSES)), max_size=2),
    offload_buffers=st.booleans(),
    fallback=st.booleans(),
    data=st.data(),
)
def test_plans_keep_every_invariant(top, ties, no_split, offload_buffers, fallback, data):
    model = build_model(top, ties)
    total = compute_module_sizes(model)[""]
    limits = data.draw(budgets(total))
    present = {type(m).__name__ for m in model.modules()}
    no_split_list = sorted(no_split & present)
    try:
        device_map = infer_auto_device_map(
            model, limits, no_split_list, offload_buffers=offload_buffers, fallback_allocation=fallback
        )
    except ValueError as err:
        assert limits.get("disk", math.inf) < total, limits
        assert "fits on no device" in str(err)
        assert 'Raise the "disk" budget' in str(err)
        return
    check_invariants(model, device_map, {**limits, "disk": limits.get("disk", math.inf)}, set(no_split_list), offload_buffers)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(top=TREE, ties=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=2))
def test_scan_model_matches_compute_module_sizes_and_find_tied_parameters(top, ties):
    model = build_model(top, ties)
    assert scan_model(model, None, None) == (compute_module_sizes(model), find_tied_parameters(model))
    assert scan_model(model, torch.float16, None)[0] == compute_module_sizes(model, dtype=torch.float16)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(top=TREE, data=st.data())
def test_with_disk_every_model_gets_a_plan(top, data):
    model = build_model(top, [])
    total = compute_module_sizes(model)[""]
    limits = data.draw(budgets(total))
    limits["disk"] = total
    device_map = infer_auto_device_map(model, limits)
    check_invariants(model, device_map, limits, set(), False)


@pytest.mark.parametrize("ids", [(0, 2), (1, 3), (0, 1, 3), (2,)])
def test_gap_ids_plans_keep_every_invariant(ids):
    model = build_model([("block", "BlockA", "scalar", [("linear", 4, 4, True)] * 3)] * 6, [(0, 17)])
    total = compute_module_sizes(model)[""]
    limits = {i: total // 2 for i in ids} | {"cpu": total // 4, "disk": 10 * total}
    device_map = infer_auto_device_map(model, limits, ["BlockA"])
    check_invariants(model, device_map, limits, {"BlockA"}, False)
    assert set(ids[:2]) <= set(device_map.values())
