"""The offload paths of the differential harness (helper, not a test module).

A path is a sequence of :class:`Step`.  Each step draws its choices once (device map,
``offload_buffers``, storage dtype ...), then changes the offloaded model and, for the
steps that change what a model computes (layerwise casting, loading a checkpoint in
another dtype), the reference model the same way without offloading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _differential_models import ModelCase
from safetensors.torch import save_model
from torch import nn

import bigmodel

# --- drawing choices -----------------------------------------------------------------------


@dataclass
class Choices:
    """Where a step's choices come from: hypothesis (``draw``), or fixed (``draw=None``: the first
    option, and flags alternating True/False, for the strict-xfail witnesses)."""

    draw: Callable[[Any], Any] | None = None
    log: dict[str, Any] = field(default_factory=dict)

    def flags(self, name: str, count: int) -> list[bool]:
        if self.draw is None:
            values = [i % 2 == 0 for i in range(count)]
        else:
            from hypothesis import strategies as st

            values = self.draw(st.lists(st.booleans(), min_size=count, max_size=count))
        self.log[name] = values
        return values

    def pick(self, name: str, options: tuple[Any, ...]) -> Any:
        if self.draw is None:
            value = options[0]
        else:
            from hypothesis import strategies as st

            value = self.draw(st.sampled_from(options))
        self.log[name] = value
        return value


@dataclass
class StepContext:
    case: ModelCase
    choices: Choices
    tmp: Path
    count: int = 0

    def folder(self, what: str) -> Path:
        self.count += 1
        path = self.tmp / f"{self.count}-{what}"
        path.mkdir()
        return path


# --- device maps ------------------------------------------------------------------------------


def _has_direct_tensors(module: nn.Module) -> bool:
    return bool(module._parameters) or bool(module._buffers)


def map_keys(model: nn.Module, no_split: tuple[str, ...], leaf: bool) -> list[str]:
    """Device-map keys covering ``model``: blocks (no-split classes kept whole) or leaf modules.

    A module with tensors of its own and children is kept whole (except the root, whose own
    tensors become keys of their own: ``check_device_map`` wants every tensor covered).
    """
    keys: list[str] = []

    def visit(name: str, module: nn.Module) -> None:
        children = list(module.named_children())
        whole = not children or (not leaf and type(module).__name__ in no_split)
        if whole or (name and _has_direct_tensors(module)):
            keys.append(name)
            return
        if not name:  # the root's own tensors, non-persistent buffers included (as infer_auto_device_map does)
            keys.extend(n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)))
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return keys


def drawn_map(model: nn.Module, ctx: StepContext, granularity: str, keep_ties: bool = False) -> dict[str, str]:
    """A cpu/disk map at ``granularity`` ("block" or "leaf") with at least one disk entry.

    ``keep_ties``: the entries covering a tied group all take its first member's device (what
    ``infer_auto_device_map`` does; the loader unties a group split between memory and disk).
    """
    keys = map_keys(model, ctx.case.no_split, leaf=granularity == "leaf")
    on_disk = ctx.choices.flags(f"disk[{granularity}]", len(keys))
    if not any(on_disk):
        on_disk[-1] = True
    device_map = {k: "disk" if d else "cpu" for k, d in zip(keys, on_disk)}
    for group in bigmodel.find_tied_parameters(model) if keep_ties else ():
        owners = [_covering_key(name, device_map) for name in group]
        for key in owners[1:]:
            device_map[key] = device_map[owners[0]]
    ctx.choices.log["device_map"] = device_map
    return device_map


def _covering_key(name: str, device_map: dict[str, str]) -> str:
    parts = name.split(".")
    return next(".".join(parts[:i]) for i in range(len(parts), -1, -1) if ".".join(parts[:i]) in device_map)


# --- steps -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One stage of a path: ``draw`` picks its choices, ``offload`` changes the offloaded model,
    ``reference`` (if any) the reference model; both return the model to carry on with."""

    name: str
    offload: Callable[[nn.Module, dict, StepContext], nn.Module]
    reference: Callable[[nn.Module, dict, StepContext], nn.Module] | None = None
    draw: Callable[[StepContext], dict] = lambda ctx: {}


def _dispatch(granularity: str) -> Step:
    def draw(ctx: StepContext) -> dict:
        return {"granularity": granularity, "offload_buffers": ctx.choices.pick("offload_buffers", (False, True))}

    def offload(model: nn.Module, params: dict, ctx: StepContext) -> nn.Module:
        device_map = drawn_map(model, ctx, granularity)
        return bigmodel.dispatch_model(model, device_map, offload_dir=ctx.folder("dispatch"),
                                       offload_buffers=params["offload_buffers"])

    return Step(f"dispatch_{granularity}", offload, draw=draw)


def _dispatch_auto(model: nn.Module, params: dict, ctx: StepContext) -> nn.Module:
    size = bigmodel.compute_module_sizes(model)[""]
    budget = int(size * ctx.choices.pick("cpu_budget_fraction", (0.5, 0.2, 0.8)))
    device_map = bigmodel.infer_auto_device_map(model, max_memory={"cpu": budget, "disk": 10**12},
                                                no_split_module_classes=list(ctx.case.no_split))
    ctx.choices.log["device_map"] = device_map
    return bigmodel.dispatch_model(model, device_map, offload_dir=ctx.folder("auto"))


