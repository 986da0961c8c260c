"""Checkpoints whose keys are not the model's tensor names: renamed keys and tensors built from several.

A :class:`KeyConversion` says, for one checkpoint and one model, which checkpoint key fills
which model tensor.  Most keys are renamed one to one (``embed_out.weight`` →
``lm_head.weight``); such a tensor is loaded like any other (zero-copy on CPU, a pointer
into the safetensors file when it goes to disk).  A :class:`TensorRecipe` builds model
tensors from several checkpoint tensors (e.g. one weight per expert stacked into one fused
tensor): the loader collects its sources while streaming and builds it when the last one
has been read, so only the sources of one recipe are held at a time (memory-mapped views).

This module is framework-neutral: it knows nothing of any library's naming rules; an
integration (``bigmodel.integrations``) computes the conversion and hands it to the loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..checkpoints.files import TensorInfo

# Given the source tensors in the recipe's order, the model tensors it builds: name → tensor.
BuildFn = Callable[[Sequence[torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorRecipe:
    """Model tensors built from several checkpoint tensors.

    Attributes:
        sources: the checkpoint keys read, in the order ``build`` receives them.
        build: source tensors → ``{model tensor name: tensor}``.  It must work on ``meta``
            tensors too: the loader calls it on them first to learn the names, shapes and
            dtypes it produces, before anything is read or modified.
    """

    sources: tuple[str, ...]
    build: BuildFn


@dataclass(frozen=True)
class KeyConversion:
    """How a checkpoint's keys become a model's tensor names.

    Attributes:
        renames: checkpoint key → model tensor name; keys not listed keep their name.
        recipes: tensors built from several checkpoint keys (a key is in at most one recipe).
        ignored: checkpoint keys not to load (e.g. a second key for a name another key fills).
    """

    renames: Mapping[str, str] = field(default_factory=dict)
    recipes: Sequence[TensorRecipe] = ()
    ignored: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ConvertedInfos:
    """The model-side view of a checkpoint: what each model tensor name is filled from.

    Attributes:
        infos: model tensor name → dtype/shape (and file, for a renamed tensor: its own).
        built: the names that recipes build (they have no file of their own).
        shadowed: checkpoint keys left unread: ignored ones, and those whose model name another
            key fills (the first key in checkpoint order wins; a recipe wins over a renamed key).
    """

    infos: dict[str, TensorInfo]
    built: frozenset[str] = frozenset()
    shadowed: frozenset[str] = frozenset()


def convert_infos(infos: Mapping[str, TensorInfo], conversion: KeyConversion | None) -> ConvertedInfos:
    """Apply ``conversion`` to a checkpoint's tensor headers (recipes run on ``meta`` tensors).

    Args:
        infos: checkpoint key → header, from :func:`bigmodel.checkpoints.files.read_tensor_infos`.
        conversion: the conversion; None keeps every key.

    Returns:
        The headers keyed by model tensor name.

    Raises:
        ValueError: a recipe names a key the checkpoint lacks, or fails on meta tensors
            (names its sources and the error).
    """
    if conversion is None:
        return ConvertedInfos(dict(infos))
    built: dict[str, TensorInfo] = {}
    for recipe in conversion.recipes:
        for name, tensor in _build_on_meta(recipe, infos).items():
            built[name] = TensorInfo(name, tensor.dtype, tuple(tensor.shape), infos[recipe.sources[0]].file)
    consumed = {key for recipe in conversion.recipes for key in recipe.sources}
    result: dict[str, TensorInfo] = {}
    shadowed: set[str] = set()
    for key, info in infos.items():
        if key in consumed:
            continue
        name = conversion.renames.get(key, key)
        if key in conversion.ignored or name in result or name in built:
            shadowed.add(key)
        else:
            result[name] = info
    return ConvertedInfos({**result, **built}, frozenset(built), frozenset(shadowed))


def _build_on_meta(recipe: TensorRecipe, infos: Mapping[str, TensorInfo]) -> Mapping[str, torch.Tensor]:
    absent = [key for key in recipe.sources if key not in infos]
    if absent:
        raise ValueError(
            f"A tensor conversion reads {absent[0]!r}, which the checkpoint does not hold; "
            "check that the checkpoint is complete (every shard listed in its index is present)."
        )
    metas = [torch.empty(infos[k].shape, dtype=infos[k].dtype, device="meta") for k in recipe.sources]
    try:
        return recipe.build(metas)
    except Exception as error:
        sources = ", ".join(recipe.sources[:4]) + (" ..." if len(recipe.sources) > 4 else "")
        raise ValueError(
            f"Cannot convert the checkpoint tensors {sources} into the model's layout ({error}); "
            "check that the checkpoint was written for this model's config."
        ) from error


class TensorRouter:
    """Turns the stream of checkpoint tensors into a stream of model tensors.

    ``route(key, tensor)`` yields ``(model name, tensor, checkpoint key or None)``: the key
    is None for a built tensor (it exists in no file).  Sources of a recipe are held until
    its last one arrives.
    """

    def __init__(self, conversion: KeyConversion | None, shadowed: frozenset[str] = frozenset()) -> None:
        self._renames = conversion.renames if conversion is not None else {}
        self._shadowed = shadowed  # see ConvertedInfos.shadowed
        self._recipe_of: dict[str, TensorRecipe] = {}
        for recipe in conversion.recipes if conversion is not None else ():
            for key in recipe.sources:
                self._recipe_of[key] = recipe
        self._held: dict[int, dict[str, torch.Tensor]] = {}

    def route(self, key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, str | None]]:
        recipe = self._recipe_of.get(key)
        if recipe is None:
            if key not in self._shadowed:
                yield self._renames.get(key, key), tensor, key
            return
        held = self._held.setdefault(id(recipe), {})
        held[key] = tensor
        if len(held) < len(recipe.sources):
            return
        del self._held[id(recipe)]
        built = recipe.build([held[k] for k in recipe.sources])
        held.clear()
        for name, value in built.items():
            yield name, value, None

    def unfinished(self) -> list[str]:
        """Checkpoint keys held by recipes that never received all their sources."""
        return sorted(k for held in self._held.values() for k in held)
