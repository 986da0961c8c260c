"""Pinned host memory: page-locked copies of CPU weights, and giving that memory back.

- :func:`pin_tensors` — page-locked copies of CPU-resident weights, so host→device copies run
  asynchronously at full bus speed.  Opt out with ``enabled=False`` or ``BIGMODEL_PIN_MEMORY=0``
  (pinning holds a second copy of the weights while the caller keeps the originals).
- :func:`pin_module_tensors` — moves a module's own CPU tensors into pinned memory in place, one
  arena at a time, so a model is never held twice in RAM while it is pinned.
- :func:`empty_host_cache` — torch's host allocator keeps freed pinned blocks page-locked in a
  cache; this gives them back to the OS.  It runs after a failed pin, before each new pinning,
  when a staging buffer is outgrown, and when a model whose weights were pinned (``owner=``) is
  deleted.

Whether memory is pinned depends on :func:`bigmodel.core.devices.accelerator_type` only (no backend
named here).  On a machine without an accelerator pinning is the identity.  Nothing here casts:
tensors keep their storage dtype.  The pinned staging ring for disk weights is
:mod:`bigmodel.transfer.staging`; the copies themselves (side streams, events)
:mod:`bigmodel.transfer.copies`.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..core.devices import accelerator_type
from ..core.subclasses import (
    check_flattenable,
    flatten_tensor,
    is_tensor_subclass,
    unflatten_tensor,
)

logger = logging.getLogger(__name__)

PIN_MEMORY_ENV = "BIGMODEL_PIN_MEMORY"
# Host allocators (CUDA's among them) round every pinned allocation up to a power of two, so
# many tensors are packed into shared arenas of at least this size (bytes, a power of two).
PINNED_ARENA_BYTES = 256 * 2**20
# Offsets inside pinned arenas and the staging buffer are multiples of this (bytes): every
# dtype view is aligned and copies start on DMA-friendly boundaries.
ALIGNMENT = 512

_FALSE = ("0", "false", "no", "off")
_TRUE = ("", "1", "true", "yes", "on")


def _align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _same_tensor_key(tensor: torch.Tensor) -> tuple:
    """Identity of a tensor's data: tied tensors (same storage, offset, shape, strides) share it."""
    storage = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


# ----------------------------------------------------------------------------- pinned memory


def pin_memory_enabled(enabled: bool = True) -> bool:
    """Whether host memory should be pinned: asked for, allowed by the environment, accelerator present.

    Args:
        enabled: the caller's choice; False always wins.

    Returns:
        True when ``enabled``, ``BIGMODEL_PIN_MEMORY`` is unset or true, and torch sees an accelerator.

    Raises:
        ValueError: if ``BIGMODEL_PIN_MEMORY`` holds something other than 0/1/true/false/yes/no/on/off.
    """
    value = os.environ.get(PIN_MEMORY_ENV, "1").strip().lower()
    if value not in _FALSE + _TRUE:
        raise ValueError(
            f"{PIN_MEMORY_ENV}={os.environ[PIN_MEMORY_ENV]!r} is not a switch; set it to 0 to turn "
            "pinned host memory off (RAM-tight machines) or 1 to allow it."
        )
    return bool(enabled) and value not in _FALSE and accelerator_type() is not None


def _pinned_arena(nbytes: int) -> torch.Tensor:
    with torch.inference_mode(False):  # kept across forwards: never an inference tensor
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _byte_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``buffer[offset:]`` with ``like``'s dtype and shape (contiguous)."""
    return buffer[offset : offset + _nbytes(like)].view(like.dtype).view(like.shape)


def _plan_arenas(sizes: list[int], arena_bytes: int) -> tuple[list[int], list[tuple[int, int]]]:
    """First-fit packing of byte sizes into power-of-two arenas: (arena sizes, (arena, offset) per size)."""
    arenas: list[list[int]] = []  # [capacity, used]
    places: list[tuple[int, int]] = []
    for size in sizes:
        need = _align(size)
        for index, (capacity, used) in enumerate(arenas):
            if used + need <= capacity:
                places.append((index, used))
                arenas[index][1] += need
                break
        else:
            capacity = max(arena_bytes, 1 << max(need - 1, 0).bit_length())
            arenas.append([capacity, need])
            places.append((len(arenas) - 1, 0))
    # The allocator rounds to a power of two anyway; shrink each arena to what it really holds.
    return [1 << max(used - 1, 0).bit_length() for _, used in arenas], places


def _empty_host_cache() -> None:
    """Give the host allocator's cached (freed, still page-locked) pinned blocks back to the OS."""
    if accelerator_type() is None:
        return
    release = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is None:
        return
    try:
        release()
    except RuntimeError as error:  # a backend without a host cache
        logger.debug("Could not empty the pinned host cache: %s", error)