def _redispatch_without_folder(model: nn.Module, params: dict, ctx: StepContext) -> nn.Module:
    """Dispatch again with the same map and no offload folder (what peft does after injecting adapters)."""
    return bigmodel.dispatch_model(model, dict(model.hf_device_map))


def _offload_buffers(ctx: StepContext) -> dict:
    return {"offload_buffers": ctx.choices.pick("offload_buffers", (False, True))}


def _casting_draw(ctx: StepContext) -> dict:
    return {"storage": ctx.choices.pick("storage_dtype", (torch.float8_e4m3fn, torch.bfloat16))}


def _casting(model: nn.Module, params: dict, ctx: StepContext) -> nn.Module:
    bigmodel.attach_layerwise_casting_hooks(model, params["storage"], torch.float32)
    return model


def _load(dtype: torch.dtype | None) -> Step:
    """Save the model, build it again on meta and load it with a drawn map (the reference: no map)."""

    def draw(ctx: StepContext) -> dict:
        return {"granularity": ctx.choices.pick("granularity", ("block", "leaf")),
                "offload_buffers": ctx.choices.pick("offload_buffers", (False, True))}

    def checkpoint(model: nn.Module, ctx: StepContext) -> Path:
        path = ctx.tmp / "checkpoint.safetensors"
        if not path.exists():
            save_model(model, str(path))
        return path

    def reference(model: nn.Module, params: dict, ctx: StepContext) -> nn.Module:
        bigmodel.load_checkpoint_in_model(model, checkpoint(model, ctx), dtype=dtype)
        return model

    def offload(model: nn.Module, params: dict, ctx: StepContext) -> nn.Module:
        path = checkpoint(model, ctx)
        with bigmodel.init_empty_weights():
            empty = ctx.case.build()
        device_map = drawn_map(empty, ctx, params["granularity"], keep_ties=True)
        return bigmodel.load_checkpoint_and_dispatch(
            empty, path, device_map=device_map, offload_folder=ctx.folder("load"), dtype=dtype,
            offload_buffers=params["offload_buffers"],
        )

    return Step("load_dispatch" + ("_bf16" if dtype == torch.bfloat16 else ""), offload, reference, draw)


def _cpu_offload_with_hook(model: nn.Module, params: dict, ctx: StepContext) -> nn.Module:
    model, _ = bigmodel.cpu_offload_with_hook(model, execution_device="cpu")
    return model


STEPS: dict[str, Step] = {step.name: step for step in (
    _dispatch("block"),
    _dispatch("leaf"),
    Step("dispatch_auto", _dispatch_auto),
    Step("redispatch_no_folder", _redispatch_without_folder),
    Step("cpu_offload", lambda m, p, c: bigmodel.cpu_offload(m, offload_buffers=p["offload_buffers"]),
         draw=_offload_buffers),
    Step("disk_offload", lambda m, p, c: bigmodel.disk_offload(m, c.folder("disk"),
                                                               offload_buffers=p["offload_buffers"]),
         draw=_offload_buffers),
    Step("cpu_offload_with_hook", _cpu_offload_with_hook),
    Step("casting", _casting, _casting, _casting_draw),
    _load(None),
    _load(torch.bfloat16),
)}


@dataclass(frozen=True)
class OffloadPath:
    """A sequence of steps, named ``step+step+...``."""

    steps: tuple[str, ...]
    applies: Callable[[ModelCase], bool] = lambda case: True

    @property
    def name(self) -> str:
        return "+".join(self.steps)

    def __repr__(self) -> str:
        return self.name


PATHS: tuple[OffloadPath, ...] = tuple(OffloadPath(tuple(name.split("+"))) for name in (
    "dispatch_block", "dispatch_leaf", "dispatch_auto", "cpu_offload", "disk_offload", "cpu_offload_with_hook",
    "casting", "load_dispatch", "load_dispatch_bf16",
    "casting+dispatch_leaf", "dispatch_block+casting", "casting+cpu_offload", "cpu_offload+casting",
    "casting+disk_offload", "disk_offload+casting", "load_dispatch+casting",
    "cpu_offload_with_hook+cpu_offload", "cpu_offload+cpu_offload_with_hook", "dispatch_block+dispatch_leaf",
    "disk_offload+dispatch_block", "load_dispatch+redispatch_no_folder",
))
PATHS_BY_NAME = {path.name: path for path in PATHS}


def apply_path(path: OffloadPath, reference: nn.Module, offloaded: nn.Module, case: ModelCase, choices: Choices,
               tmp: Path) -> tuple[nn.Module, nn.Module]:
    """Apply ``path``'s steps: reference steps to ``reference``, every step to ``offloaded``."""
    ctx = StepContext(case, choices, tmp)
    for name in path.steps:
        step = STEPS[name]
        params = step.draw(ctx)
        if step.reference is not None:
            reference = step.reference(reference, params, ctx)
        offloaded = step.offload(offloaded, params, ctx)
    return reference, offloaded
