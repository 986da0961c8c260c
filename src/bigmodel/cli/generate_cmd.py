"""``bigmodel generate``: load a model under budgets (part of it on disk if need be) and generate text."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch import nn

from ..integrations import hf as _hf
from ..integrations.hf_models import require_causal_lm
from ..offload.format import load_offload_index
from ..planning.device_map import check_device_map, unknown_device_map_keys
from . import embedded as _embedded
from . import generate as _generate
from . import summary as _summary
from ._format import human_bytes, key_values
from ._options import dtype_label, parse_dtype, parse_max_memory
from .inspect_cmds import budget_text, usage_table

logger = logging.getLogger(__name__)


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bigmodel generate``."""
    parser = subparsers.add_parser(
        "generate",
        help="load a model under memory budgets and generate text (default: the embedded SmolLM2)",
        description="Load a Hugging Face causal-LM folder under per-device budgets (what does not fit goes to "
        "disk) and generate greedily.  Without MODEL, runs the embedded SmolLM2-135M-Instruct with about half "
        "of its layers on disk.",
    )
    parser.add_argument(
        "model", nargs="?", help="model folder (config.json + weights + tokenizer) or .gguf file; default: SmolLM2"
    )
    parser.add_argument("--prompt", default=_generate.DEFAULT_PROMPT, help="the prompt (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="default: %(default)s")
    parser.add_argument("--max-memory", nargs="+", metavar="DEV=SIZE", help="budgets, e.g. cpu=200MB 0=8GiB")
    parser.add_argument(
        "--device-map", default="auto", metavar="auto|balanced|sequential|FILE.json",
        help="planning strategy, or a JSON map written by `bigmodel plan --json` (default: auto)",
    )  # fmt: skip
    parser.add_argument(
        "--offload-folder", metavar="DIR",
        help="where weights mapped to disk are kept (default: a temporary folder, removed at exit)",
    )  # fmt: skip
    parser.add_argument("--dtype", help="load floating weights in this dtype (default: the config's)")
    parser.add_argument(
        "--offload-quantization", choices=("int8", "int4", "float8"),
        help="store offloaded Linear weights in this form, dequantized at each forward (default: as loaded)",
    )  # fmt: skip
    parser.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    parser.add_argument("--check", action="store_true", help="also run the model whole in memory and compare logits")
    parser.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch (default: torch's choice)")
    parser.set_defaults(run=run_generate)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (bytes)."""
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except ImportError:  # Windows
        info = psutil.Process().memory_info()
        return getattr(info, "peak_wset", info.rss)


def rss_split_bytes() -> tuple[int, int] | None:
    """Current ``(anonymous, file-backed)`` resident bytes (Linux), or None elsewhere.

    File-backed pages are those of mapped files: shared libraries, and weights mapped from
    safetensors or offload files (page cache the kernel can drop under pressure, unlike
    anonymous memory).
    """
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssFile"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def rss_text(before_load: tuple[int, int] | None) -> str:
    """Peak RSS, and the current RSS split into private memory, mapped weights and libraries.

    Args:
        before_load: :func:`rss_split_bytes` taken just before the load; the file-backed
            bytes then (shared libraries, mostly) are told apart from those mapped since (weights).
    """
    text = human_bytes(peak_rss_bytes())
    now = rss_split_bytes()
    if now is None:
        return text
    private, file_backed = now
    if before_load is None:
        return f"{text} (now {human_bytes(private)} private + {human_bytes(file_backed)} file-backed)"
    libraries = min(before_load[1], file_backed)
    weights = file_backed - libraries
    return (
        f"{text} (now {human_bytes(private)} private + {human_bytes(weights)} mapped weights "
        f"+ {human_bytes(libraries)} libraries)"
    )


def _embedded_budgets(model: nn.Module) -> dict[str, int]:
    """Budgets that put about half of the embedded model's layers on disk."""
    cpu = _summary.cpu_budget_for_disk_share(model, 0.5, dtype=next(model.parameters()).dtype)
    return {"cpu": cpu, "disk": _hf.UNBOUNDED_DISK}


def _check_args(args: argparse.Namespace) -> None:
    """Reject bad --prompt, --max-new-tokens and --threads values (ValueError naming them); apply --threads."""
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; pass some text, e.g. --prompt 'What is the capital of France?'.")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be at least 1.")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be at least 1.")
        torch.set_num_threads(args.threads)


def _read_map_file(model: nn.Module, path: str) -> dict[str, int | str]:
    """The device map in ``path``, checked against ``model``: every key names part of it, every tensor is covered.

    Raises:
        FileNotFoundError / ValueError: see :func:`bigmodel.integrations.hf.read_device_map`; a key naming
            nothing in the model, or tensors no key covers (names them and the fix).
    """
    device_map = _hf.read_device_map(path)
    unknown = unknown_device_map_keys(model, device_map)
    if unknown:
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        shown = ", ".join(repr(key) for key in unknown[:10]) + more
        raise ValueError(
            f"Device map file {path!r} names {len(unknown)} module(s) that {type(model).__name__} does not have: "
            f"{shown}; remove them, or write a map for this model with `bigmodel plan MODEL --json`."
        )
    try:
        check_device_map(model, device_map)
    except ValueError as error:
        raise ValueError(f"Device map file {path!r}: {error}") from error
    return device_map


def _offload_folder(stack: contextlib.ExitStack, given: str | None, usage: list[_summary.DeviceUsage],
                    map_file: str | None = None) -> str | None:
    """The offload folder: the one given, else a temporary one (removed at exit) when the plan uses disk
    for part of the model (all of it on disk needs --offload-folder: a budget or map mistake, most often)."""
    on_disk = next((u.nbytes for u in usage if u.device == "disk"), 0)
    if given is not None or not on_disk:
        return given
    if not any(u.nbytes for u in usage if u.device != "disk"):
        if map_file is not None:
            raise ValueError(
                f"The device map file {map_file!r} puts the whole model on disk and no --offload-folder was given; "
                "pass --offload-folder DIR to run every layer from disk, or map some modules to cpu."
            )
        raise ValueError(
            "The memory budgets are too small for even one layer outside disk and no --offload-folder was given; "
            "raise --max-memory (e.g. cpu=SIZE) or pass --offload-folder DIR to run every layer from disk."
        )
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="bigmodel-offload-"))
    logger.info(
        "No --offload-folder: offloading %s bytes to the temporary folder %s (removed at exit).", f"{on_disk:,}", folder
    )
    return folder


