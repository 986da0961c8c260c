"""``bigmodel estimate`` and ``bigmodel plan``: sizes and device maps from a config alone (no weights read)."""

from __future__ import annotations

import argparse
import json
import logging

from ..core.devices import device_sort_key
from ..core.sizes import compute_module_sizes, get_max_layer_size
from ..integrations import hf as _hf
from . import summary as _summary
from ._format import human_bytes, key_values, table
from ._options import (
    DTYPE_CHOICES,
    dtype_label,
    parse_dtype,
    parse_max_memory,
    parse_size_dtype,
)

logger = logging.getLogger(__name__)

ESTIMATE_NOTE = (
    "total: every parameter and buffer (tied weights once), floating ones in the row's dtype; "
    "the same bytes `bigmodel plan --dtype D` places."
)


def add_estimate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bigmodel estimate``."""
    parser = subparsers.add_parser(
        "estimate",
        help="total size and largest layer of a model, per dtype, from its config alone",
        description="Print the total size, the largest layer and the size per dtype of a model, reading no weights.",
    )
    parser.add_argument("model", help="model folder, its config.json or weights file, or a .gguf file")
    parser.add_argument(
        "--dtype", nargs="+", default=list(DTYPE_CHOICES), metavar="D",
        help="dtypes to size for (default: fp32 bf16 fp16 fp8 int4; torch names such as bfloat16 work too)",
    )  # fmt: skip
    parser.set_defaults(run=run_estimate)


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bigmodel plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="the device map a load would use under the budgets, from the config alone",
        description="Plan the device map of a model under per-device budgets, reading no weights. "
        "What does not fit in the budgets goes to disk.",
    )
    parser.add_argument("model", help="model folder, its config.json or weights file, or a .gguf file")
    parser.add_argument("--max-memory", nargs="+", metavar="DEV=SIZE", help="budgets, e.g. cpu=64GiB 0=70GiB disk=2TB")
    parser.add_argument("--device-map", default="auto", choices=_hf.STRING_DEVICE_MAPS, help="planning strategy")
    parser.add_argument("--dtype", help="dtype the weights would be loaded in (default: the config's)")
    parser.add_argument("--json", action="store_true", help="print the map as JSON (for generate --device-map FILE)")
    parser.set_defaults(run=run_plan)


def run_estimate(args: argparse.Namespace) -> int:
    """Print parameters, layers and the size per dtype of ``args.model``; returns the exit status."""
    dtypes = [parse_size_dtype(name) for name in args.dtype]
    config = _hf.load_config(_hf.resolve_model_folder(args.model))  # a weights file: its folder (logged once)
    declared = _hf.config_dtype(config)
    model = _hf.empty_model(config, dtype="float32")
    no_split = _hf.no_split_classes(model)
    children = list(model.named_children())
    rows = []
    for dtype in dtypes:
        sizes = compute_module_sizes(model, dtype=dtype)
        layer_bytes, layer_names = get_max_layer_size(children, sizes, no_split)
        total = sizes[""]
        rows.append((dtype_label(dtype), human_bytes(total), f"{total:,}", human_bytes(layer_bytes), layer_names[0]))
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers())
    print(key_values([
        ("model", f"{args.model} ({type(model).__name__})"),
        ("parameters", f"{params:,}"),
        ("buffers", f"{buffers:,} elements"),
        ("layers", f"{_summary.count_layers(model, no_split)} x {', '.join(no_split) or '-'}"),
        ("config dtype", dtype_label(declared)),
    ]))  # fmt: skip
    print()
    print(table(("dtype", "total", "total bytes", "largest layer", "e.g."), rows))
    print()
    print(ESTIMATE_NOTE)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Print the planned device map of ``args.model`` as a table or as JSON; returns the exit status."""
    budgets = parse_max_memory(args.max_memory)
    model = _hf.empty_model(_hf.resolve_model_folder(args.model), dtype=parse_dtype(args.dtype))
    dtype = next(model.parameters()).dtype
    device_map = _hf.plan_device_map(model, args.device_map, budgets, dtype=dtype)
    if args.json:
        print(json.dumps(device_map, indent=1))
        return 0
    usage = _summary.device_map_usage(model, device_map, dtype=dtype)
    print(key_values([
        ("model", f"{args.model} ({type(model).__name__}, {dtype_label(dtype)})"),
        ("budgets", budget_text(budgets)),
    ]))  # fmt: skip
    print()
    print(usage_table(usage, budgets))
    return 0


def budget_text(budgets: dict | None) -> str:
    """The budgets as ``cpu=2.00 GiB, disk=unbounded``."""
    if not budgets:
        return "free memory of each device, the rest on disk"
    return ", ".join(f"{device}={budget_bytes(size)}" for device, size in budgets.items())


def budget_bytes(size: int | None) -> str:
    """A budget for display: ``"unbounded"`` for the no-limit disk budget."""
    return "unbounded" if size is not None and size >= _hf.UNBOUNDED_DISK else human_bytes(size)


def usage_table(usage: list[_summary.DeviceUsage], budgets: dict | None) -> str:
    """Per-device table: budget, planned bytes, layers, tensors, with a total row.

    Every budgeted device has a row, those the plan leaves empty included (0 bytes, 0 layers).
    """
    budgets = budgets or {}
    held = {u.device for u in usage}
    idle = [_summary.DeviceUsage(device, 0, 0, 0) for device in budgets if device not in held]
    rows: list[tuple] = [
        (str(u.device), budget_bytes(budgets.get(u.device)), human_bytes(u.nbytes), f"{u.nbytes:,}", u.layers, u.tensors)
        for u in sorted([*usage, *idle], key=lambda u: device_sort_key(u.device))
    ]
    total = sum(u.nbytes for u in usage)
    layers, tensors = sum(u.layers for u in usage), sum(u.tensors for u in usage)
    rows.append(("total", "-", human_bytes(total), f"{total:,}", layers, tensors))
    return table(("device", "budget", "planned", "bytes", "layers", "tensors"), rows)
