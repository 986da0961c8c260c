"""A hub checkpoint's keys as transformers reads them, for bigmodel's loader.

transformers 5 does not load every checkpoint key under its stored name: its conversion
mapping (``transformers.conversion_mapping.get_model_conversion_mapping``) renames keys
(GPT-NeoX ``embed_out`` → ``lm_head``, BERT ``LayerNorm.gamma`` → ``.weight``, ViT's old
layer names, wav2vec2 ``weight_g``/``weight_v``) and fuses others (MoE checkpoints store one
weight per expert; the model holds one tensor for all experts).  It also adds or strips the
``base_model_prefix`` when a head model is loaded from a bare model's checkpoint or the
reverse.  :func:`prepare_checkpoint` asks transformers for that mapping and applies it key
by key with transformers' own functions (``rename_source_key`` and each converter's
``convert``), so bigmodel loads exactly the tensors ``from_pretrained`` would; renamed
tensors keep bigmodel's zero-copy path, fused ones are built as their experts are read.

It also settles tied weights as ``from_pretrained`` does (a pair stored twice with
different values is untied) and refuses a checkpoint that lacks parameters, which
transformers would initialise at random.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..checkpoints.files import SafetensorsFile, TensorInfo, load_torch_file
from ..core.tensors import find_tied_parameters
from ..loading.conversion import KeyConversion, TensorRecipe, convert_infos
from ..loading.key_checks import listed

logger = logging.getLogger(__name__)


def prepare_checkpoint(model: nn.Module, infos: Mapping[str, TensorInfo], source: str) -> KeyConversion | None:
    """The conversion of a checkpoint's keys to ``model``'s names, after settling its tied weights.

    Args:
        model: a transformers model on ``meta`` (see :func:`bigmodel.integrations.hf_models.build_on_meta`).
        infos: the checkpoint's tensor headers (key → dtype, shape, file).
        source: the model folder, for error messages.

    Returns:
        The conversion (None with transformers 4 when it changes nothing: keys load as stored).
        Keys transformers drops without a word (see :func:`ignorable_keys`) are left unread.
        Tied pairs stored twice with different values are untied on ``model``, as transformers
        unties them.

    Raises:
        ValueError: a parameter of the model is in no checkpoint key (names them and the fix);
            a fused tensor cannot be built from the checkpoint's shapes.
    """
    conversion = transformers_conversion(model, infos)
    converted = convert_infos(infos, conversion)
    conversion = _without_ignorable(conversion, converted.infos, model)
    stored = {name: info.name for name, info in converted.infos.items() if name not in converted.built}
    untie_differing(model, converted.infos, stored)
    missing = missing_parameters(model, converted.infos)
    if missing:
        raise ValueError(
            f"The checkpoint in {source} has no weights for {len(missing)} parameter(s) of {type(model).__name__}: "
            f"{listed(missing)} are missing. transformers would initialise them at random, which bigmodel cannot "
            "reproduce: load the class the checkpoint was saved from (model_class=, default: config.architectures) "
            "or a checkpoint that holds them."
        )
    return conversion


def ignorable_keys(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The checkpoint tensor names (model-side) that ``from_pretrained`` drops without warning.

    Those the model does not hold that either match one of the model's
    ``_keys_to_ignore_on_load_unexpected`` patterns (regular expressions, searched in the name;
    transformers gathers the submodules' patterns on the model), or name a non-persistent
    buffer: the buffer itself (``embeddings.position_ids``, saved by older versions), or one of
    the same ``module.buffer`` ending elsewhere (per-layer ``rotary_emb.inv_freq`` of older
    checkpoints, now one buffer of the model).
    """
    expected = model.state_dict()
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    transient = {name for name, _ in model.named_buffers()} - set(expected)
    endings = {".".join(name.split(".")[-2:]) for name in transient}
    return sorted(
        name for name in names if name not in expected
        and (name in transient or ".".join(name.split(".")[-2:]) in endings or any(p.search(name) for p in patterns))
    )  # fmt: skip


