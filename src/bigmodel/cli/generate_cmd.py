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

from .. import _embedded, _generate, _hf, _summary
from .._sizes import compute_module_sizes
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
    parser.add_argument("model", nargs="?", help="model folder (config.json + weights + tokenizer); default: SmolLM2")
    parser.add_argument("--prompt", default=_generate.DEFAULT_PROMPT, help="the prompt (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="default: %(default)s")
    parser.add_argument("--max-memory", nargs="+", metavar="DEV=SIZE", help="budgets, e.g. cpu=200MB 0=8GiB")
    parser.add_argument(
        "--device-map", default="auto", metavar="auto|balanced|sequential|FILE.json",
        help="planning strategy, or a JSON map written by `bigmodel plan --json` (default: auto)",
    )  # fmt: skip
    parser.add_argument("--offload-folder", metavar="DIR", help="where weights mapped to disk are kept")
    parser.add_argument("--dtype", help="load floating weights in this dtype (default: the config's)")
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

    Weights mapped from safetensors or offload files count as file-backed: page cache the
    kernel can drop under pressure, unlike anonymous memory.
    """
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssFile"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _rss_text() -> str:
    split = rss_split_bytes()
    text = human_bytes(peak_rss_bytes())
    if split is not None:
        text += f" (now {human_bytes(split[0])} private + {human_bytes(split[1])} file-backed mapped weights)"
    return text


def _embedded_budgets(folder: Path, dtype: torch.dtype | None) -> dict[str, int]:
    """Budgets that put about half of the embedded model's layers on disk."""
    model = _hf.empty_model(folder, dtype=dtype)
    cpu = _summary.cpu_budget_for_disk_share(model, 0.5, dtype=next(model.parameters()).dtype)
    return {"cpu": cpu, "disk": _hf.UNBOUNDED_DISK}


def run_generate(args: argparse.Namespace) -> int:
    """Load, report the device map, generate, optionally check; returns the exit status (1: logits differ)."""
    dtype = parse_dtype(args.dtype)
    budgets = parse_max_memory(args.max_memory)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be at least 1.")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be at least 1.")
        torch.set_num_threads(args.threads)
    embedded = args.model is None
    folder = _embedded.embedded_model_folder() if embedded else _hf.resolve_model_folder(args.model)
    tokenizer = _hf.load_tokenizer(folder)
    if embedded and budgets is None and args.device_map == "auto":
        budgets = _embedded_budgets(folder, dtype)
    with contextlib.ExitStack() as stack:
        offload = args.offload_folder
        if offload is None and embedded:
            offload = stack.enter_context(tempfile.TemporaryDirectory(prefix="bigmodel-offload-"))
            logger.info("Offloading to the temporary folder %s", offload)
        start = time.perf_counter()
        model = _hf.load_pretrained(folder, args.device_map, budgets, offload, dtype)
        load_seconds = time.perf_counter() - start
        usage = _summary.device_map_usage(model, model.hf_device_map)
        result = _generate.generate(model, tokenizer, args.prompt, args.max_new_tokens, chat=not args.no_chat)
        source = budgets if args.device_map in _hf.STRING_DEVICE_MAPS else f"device map {args.device_map}"
        _print_report(folder, model, usage, source, load_seconds, result, args.prompt)
        return _run_check(model, folder, result) if args.check else 0


def _print_report(
    folder: Path, model: nn.Module, usage: list[_summary.DeviceUsage], budgets: dict | str | None,
    load_seconds: float, result: _generate.Generation, prompt: str,
) -> None:  # fmt: skip
    dtype = next(model.parameters()).dtype
    plan = budgets if isinstance(budgets, str) else budget_text(budgets)
    title = f"{folder} ({type(model).__name__}, {dtype_label(dtype)})"
    print(key_values([("model", title), ("budgets", plan)]))
    print()
    print(usage_table(usage, None if isinstance(budgets, str) else budgets))
    print()
    print(key_values([
        ("load time", f"{load_seconds:.2f} s"),
        ("generated", f"{result.new_tokens} tokens in {result.seconds:.2f} s ({result.tokens_per_second:.2f} tokens/s)"),
        ("peak RSS", _rss_text()),
        ("prompt", prompt),
    ]))  # fmt: skip
    print()
    print(result.text)
    sys.stdout.flush()


def _run_check(model: nn.Module, folder: Path, result: _generate.Generation) -> int:
    """Compare with the model loaded whole in memory; exit status 1 if the logits differ."""
    need = compute_module_sizes(model)[""]
    available = psutil.virtual_memory().available
    if need > 0.8 * available:
        short = f"the model needs {human_bytes(need)} in memory, only {human_bytes(available)} is available"
        print(f"\ncheck      skipped: {short}")
        return 0
    check = _generate.check_against_in_memory(model, folder, result.output_ids)
    verdict = "identical" if check.identical else f"DIFFERENT (max |diff| {check.max_abs_diff:.3g})"
    print(f"\ncheck      logits over {check.tokens} tokens vs the model loaded whole in memory: {verdict}")
    return 0 if check.identical else 1
