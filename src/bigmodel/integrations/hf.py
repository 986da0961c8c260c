"""Hugging Face model folders: folder in, dispatched model out.

A Hugging Face model folder holds ``config.json``, the weights (``model.safetensors``,
a sharded ``*.index.json`` or ``pytorch_model.bin``) and often a tokenizer or processor.
:func:`load_pretrained` builds the class named in ``config.architectures`` on the ``meta``
device (any transformers model: decoders, MoE, encoders, seq2seq, vision, speech), reads
the checkpoint's keys as transformers 5 reads them (renamed, per-expert weights fused:
:mod:`bigmodel.integrations.hf_weights`), plans a device map under the budgets (no-split
classes from ``model._no_split_modules``), loads each tensor straight to its device and
attaches the hooks.  :func:`empty_model` is the first step alone: ``bigmodel plan`` and
``bigmodel estimate`` use it to read no weights.

transformers is an optional dependency (``pip install bigmodel[hf]``); it is imported
only when one of these functions runs.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..checkpoints.files import read_tensor_infos, resolve_checkpoint_files
from ..checkpoints.gguf import is_gguf
from ..checkpoints.gguf_meta import config_from_gguf, tokenizer_from_gguf
from ..core.devices import normalize_device
from ..core.sizes import compute_module_sizes, get_max_layer_size, to_dtype
from ..planning.no_split import no_split_names
from .hf_models import (
    build_on_meta,
    check_config_file,
    declared_dtype,
    is_weights_file,
    model_class_for,
    no_config_error,
    read_hf_file,
    refuse_quantized,
    resolve_dtype,
    weights_file_folder,
)
from .hf_weights import prepare_checkpoint

logger = logging.getLogger(__name__)

DeviceMap = dict[str, "int | str"]
STRING_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
UNBOUNDED_DISK = 2**62  # bytes: "no limit" for the disk budget
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def require_transformers() -> ModuleType:
    """Import and return ``transformers``.

    Raises:
        ImportError: if transformers is not installed (names the extra that installs it).
    """
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(
            "Loading Hugging Face models needs transformers, which is not installed; "
            "run `pip install bigmodel[hf]`."
        ) from error


def resolve_model_folder(path: str | os.PathLike) -> Path:
    """The model folder for ``path``: a folder, its ``config.json`` or a weights file in it; a ``.gguf`` file as is.

    A weights file (``model.safetensors``, ``pytorch_model.bin``, a sharded checkpoint's
    ``*.index.json``) holds no config, so the folder holding it is used when that folder has
    a ``config.json`` (logged).

    Raises:
        FileNotFoundError: the path does not exist, or the folder has no ``config.json``.
        ValueError: a weights file whose folder has no ``config.json`` (says to pass the folder).
    """
    folder = Path(path).expanduser()
    if is_gguf(folder) and folder.is_file():
        return folder  # config, tokenizer and weights in one file
    if folder.is_file() and is_weights_file(folder.name):
        return weights_file_folder(folder)
    if folder.is_file() and folder.name.endswith(".json"):
        folder = folder.parent if folder.name == "config.json" else folder
    if not folder.exists():
        raise FileNotFoundError(
            f"Model path {str(folder)!r} does not exist; pass a model folder, its config.json, or a .gguf file."
        )
    config_file = folder if folder.is_file() else folder / "config.json"
    if not config_file.is_file():
        raise no_config_error(folder)
    return folder


def load_config(path: str | os.PathLike) -> Any:
    """The transformers config of a model folder or of a ``config.json`` file.

    Raises:
        FileNotFoundError: no config.json (see :func:`resolve_model_folder`).
        ValueError: a size no model has (``num_hidden_layers: -1``; names the key), or a config transformers cannot
            parse: bad or too deep JSON, unknown model type, a field of a wrong type, an unknown dtype (names the file).
    """
    transformers = require_transformers()
    folder = resolve_model_folder(path)
    if is_gguf(folder):
        return config_from_gguf(folder)
    check_config_file(folder if folder.is_file() else folder / "config.json")  # sizes transformers divides by
    try:
        if folder.is_file():
            data = json.loads(folder.read_text())
            model_type = data.pop("model_type", None)
            if model_type is None:
                raise ValueError("no 'model_type' key")
            return transformers.AutoConfig.for_model(model_type, **data)
        return transformers.AutoConfig.from_pretrained(str(folder))
    # AttributeError: transformers looks a config's "dtype" / "torch_dtype" up with getattr(torch, ...).
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError, *_hub_config_errors()) as error:
        raise ValueError(
            f"Cannot read the model config in {str(folder)!r} ({_brief(error)}); check that it is a transformers "
            "config.json with a known 'model_type'."
        ) from error


def _hub_config_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub's error for a config field of the wrong type (``"hidden_size": "x"``), where it has one."""
    errors = importlib.import_module("huggingface_hub.errors")
    error = getattr(errors, "StrictDataclassError", None)
    return (error,) if isinstance(error, type) else ()