def _without_ignorable(
    conversion: KeyConversion | None, infos: Mapping[str, TensorInfo], model: nn.Module
) -> KeyConversion | None:
    """``conversion`` that also leaves unread the checkpoint keys of :func:`ignorable_keys`."""
    dropped = ignorable_keys(model, infos)
    if not dropped:
        return conversion
    logger.debug("Not loading %s, as transformers does not: %s", type(model).__name__, ", ".join(dropped))
    keys = frozenset(infos[name].name for name in dropped)
    return replace(conversion or KeyConversion(), ignored=(conversion or KeyConversion()).ignored | keys)


def transformers_conversion(model: nn.Module, infos: Mapping[str, TensorInfo]) -> KeyConversion | None:
    """Rename and fuse checkpoint keys with transformers' own mapping for ``model`` (transformers 5).

    Records the transforms that matched as ``model._weight_conversions``, as ``from_pretrained``
    does, so that ``save_pretrained`` writes the checkpoint back in its original layout.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # transformers 4: keys are loaded as stored
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    renames: dict[str, str] = {}
    claimed: dict[str, str] = {}  # model name → the checkpoint key that fills it
    ignored: set[str] = set()
    groups: dict[str, list[tuple[str, str]]] = {}  # first target name → [(checkpoint key, source pattern)]
    for key in sorted(infos, key=dot_natural_key):  # transformers' order: experts stack as 0, 1, ..., 10
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if name not in expected and key in expected:  # a rule matched a key that is already right
            name, pattern = rename_source_key(key, [], [], prefix, expected)
        if pattern is None:
            if claimed.setdefault(name, key) != key:  # a second key for one name: transformers keeps the first
                ignored.add(key)
            elif name != key:
                renames[key] = name
        elif name in expected:
            groups.setdefault(name, []).append((key, pattern))
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    recipes = [
        TensorRecipe(tuple(key for key, _ in members), _fuse(by_pattern[members[0][1]], name, members, model))
        for name, members in groups.items()
    ]
    model._weight_conversions = [t for t in transforms if t.was_used()]
    return KeyConversion(renames, recipes, frozenset(ignored))


def _fuse(template: Any, first_target: str, members: Sequence[tuple[str, str]], model: nn.Module) -> Any:
    """A recipe's build function: a fresh copy of transformers' converter, fed in checkpoint order."""

    def build(tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(template)  # converters collect state; one copy per build
        for (key, pattern), tensor in zip(members, tensors):
            converter.add_tensor(first_target, key, pattern, tensor)
        built = converter.convert(first_target, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in built.items()}

    return build


def untie_differing(model: nn.Module, infos: Mapping[str, TensorInfo], stored: Mapping[str, str]) -> list[str]:
    """Untie the tied pairs the checkpoint stores twice with different values, as transformers does.

    transformers ties ``target`` to ``source`` (``model.all_tied_weights_keys``); when the
    checkpoint holds both and they differ once cast to the model's dtype, it keeps them
    apart (and warns).  Returns the untied targets.
    """
    pairs = dict(getattr(model, "all_tied_weights_keys", None) or {})
    untied = []
    for target, source in pairs.items():
        if target not in stored or source not in stored:
            continue
        param = model.get_parameter(target)
        values = [_read(infos[name], stored[name]).to(param.dtype) for name in (target, source)]
        if values[0].shape == values[1].shape and torch.equal(*values):
            continue
        logger.warning(
            "The checkpoint holds %s and %s, tied in %s, with different values: they are loaded untied, as "
            "transformers loads them (set tie_word_embeddings=False in config.json to silence this).",
            target, source, type(model).__name__,
        )  # fmt: skip
        module_name, _, leaf = target.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, leaf, nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad))
        model.all_tied_weights_keys.pop(target, None)
        untied.append(target)
    return untied


def _read(info: TensorInfo, key: str) -> torch.Tensor:
    if info.is_safetensors:
        return SafetensorsFile(info.file).tensor(key)
    return load_torch_file(info.file)[key]


def missing_parameters(model: nn.Module, infos: Mapping[str, TensorInfo]) -> list[str]:
    """Parameter names of ``model`` that no checkpoint tensor fills, directly or through a tied name."""
    filled = set(infos)
    for group in find_tied_parameters(model):
        if filled.intersection(group):
            filled.update(group)
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    return sorted(name for name in names if name not in filled)