def empty_host_cache() -> None:
    """Return freed pinned host memory, which torch's host allocator keeps page-locked, to the OS.

    Pinned blocks whose copies may still be running stay cached until a later call.  A no-op
    on a machine without an accelerator.
    """
    _empty_host_cache()


class PinnedTensors(dict):
    """name → pinned tensor, as :func:`pin_tensors` returns it (a dict that can be weakly referenced)."""

    __slots__ = ("__weakref__",)


def _release(ref: weakref.ref) -> None:
    pinned = ref()
    if pinned is not None:
        pinned.clear()  # the owner is gone: nothing reads these values any more
    _empty_host_cache()


def _release_with_owner(owner: object, pinned: PinnedTensors) -> None:
    """Give ``pinned``'s memory back to the OS when ``owner`` (the model reading it) is deleted."""
    finalizer = weakref.finalize(owner, _release, weakref.ref(pinned))
    finalizer.atexit = False  # at interpreter exit the OS takes it all back anyway


def _warn_unpinned(nbytes: int, error: object) -> None:
    logger.warning(
        "Could not pin %d bytes of host memory (%s); copies stay pageable and slower. "
        "Set %s=0 to skip pinning on this machine.", nbytes, error, PIN_MEMORY_ENV,
    )


def _group_by_data(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[tuple, list[str]], dict[tuple, torch.Tensor]]:
    """Names and first tensor per distinct data (tied tensors share one entry)."""
    names: dict[tuple, list[str]] = {}
    first: dict[tuple, torch.Tensor] = {}
    for name, tensor in tensors:
        key = _same_tensor_key(tensor)
        names.setdefault(key, []).append(name)
        first.setdefault(key, tensor)
    return names, first


def _fill_arenas(first: dict[tuple, torch.Tensor], place: Any) -> int:
    """Copy each tensor of ``first`` into pinned arenas, one arena at a time; ``place(key, pinned)``
    is called for each as soon as its copy is done (the caller drops its source there).

    Returns:
        Bytes pinned.

    Raises:
        RuntimeError: an arena could not be pinned (those filled before stay with the caller).
    """
    keys = list(first)
    sizes, places = _plan_arenas([_nbytes(first[k]) for k in keys], PINNED_ARENA_BYTES)
    by_arena: list[list[tuple[tuple, int]]] = [[] for _ in sizes]
    for key, (index, offset) in zip(keys, places):
        by_arena[index].append((key, offset))
    done = 0
    with torch.no_grad():
        for size, members in zip(sizes, by_arena):
            arena = _pinned_arena(size)
            for key, offset in members:
                pinned = _byte_view(arena, offset, first[key])
                pinned.copy_(first.pop(key))
                place(key, pinned)
            done += size
    return done