def _brief(error: BaseException, limit: int = 160) -> str:
    """The first sentence of an error message from a dependency, on one line."""
    first = " ".join(str(error).split()).split(". ")[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def config_dtype(config: Any) -> torch.dtype:
    """The dtype a config declares (``dtype`` or ``torch_dtype``), float32 when it declares none."""
    return declared_dtype(config) or torch.float32


def empty_model(
    config_or_path: Any, dtype: torch.dtype | str | None = None, *, model_class: type | str | None = None
) -> nn.Module:
    """Build the model of a config on the ``meta`` device (no weights read, no memory used).

    The class is ``model_class``, else the first of ``config.architectures``, else the
    config's causal LM.  Tied weights are tied, tensors transformers keeps in float32 for
    ``dtype`` are float32, and the model is in eval mode.

    Args:
        config_or_path: a transformers config, a model folder or a ``config.json`` path.
        dtype: dtype of the floating parameters; the config's dtype (float32 if none) when None.
        model_class: a transformers model class, an ``AutoModel*`` class or the name of one.

    Returns:
        The model, every parameter on ``meta``.

    Raises:
        ImportError: transformers is missing.
        FileNotFoundError / ValueError: see :func:`load_config`; ``ValueError`` also for an
            unknown ``dtype``, a class transformers does not have (custom code included), or a
            class that cannot be built from the config.
    """
    require_transformers()
    if isinstance(config_or_path, (str, os.PathLike)):
        source = repr(str(resolve_model_folder(config_or_path)))
        config = load_config(config_or_path)
    else:
        source = "the config"
        config = copy.deepcopy(config_or_path)  # from_config records the dtype in the config
    torch_dtype = config_dtype(config) if dtype is None else to_dtype(dtype)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r} has no torch dtype to build a model in; use e.g. 'bfloat16' or 'float16'.")
    return build_on_meta(model_class_for(config, model_class, source), config, torch_dtype, source)


def no_split_classes(model: nn.Module) -> list[str]:
    """Class names a device map must never split: the model's ``_no_split_modules`` (transformers)."""
    return sorted(getattr(model, "_no_split_modules", None) or ())