def run_generate(args: argparse.Namespace) -> int:
    """Load, report the device map, generate, optionally check; returns the exit status (1: logits differ)."""
    dtype = parse_dtype(args.dtype)
    budgets = parse_max_memory(args.max_memory)
    _check_args(args)
    embedded = args.model is None
    folder = _embedded.gguf_path() if embedded else _hf.resolve_model_folder(args.model)  # GGUF read in place
    if not embedded:  # from the config alone, before the tokenizer and the weights
        require_causal_lm(_hf.load_config(folder), repr(str(folder)))
    tokenizer = _hf.load_tokenizer(folder)
    start = time.perf_counter()
    empty = _hf.empty_model(folder, dtype=dtype)
    torch_dtype = next(empty.parameters()).dtype
    plan_seconds = time.perf_counter() - start
    if embedded and budgets is None and args.device_map == "auto":
        budgets = _embedded_budgets(empty)  # a search over plans, not part of a load
    start = time.perf_counter()
    strategy = args.device_map if args.device_map in _hf.STRING_DEVICE_MAPS else _read_map_file(empty, args.device_map)
    planned = _hf.plan_device_map(empty, strategy, budgets, dtype=torch_dtype)
    usage = _summary.device_map_usage(empty, planned, dtype=torch_dtype)
    plan_seconds += time.perf_counter() - start
    with contextlib.ExitStack() as stack:
        map_file = None if args.device_map in _hf.STRING_DEVICE_MAPS else args.device_map
        offload = _offload_folder(stack, args.offload_folder, usage, map_file)
        before_load = rss_split_bytes()
        start = time.perf_counter()
        model = _hf.load_pretrained(
            folder, planned, None, offload, dtype, offload_quantization=args.offload_quantization
        )
        load_seconds = plan_seconds + time.perf_counter() - start  # as long as a load_pretrained that plans
        result = _generate.generate(model, tokenizer, args.prompt, args.max_new_tokens, chat=not args.no_chat)
        source = budgets if args.device_map in _hf.STRING_DEVICE_MAPS else f"device map {args.device_map}"
        stored = _stored_note(empty, planned, offload, torch_dtype) if args.offload_quantization else None
        _print_report(folder, model, usage, source, load_seconds, result, args.prompt, rss_text(before_load), stored)
        need = sum(u.nbytes for u in usage)
        return _run_check(model, folder, result, need, bool(args.offload_quantization)) if args.check else 0