def check_pinnable(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse, before anything is pinned, a CPU tensor whose values pinning cannot reach.

    Args:
        tensors: ``(name, tensor)`` pairs (a state dict's ``items()``); tensors not on the CPU are skipped.

    Raises:
        TypeError: a tensor subclass that intercepts ops (``__torch_dispatch__``) without implementing
            ``__tensor_flatten__``/``__tensor_unflatten__`` (its own storage holds no values, and its
            parts cannot be named), or whose ``__tensor_flatten__`` fails; names the tensor and the fix.
    """
    for name, tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            check_flattenable(tensor, name, pinning=True)


def pin_tensors(tensors: Mapping[str, torch.Tensor], enabled: bool = True, *,
                owner: object | None = None) -> dict[str, torch.Tensor]:
    """Page-locked copies of CPU tensors, for asynchronous host→device copies.

    Call it once with all CPU-resident weights of a model rather than per module: the tensors
    are packed into shared pinned arenas (powers of two, at least ``PINNED_ARENA_BYTES``)
    because host allocators round each pinned allocation up to a power of two, which would
    otherwise waste up to half of the pinned RAM.  Tied tensors are pinned once and stay shared.
    Tensors already pinned, or not on the CPU, are returned as they are.  A wrapper tensor
    subclass (torchao's quantized weights) comes back as the same subclass around pinned copies
    of its inner tensors.  The copies are
    contiguous plain tensors of the same dtype and shape (never cast).  If pinning fails part
    way (the OS limits locked memory), the arenas pinned so far are freed and given back to the
    OS, and the tensors are returned unpinned.

    Args:
        tensors: name → tensor.
        enabled: False returns the tensors unchanged (so does ``BIGMODEL_PIN_MEMORY=0`` and a
            machine without an accelerator).
        owner: the object that reads the pinned copies (the model): when it is deleted, the
            returned dict is emptied and the pinned memory given back to the OS.

    Returns:
        A new dict (a :class:`PinnedTensors`) name → tensor (the same objects when pinning is off).

    Raises:
        ValueError: if ``BIGMODEL_PIN_MEMORY`` is not a switch.
        TypeError: a CPU tensor is a subclass that cannot be pinned (see :func:`check_pinnable`);
            raised before anything is pinned.
    """
    if not pin_memory_enabled(enabled):
        return dict(tensors)
    check_pinnable(tensors.items())
    if any(is_tensor_subclass(t) for t in tensors.values()):
        return _pin_subclasses(tensors, owner)
    todo, first = _group_by_data(
        (name, t) for name, t in tensors.items() if t.device.type == "cpu" and not t.is_pinned() and t.numel()
    )
    out = PinnedTensors(tensors)
    if todo:
        _empty_host_cache()  # blocks freed since the last pinning go back before more is locked
        total = sum(_align(_nbytes(t)) for t in first.values())
        error = _pin_into(out, todo, first)
        if error is not None:  # the partial arenas died with _pin_into's frame: give them back
            _empty_host_cache()
            _warn_unpinned(total, error)
            return dict(tensors)
    if owner is not None:
        _release_with_owner(owner, out)
    return out


def _pin_subclasses(tensors: Mapping[str, torch.Tensor], owner: object | None) -> dict[str, torch.Tensor]:
    """:func:`pin_tensors` where some values are wrapper subclasses (torchao): their inner tensors are
    pinned with the rest, and each subclass is rebuilt around its pinned parts (never dequantized)."""
    flat: dict[str, torch.Tensor] = {}
    specs = {}
    for name, tensor in tensors.items():
        if is_tensor_subclass(tensor):
            parts, specs[name] = flatten_tensor(tensor, name)
            flat.update({f"{name}#{path}": part for path, part in parts.items()})
        else:
            flat[name] = tensor
    pinned = pin_tensors(flat)
    out = PinnedTensors()
    for name, tensor in tensors.items():
        spec = specs.get(name)
        out[name] = pinned[name] if spec is None else unflatten_tensor(
            spec, {path: pinned[f"{name}#{path}"] for path in spec.part_names()}
        )
    if owner is not None:
        _release_with_owner(owner, out)
    return out


def _pin_into(out: dict[str, torch.Tensor], todo: dict[tuple, list[str]], first: dict[tuple, torch.Tensor]) -> str | None:
    """Replace ``out``'s entries by pinned copies; on failure restore them and return the error text."""
    originals = dict(out)
    try:
        done = _fill_arenas(first, lambda key, pinned: out.update(dict.fromkeys(todo[key], pinned)))
    except RuntimeError as error:  # page-locking can fail when the OS limits locked memory
        out.update(originals)
        return str(error)
    logger.debug("Pinned %d tensors (%d bytes).", len(todo), done)
    return None


def pin_module_tensors(module: nn.Module, prefixes: Iterable[str] | None = None, enabled: bool = True) -> int:
    """Move ``module``'s own CPU tensors into pinned memory, in place, one arena at a time.

    Each parameter and buffer keeps its object (and ``requires_grad``); its data is replaced by
    a pinned copy (contiguous, same dtype and values) as soon as its arena is filled, so the old
    memory is freed arena by arena: pinning a model held in RAM needs one arena more, not a
    second model.  Tensor subclasses, non-CPU, empty and already pinned tensors are left alone.
    If pinning fails part way, the tensors pinned so far stay pinned and the rest pageable.

    Args:
        module: the model.
        prefixes: module names (``""`` for all) whose tensors are pinned; None pins all of them.
        enabled: False does nothing (so does ``BIGMODEL_PIN_MEMORY=0`` and a machine without
            an accelerator).

    Returns:
        Bytes of pinned arenas filled.

    Raises:
        ValueError: if ``BIGMODEL_PIN_MEMORY`` is not a switch.
    """
    if not pin_memory_enabled(enabled):
        return 0
    wanted = None if prefixes is None else tuple(prefixes)
    groups: dict[tuple, list[torch.Tensor]] = {}
    first: dict[tuple, torch.Tensor] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if wanted is not None and not any(p == "" or name == p or name.startswith(p + ".") for p in wanted):
            continue
        if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.device.type != "cpu" or not tensor.numel() \
                or tensor.layout != torch.strided or tensor.is_pinned():
            continue
        key = _same_tensor_key(tensor)
        if all(tensor is not other for other in groups.setdefault(key, [])):
            groups[key].append(tensor)
        first.setdefault(key, tensor)
    if not first:
        return 0
    total = sum(_nbytes(t) for t in first.values())
    _empty_host_cache()

    def place(key: tuple, pinned: torch.Tensor) -> None:
        for tensor in groups.pop(key):
            tensor.data = pinned  # the old storage is freed once its last user is swapped

    try:
        _fill_arenas(first, place)
        return total
    except RuntimeError as error:  # page-locking can fail when the OS limits locked memory
        message = str(error)
    left = sum(_nbytes(t) for t in first.values())
    _empty_host_cache()
    _warn_unpinned(left, message)
    return total - left