def read_device_map(path: str | os.PathLike) -> DeviceMap:
    """Read a device map saved as JSON (``bigmodel plan --json`` writes this format).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a JSON object of module name → device (names the entry).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"Device map file {str(file)!r} does not exist; pass auto, balanced, sequential or a JSON file "
            "written by `bigmodel plan --json`."
        )
    try:
        data = json.loads(file.read_text())
    except (ValueError, RecursionError) as error:  # invalid JSON, not UTF-8 text, nested too deep
        raise ValueError(f"Device map file {str(file)!r} is not valid JSON ({error}); regenerate it.") from error
    if not isinstance(data, dict):
        raise ValueError(f"Device map file {str(file)!r} must hold a JSON object module name → device.")
    result: DeviceMap = {}
    for name, device in data.items():
        try:
            result[name] = normalize_device(device)
        except ValueError as error:
            raise ValueError(f"Device map file {str(file)!r}, entry {name!r}: {error}") from error
    return result


def plan_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, Any] = "auto",
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> DeviceMap:
    """The device map a load would use: a dict is returned as is, a strategy name is planned.

    Args:
        model: the (meta) model; only sizes are read.
        device_map: a dict, or ``"auto"``/``"balanced"``/``"balanced_low_0"`` (budgets spread
            evenly over the accelerators) or ``"sequential"`` (fill devices in order).
        max_memory: budgets device → bytes or size string; free memory when None.  What
            does not fit goes to ``"disk"`` (unbounded unless a ``"disk"`` budget is given).
        no_split_module_classes: class names never split; the model's own when None.
        dtype: plan sizes as if floating weights were cast to it.

    Returns:
        dict module name → device (``int`` accelerator index, ``"cpu"`` or ``"disk"``).

    Raises:
        ValueError: an unknown strategy name (lists the accepted ones).
    """
    from ..planning.device_map import infer_auto_device_map
    from ..planning.memory import get_balanced_memory, get_max_memory

    if not isinstance(device_map, str):
        return {name: normalize_device(device) for name, device in device_map.items()}
    if device_map not in STRING_DEVICE_MAPS:
        raise ValueError(
            f"Unknown device map {device_map!r}; use one of {', '.join(STRING_DEVICE_MAPS)}, a dict or a JSON file."
        )
    no_split = no_split_classes(model) if no_split_module_classes is None else no_split_names(no_split_module_classes)
    budgets = get_max_memory(dict(max_memory) if max_memory is not None else None)
    budgets.setdefault("disk", UNBOUNDED_DISK)
    if device_map != "sequential":
        low_zero = device_map == "balanced_low_0"
        budgets = get_balanced_memory(model, budgets, no_split, dtype=dtype, low_zero=low_zero)
    return infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=no_split, dtype=dtype)


def _check_disk_needs_folder(model: nn.Module, device_map: Mapping[str, Any], offload_folder: Any, dtype: Any) -> None:
    """Raise early (before reading weights) when the map offloads to disk but no folder is given."""
    on_disk = [name for name, device in device_map.items() if device == "disk"]
    if not on_disk or offload_folder is not None:
        return
    sizes = compute_module_sizes(model, dtype=dtype)
    layer_bytes, _ = get_max_layer_size(list(model.named_children()), sizes, no_split_classes(model))
    disk_bytes = sum(sizes.get(name, 0) for name in on_disk)
    what = "the whole model" if "" in on_disk else f"{len(on_disk)} module(s) such as {on_disk[0]!r}"
    raise ValueError(
        f"The memory budgets leave {what} ({disk_bytes:,} bytes in all) for disk but no offload folder was given; "
        "pass offload_folder (CLI: --offload-folder DIR) or raise the budgets (CLI: --max-memory cpu=SIZE): "
        f"the whole model is {sizes['']:,} bytes, its largest layer {layer_bytes:,} bytes."
    )


def load_pretrained(
    path: str | os.PathLike,
    device_map: str | Mapping[str, Any] = "auto",
    max_memory: Mapping[Any, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    no_split_module_classes: list[str] | None = None,
    *,
    offload_buffers: bool = False,
    strict: bool = False,
    model_class: type | str | None = None,
    offload_quantization: str | None = None,
) -> nn.Module:
    """Load a Hugging Face model folder under budgets and return the dispatched model.

    Steps: config → the model class on ``meta`` → the checkpoint's keys as transformers reads
    them → device map → each tensor straight to its device (``"disk"`` tensors to
    ``offload_folder``) → hooks.  The result holds what ``from_pretrained(folder)`` gives:
    same class, same weights bit for bit, same dtypes (``_keep_in_fp32_modules`` included),
    same tied weights.  ``model.hf_device_map`` holds the map used.

    Args:
        path: model folder (``config.json`` + weights: safetensors or ``.bin``, sharded or not),
            or a ``.gguf`` file (config and weights read from it, tensors dequantized on read).
        device_map: ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, a dict
            module name → device, or the path of a JSON device map.
        max_memory: budgets device → bytes or size string (``{"cpu": "2GiB"}``); free memory when None.
        offload_folder: where weights mapped to ``"disk"`` are kept; required if any are.
        dtype: dtype of the floating weights; as transformers' ``"auto"`` when None (the
            config's dtype, else the checkpoint's).
        no_split_module_classes: class names never split; ``model._no_split_modules`` when None.
        offload_buffers: also offload buffers of offloaded modules.
        strict: also raise on checkpoint keys the model does not use (missing parameters always raise).
        model_class: the class to build (a transformers model class, an ``AutoModel*`` class or
            the name of one); the first of ``config.architectures`` when None.
        offload_quantization: ``"int8"``, ``"int4"`` or ``"float8"``: store offloaded
            ``nn.Linear`` weights in that form, dequantized on the execution device at each forward.

    Returns:
        The model in eval mode, with weights placed and hooks attached.

    Raises:
        ImportError: transformers is missing.
        FileNotFoundError: no folder, no config.json, or no weights in the folder.
        ValueError: unknown dtype or device map; a class transformers does not have (names it);
            a quantized checkpoint; parameters the checkpoint does not hold (names them); the
            map offloads to disk and no ``offload_folder`` is given (says how large the model
            and its largest layer are).  All before any weight is loaded.
    """
    from ..dispatch.dispatch import dispatch_model
    from ..loading.converted import load_converted_checkpoint

    folder = resolve_model_folder(path)
    gguf = is_gguf(folder)  # config, tokenizer and weights in one file, names mapped by transformers
    files = [] if gguf else resolve_checkpoint_files(folder)  # fail before building when there are no weights
    config = load_config(folder)
    source = repr(str(folder))
    refuse_quantized(config, source)
    infos = {} if gguf else read_tensor_infos(files)
    torch_dtype = resolve_dtype(config, dtype, infos)
    model = build_on_meta(model_class_for(config, model_class, source), config, torch_dtype, source)
    conversion = None if gguf else prepare_checkpoint(model, infos, source)
    if isinstance(device_map, (str, os.PathLike)) and str(device_map) not in STRING_DEVICE_MAPS:
        device_map = read_device_map(device_map)
    no_split = no_split_classes(model) if no_split_module_classes is None else no_split_names(no_split_module_classes)
    planned = plan_device_map(model, device_map, max_memory, no_split)
    _check_disk_needs_folder(model, planned, offload_folder, None)
    logger.info("Loading %s with device map over %s", folder, sorted({str(d) for d in planned.values()}))
    offload_dir = None if offload_folder is None else str(offload_folder)
    load_converted_checkpoint(
        model, folder, conversion, device_map=planned, offload_folder=offload_dir, dtype=torch_dtype,
        keep_in_fp32_modules=_other_dtype_names(model, torch_dtype), offload_state_dict="disk" in planned.values(),
        offload_buffers=offload_buffers, strict=strict, offload_quantization=offload_quantization,
    )  # fmt: skip
    model = dispatch_model(
        model, device_map=planned, offload_dir=offload_dir, offload_buffers=offload_buffers,
        offload_quantization=offload_quantization,
    )  # fmt: skip
    _attach_generation_config(model, folder)
    return model.eval()


def _other_dtype_names(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Floating tensors the built model holds in float32 while ``dtype`` is another (kept in fp32 on load)."""
    if dtype == torch.float32:
        return []
    return [name for name, tensor in model.state_dict().items() if tensor.dtype == torch.float32]


