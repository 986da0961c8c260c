"""Which transformers class a folder holds, built on the ``meta`` device as ``from_pretrained`` builds it.

The class is the first name in ``config.architectures`` (what ``save_pretrained`` records
and what the hub's ``AutoModelFor*`` pick), or one the caller names; folders without
``architectures`` are read as causal LMs.  The model is built in the requested dtype with
weights on ``meta``, tied as transformers ties them, and the tensors transformers keeps in
float32 (``_keep_in_fp32_modules`` under float16, ``_keep_in_fp32_modules_strict`` under
float16 and bfloat16) are float32 here too, so planning, loading and hooks see the dtypes
``from_pretrained`` gives.  The dtype itself is resolved as transformers' ``dtype="auto"``
resolves it.  transformers is imported by the callers (``bigmodel.integrations.hf``).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoints.files import TensorInfo
from ..checkpoints.hub_hint import hub_folder_hint
from ..core.meta import init_empty_weights
from ..core.sizes import to_dtype

logger = logging.getLogger(__name__)

_WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # files of tensors, never a config
# Config keys (transformers' names and the aliases configs store them under) that size the modules built
# from them, by the least value a model can be built with: heads are divided by, layers and sizes may be 0.
_LAYER_COUNTS = frozenset({
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
    "num_encoder_layers", "num_decoder_layers",
})  # fmt: skip
_HEAD_COUNTS = frozenset({
    "num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "encoder_attention_heads",
    "decoder_attention_heads",
})  # fmt: skip
_SIZES = frozenset({
    "hidden_size", "intermediate_size", "vocab_size", "head_dim", "n_embd", "n_inner", "d_model", "d_ff", "d_kv",
    "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size",
})  # fmt: skip
_MAX_LAYERS = 100_000  # more than any model has by far (hundreds); building them on meta would take minutes
_MAX_SIZE = 2**31 - 1  # a larger dimension overflows torch's shapes once multiplied; none comes near


def is_weights_file(name: str) -> bool:
    """True for the name of a weights file or of a sharded checkpoint's index (no config inside)."""
    return name.endswith(_WEIGHTS_SUFFIXES) or name.endswith(".index.json")


def weights_file_folder(file: Path) -> Path:
    """The model folder holding the weights file ``file``, which must have a ``config.json`` (logged).

    Raises:
        ValueError: the folder has no ``config.json`` (names the file and the fix).
    """
    kind = ".index.json" if file.name.endswith(".index.json") else file.suffix
    if not (file.parent / "config.json").is_file():
        raise ValueError(
            f"{str(file)!r} is a {kind} weights file, which holds no config, and its folder has no config.json; "
            "pass the folder with config.json (and the weights) instead."
        )
    logger.info("%s is a %s weights file; using the model folder holding it: %s", file.name, kind, file.parent)
    return file.parent


def no_config_error(folder: Path) -> FileNotFoundError:
    """The error for a model folder without ``config.json``: a hub cache folder names its snapshot folder."""
    plain = (
        "pass a Hugging Face model folder (config.json + weights), e.g. one written by "
        "model.save_pretrained(folder), or a .gguf file."
    )
    hint = hub_folder_hint(folder) if folder.is_dir() else None
    return FileNotFoundError(f"No config.json in {str(folder)!r}; {hint or plain}")


def read_hf_file(reader: Any, folder: Path, what: str) -> Any:
    """``reader.from_pretrained(folder)`` (a tokenizer, a generation config), its failure named.

    transformers raises ``OSError`` for a file that is not valid JSON and lets a file that is not
    UTF-8 text fail with a bare ``UnicodeDecodeError`` naming no file.

    Raises:
        ValueError: the file cannot be read (names the folder, the file and the fix).
    """
    try:
        return reader.from_pretrained(str(folder))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(
            f"Cannot read the {what} in {str(folder)!r} ({' '.join(str(err).split())[:200]}); fix the file, or "
            "save it again with .save_pretrained(folder)."
        ) from err