def _stored_note(model: nn.Module, planned: dict, folder: str | None, dtype: torch.dtype) -> str | None:
    """The line under the table saying what quantized offload stores on disk (None when nothing is quantized)."""
    stored = _summary.stored_on_disk(model, planned, load_offload_index(folder) if folder else {}, dtype)
    if not stored.quantized:
        return None
    extra = " + scales and zero points" if "int4" in stored.forms else " + scales"
    return (
        f"disk stores {human_bytes(stored.nbytes)} ({stored.nbytes:,} bytes) with --offload-quantization: "
        f"{stored.quantized} Linear weights as {'/'.join(stored.forms)}{extra}, which 'planned' counts in "
        f"{dtype_label(dtype)}."
    )


def _print_report(
    folder: Path, model: nn.Module, usage: list[_summary.DeviceUsage], budgets: dict | str | None,
    load_seconds: float, result: _generate.Generation, prompt: str, rss: str, stored: str | None = None,
) -> None:  # fmt: skip
    dtype = next(model.parameters()).dtype
    plan = budgets if isinstance(budgets, str) else budget_text(budgets)
    title = f"{folder} ({type(model).__name__}, {dtype_label(dtype)})"
    print(key_values([("model", title), ("budgets", plan)]))
    print()
    print(usage_table(usage, None if isinstance(budgets, str) else budgets))
    print()
    if stored:  # after a blank line: the table ends there for the readers that parse it
        print(stored)
        print()
    print(key_values([
        ("load time", f"{load_seconds:.2f} s"),
        ("generated", f"{result.new_tokens} tokens in {result.seconds:.2f} s ({result.tokens_per_second:.2f} tokens/s)"),
        ("peak RSS", rss),
        ("prompt", prompt),
    ]))  # fmt: skip
    print()
    print(result.text)
    sys.stdout.flush()


def _run_check(model: nn.Module, folder: Path, result: _generate.Generation, need: int, quantized: bool) -> int:
    """Compare with the model loaded whole in memory (``need`` bytes); exit status 1 if the logits differ,
    or, with a quantized offload (``quantized``: its logits differ by design), if a greedy prediction does."""
    available = psutil.virtual_memory().available
    if need > 0.8 * available:
        short = f"the model needs {human_bytes(need)} in memory, only {human_bytes(available)} is available"
        print(f"\ncheck      skipped: {short}")
        return 0
    check = _generate.check_against_in_memory(model, folder, result.output_ids)
    verdict = "identical" if check.identical else f"DIFFERENT (max |diff| {check.max_abs_diff:.3g})"
    print(f"\ncheck      logits over {check.tokens} tokens vs the model loaded whole in memory: {verdict}")
    if check.identical or not quantized:
        return 0 if check.identical else 1
    print(f"           the disk layers are quantized (--offload-quantization), so logits differ; the greedy next "
          f"token is the same at {check.same_predictions} of {check.tokens} positions")
    return 0 if check.same_predictions == check.tokens else 1