def _attach_generation_config(model: nn.Module, folder: Path) -> None:
    if not getattr(model, "can_generate", lambda: True)():
        return
    transformers = require_transformers()
    if is_gguf(folder):
        model.generation_config = transformers.GenerationConfig.from_model_config(model.config)
        return
    if (folder / "generation_config.json").is_file():
        model.generation_config = read_hf_file(transformers.GenerationConfig, folder, "generation_config.json")


def has_tokenizer(path: str | os.PathLike) -> bool:
    """True if the model folder holds tokenizer files (a ``.gguf`` file holds its own)."""
    folder = Path(path)
    if is_gguf(folder):
        return folder.is_file()
    return folder.is_dir() and any((folder / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer saved in a model folder.

    Raises:
        ValueError: the folder holds no tokenizer (says how to add one).
    """
    transformers = require_transformers()
    folder = resolve_model_folder(path)
    if is_gguf(folder):
        return tokenizer_from_gguf(folder)
    if not has_tokenizer(folder):
        raise ValueError(
            f"Model folder {str(folder)!r} has no tokenizer (no {' / '.join(_TOKENIZER_FILES)}), so a text "
            "prompt cannot be encoded; save one there with tokenizer.save_pretrained(folder)."
        )
    return read_hf_file(transformers.AutoTokenizer, folder, "tokenizer files")