def check_config_file(path: Path) -> None:
    """Check the sizes in the JSON config file ``path`` (see :func:`check_config_sizes`) before transformers reads it.

    transformers divides by some sizes while reading a config (``num_attention_heads: 0`` is a
    ``ZeroDivisionError``), so they are checked in the file.  A file that is not a JSON object is
    left to transformers, whose error is reported as it is.

    Raises:
        ValueError: a size no model can be built from (names the key, its value, the file and the fix).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return
    if isinstance(data, dict):
        check_config_sizes(data, repr(str(path)))


def check_config_sizes(config: Mapping[str, Any], source: str) -> None:
    """Refuse a config whose sizes no model can be built from, before anything is built from it.

    Integer counts of layers (``num_hidden_layers``, ``n_layer``...) must lie from 0 to 100,000;
    head counts (``num_attention_heads``...) from 1, other sizes (``hidden_size``, ``vocab_size``...)
    from 0, to 2**31 - 1.  Values of other types (``null``, ``"x"``, ``1.5``) are left to
    transformers, whose strict configs name them; a list (per-layer sizes) is checked item by
    item; nested configs (``text_config``...) are checked too.

    Args:
        config: the config as a dict: ``config.json``'s content or ``config.to_dict()``.
        source: where it came from (a quoted path), for the message.

    Raises:
        ValueError: names the key (dotted inside a nested config), its value, ``source`` and the fix.
    """
    for key, value, (what, least, most) in _sizes(config):
        if type(value) is not int or least <= value <= most:  # other types: transformers' checks name them
            continue
        raise ValueError(
            f"In {source}, {key} is {value!r}, but a {what} must be a whole number from {least} to {most:,}; "
            f"correct {key} in that config (the model's published config.json has the value it was trained with)."
        )


def _rule(key: str) -> tuple[str, int, int] | None:
    """``(what, least, most)`` for a size key of a config, None for any other key."""
    if key in _LAYER_COUNTS:
        return "number of layers", 0, _MAX_LAYERS
    if key in _HEAD_COUNTS:
        return "number of heads", 1, _MAX_SIZE
    return ("size", 0, _MAX_SIZE) if key in _SIZES else None


def _sizes(config: Mapping[str, Any]) -> Iterator[tuple[str, Any, tuple[str, int, int]]]:
    """``(dotted key, value, rule)`` for each size of ``config`` and of the configs nested in it (no recursion)."""
    stack: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    while stack:
        prefix, mapping = stack.pop()
        for key, value in mapping.items():
            name, rule = f"{prefix}{key}", _rule(key)
            if isinstance(value, Mapping):
                stack.append((f"{name}.", value))
            elif rule is not None and isinstance(value, list):
                yield from ((f"{name}[{i}]", item, rule) for i, item in enumerate(value))
            elif rule is not None:
                yield name, value, rule


def declared_dtype(config: Any) -> torch.dtype | None:
    """The dtype a config declares (``dtype`` or ``torch_dtype``), None when it declares none."""
    has_dtype = hasattr(config, "dtype")  # transformers >= 4.56; reading torch_dtype there warns
    declared = getattr(config, "dtype", None) if has_dtype else getattr(config, "torch_dtype", None)
    if declared is None or declared == "auto":
        return None
    resolved = to_dtype(declared)
    return resolved if isinstance(resolved, torch.dtype) else None


def resolve_dtype(config: Any, dtype: torch.dtype | str | None, infos: Mapping[str, TensorInfo]) -> torch.dtype:
    """The dtype ``from_pretrained`` would load in: ``dtype``, else the config's, else the checkpoint's.

    As transformers' ``dtype="auto"`` (its default): a config without a dtype takes the
    first floating dtype stored in the checkpoint, float32 when it has none.

    Raises:
        ValueError: ``dtype`` is not a floating torch dtype.
    """
    if dtype is not None and dtype != "auto":
        resolved = to_dtype(dtype)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(f"dtype {dtype!r} is not a floating torch dtype; use e.g. 'bfloat16' or 'float16'.")
        return resolved
    stored = (info.dtype for info in infos.values() if info.dtype.is_floating_point)
    return declared_dtype(config) or next(stored, torch.float32)


def refuse_quantized(config: Any, source: str) -> None:
    """Refuse a config quantized by a transformers quantizer (bigmodel loads unquantized weights).

    Raises:
        ValueError: the config has a ``quantization_config`` (names the method and what to do).
    """
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    raise ValueError(
        f"The model in {source} is quantized by a transformers quantizer ({method or 'quantization_config'}), "
        "which bigmodel does not run; load it with transformers' from_pretrained(device_map=...), or use an "
        "unquantized checkpoint."
    )


def model_class_for(config: Any, model_class: type | str | None = None, source: str = "the config") -> type:
    """The transformers class to build for ``config``.

    Args:
        config: a transformers config.
        model_class: a class (a model class or an ``AutoModel*`` class) or the name of one in
            ``transformers``; None: the first of ``config.architectures``, else ``AutoModelForCausalLM``.
        source: what the config was read from, for error messages.

    Returns:
        The class.

    Raises:
        ValueError: the name is not a model class of the installed transformers (custom code
            from the hub included); says how to pick another with ``model_class``.
    """
    transformers = importlib.import_module("transformers")
    if model_class is not None and not isinstance(model_class, str):
        return model_class
    names = [model_class] if isinstance(model_class, str) else list(getattr(config, "architectures", None) or [])
    if not names:
        return transformers.AutoModelForCausalLM
    try:
        cls = getattr(transformers, names[0], None)
    except (ImportError, RuntimeError) as error:  # a class whose optional backend is not installed
        cls, missing = None, f"transformers cannot import it ({error})"
    else:
        missing = f"the installed transformers {transformers.__version__} has no such model class"
    if isinstance(cls, type) and (issubclass(cls, transformers.PreTrainedModel) or hasattr(cls, "from_config")):
        return cls
    custom = getattr(config, "auto_map", None)
    why = "it is custom code from the model's repository (auto_map), which bigmodel does not run" if custom else missing
    raise ValueError(
        f"Cannot build {names[0]!r} for {source}: {why}. Pass model_class= a transformers model class or its name "
        "(e.g. model_class='AutoModel', or a class you imported yourself), or load it with transformers' "
        "from_pretrained(device_map=...)."
    )


def require_causal_lm(config: Any, source: str = "the config") -> type:
    """The class :func:`model_class_for` builds for ``config``, checked to be a causal LM (text generation).

    A causal LM is what ``AutoModelForCausalLM`` builds for the config's class (its model
    mapping), or a subclass of it; a folder without ``architectures`` is read as one.

    Raises:
        ValueError: the class is not a causal LM (names it, the config's causal LM if any, and
            what works instead); raised from the config alone, before any weight is read.
    """
    transformers = importlib.import_module("transformers")
    cls = model_class_for(config, None, source)
    mapped = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    causal = mapped if isinstance(mapped, tuple) else (mapped,) if mapped is not None else ()
    if cls is transformers.AutoModelForCausalLM or any(issubclass(cls, c) for c in causal):
        return cls
    names = " or ".join(c.__name__ for c in causal)
    hint = f" (for a {type(config).__name__}: {names}, with weights for its head)" if names else ""
    raise ValueError(
        f"The model in {source} is a {cls.__name__} (config.json architectures), which is not a causal LM: "
        f"generate needs a *ForCausalLM model{hint}; `bigmodel estimate` and `bigmodel plan` work for any model."
    )


def build_on_meta(cls: type, config: Any, dtype: torch.dtype, source: str = "the config") -> nn.Module:
    """Build ``cls`` from ``config`` with every parameter on ``meta`` (buffers real), tied, in eval mode.

    Floating parameters are created in ``dtype``; those transformers keeps in float32 for
    that dtype are float32 (see :func:`keep_in_fp32`).

    Raises:
        ValueError: a size in the config no model can be built from (see :func:`check_config_sizes`), or
            the class cannot be built from this config (names both).
    """
    transformers = importlib.import_module("transformers")
    is_model = issubclass(cls, transformers.PreTrainedModel)
    check_config_sizes(config.to_dict() if hasattr(config, "to_dict") else {}, source)
    try:
        with init_empty_weights(include_buffers=False):  # buffers real, whatever ACCELERATE_INIT_INCLUDE_BUFFERS says
            model = cls._from_config(config, dtype=dtype) if is_model else cls.from_config(config, dtype=dtype)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"Cannot build {cls.__name__} from {source} ({error}); pass model_class= a class made for this "
            f"config (model_type {getattr(config, 'model_type', None)!r})."
        ) from error
    model.tie_weights()
    cast_to_fp32(model, keep_in_fp32(model, dtype))
    return model.eval()


def keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """State-dict names transformers loads in float32 when the model's dtype is ``dtype``.

    The patterns come from the model's own dtype plan (``_keep_in_fp32_modules`` apply under
    float16, ``_keep_in_fp32_modules_strict`` under float16 and bfloat16) and match as
    transformers matches them (a regular-expression search in the name).
    """
    plan_of = getattr(model, "_get_dtype_plan", None)
    if plan_of is None:  # transformers 4
        return []
    patterns = [p for p, kept in plan_of(dtype).items() if kept == torch.float32]
    if not patterns:
        return []
    from transformers.core_model_loading import build_glob_alternation

    search = build_glob_alternation(patterns)[0].search
    return [name for name, tensor in model.state_dict().items() if tensor.is_floating_point() and search(name)]


def cast_to_fp32(model: nn.Module, names: list[str]) -> None:
    """Make the tensors ``names`` of a (meta) model float32 in place; names tied to them follow."""
    wanted = set(names)
    slots = [
        (store, leaf, f"{prefix}.{leaf}" if prefix else leaf)
        for prefix, module in model.named_modules(remove_duplicate=False)
        for store in (module._parameters, module._buffers)
        for leaf in store
    ]
    chosen = {id(store[leaf]) for store, leaf, name in slots if name in wanted and store[leaf] is not None}
    replaced: dict[int, torch.Tensor] = {}
    for store, leaf, _ in slots:
        tensor = store[leaf]
        if tensor is None or id(tensor) not in chosen:
            continue
        if id(tensor) not in replaced:
            value = tensor.detach().to(torch.float32)
            is_param = isinstance(tensor, nn.Parameter)
            replaced[id(tensor)] = nn.Parameter(value, requires_grad=tensor.requires_grad) if is_param else value
        store[leaf] = replaced[id(tensor)]
    if names:
        logger.debug("Kept in float32 as transformers keeps them: %s", ", ".join(names))
