"""Named tensors of a module, placing one tensor on a device, and tied parameters."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .coverage import device_of, name_prefixes  # noqa: F401  (name_prefixes: its import path before core.coverage)
from .devices import DeviceSpec, empty_cache, torch_device
from .subclasses import is_tensor_subclass

logger = logging.getLogger(__name__)

# tied_params_map convention: data_ptr of the tensor in its storage → {execution device → tensor}.
TiedParamsMap = dict[int, dict[torch.device, torch.Tensor]]


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the parameters, then the buffers, of ``module``.

    Args:
        include_buffers: also yield buffers.
        recurse: include submodules (dotted names) instead of only direct tensors.
        remove_non_persistent: skip buffers registered with ``persistent=False`` (they are
            not in a state dict).
    """
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    skip = get_non_persistent_buffers(module, recurse=recurse, fqns=True) if remove_non_persistent else set()
    for name, buf in module.named_buffers(recurse=recurse):
        if name not in skip:
            yield name, buf


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers of ``module`` registered with ``persistent=False``.

    Args:
        module: the module.
        recurse: include the buffers of every submodule.
        fqns: with ``recurse``, dotted names relative to ``module`` (``"0.cache"``); else bare
            buffer names (``"cache"``), as the ecosystem's callers expect.

    Returns:
        A new set (the module's own bookkeeping is never changed).
    """
    names = set(module._non_persistent_buffers_set)
    if not recurse:
        return names
    for prefix, sub in module.named_modules():
        if fqns:
            names.update(f"{prefix}.{n}" if prefix else n for n in sub._non_persistent_buffers_set)
        else:
            names.update(sub._non_persistent_buffers_set)
    return names


class MissingTensorError(AttributeError, ValueError):
    """A module has no parameter or buffer of the given name: a ValueError as accelerate raises it,
    and an AttributeError (what a missing attribute is in torch)."""


def get_submodule_and_name(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """Resolve ``"a.b.weight"`` to ``(module.a.b, "weight")``.

    Raises:
        AttributeError: naming the missing submodule and the full tensor name.
    """
    path, _, name = tensor_name.rpartition(".")
    try:
        return (module.get_submodule(path) if path else module), name
    except AttributeError as err:
        raise AttributeError(f"{type(module).__name__} has no submodule {path!r} (looking up {tensor_name!r})") from err


def _cast(value: torch.Tensor, old: torch.Tensor | None, dtype: torch.dtype | None, non_blocking: bool) -> torch.Tensor:
    """With ``dtype``, floating values take it; int/bool values keep theirs, except into a floating
    current tensor (an integer checkpoint tensor for a float weight): they take ``dtype`` if it is
    floating, else the current tensor's dtype.  Without ``dtype``, the value takes the current
    tensor's dtype, whatever the two kinds: torch's ``load_state_dict`` rule, which accelerate's
    ``set_module_tensor_to_device`` follows (a float16 value for a bool mask stays a bool mask, an
    int32 value for an int64 ``position_ids`` becomes int64, an integer value for a float parameter
    becomes float)."""
    if dtype is not None:
        if value.is_floating_point():
            return value.to(dtype, non_blocking=non_blocking)
        if old is None or not old.is_floating_point() or is_tensor_subclass(value):
            return value
        target = dtype if dtype.is_floating_point else old.dtype
        return value.to(target, non_blocking=non_blocking)
    if old is None or old.dtype == value.dtype:
        return value
    if is_tensor_subclass(value) and not (value.is_floating_point() and old.is_floating_point()):
        return value  # a quantized wrapper (torchao) keeps its storage: only float-to-float casts apply
    return value.to(old.dtype, non_blocking=non_blocking)


def as_parameter(value: torch.Tensor, old: nn.Parameter) -> nn.Parameter:
    """A Parameter of ``old``'s class (quantised subclasses keep their ``__dict__`` settings) around ``value``."""
    requires_grad = old.requires_grad and value.is_floating_point()
    if (type(old) is nn.Parameter or getattr(type(old), "replaced_by_plain_parameter", False)
            or is_tensor_subclass(old) or is_tensor_subclass(value)):
        # A wrapper subclass (torchao) is a Parameter by a flag, not by its class: nn.Parameter keeps its
        # class.  An offloaded tensor's placeholder (it loads its value from its hook) is no class to keep.
        return nn.Parameter(value, requires_grad=requires_grad)
    extra = {k: v for k, v in old.__dict__.items() if k != "requires_grad"}
    return type(old)(value, requires_grad=requires_grad, **extra)


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: DeviceSpec,
    value: torch.Tensor | None = None,
    dtype: torch.dtype | str | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: TiedParamsMap | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put one parameter or buffer of ``module`` on ``device``, optionally with a new value.

    Args:
        module: the root module.
        tensor_name: dotted name, e.g. ``"layers.0.attn.q_proj.weight"``.
        device: target device spec (not ``"disk"``).
        value: new value (any device); its shape must equal the current tensor's.
        dtype: dtype for floating values (integer and bool values keep theirs); also casts the
            current tensor when ``value`` is None.  By default the value takes the current
            tensor's dtype, as torch's ``load_state_dict`` copies it (int and bool tensors too).
        fp16_statistics: quantisation statistics stored as ``module.SCB`` (bitsandbytes int8).
        tied_params_map: ``data_ptr → {device: tensor}``; when the value's storage already has a
            copy on ``device``, that copy is reused (tied weights materialised once per device).
        non_blocking: asynchronous host↔device copies.
        clear_cache: empty the accelerator cache after the move.

    Raises:
        ValueError: the module has no parameter or buffer of that name (``MissingTensorError``, also
            an AttributeError).  A missing submodule is an AttributeError.
        ValueError: the tensor is on ``meta`` and no value is given, or the value's shape differs
            (names the tensor and both shapes).
    """
    submodule, name = get_submodule_and_name(module, tensor_name)
    if name not in submodule._parameters and name not in submodule._buffers:
        raise MissingTensorError(
            f"{type(submodule).__name__} has no parameter or buffer named {name!r} ({tensor_name!r}); "
            "check the name against model.state_dict().keys()."
        )
    old = submodule._parameters[name] if name in submodule._parameters else submodule._buffers[name]
    target = torch_device(device) if not isinstance(device, torch.device) else device
    if dtype is not None and not isinstance(dtype, torch.dtype):
        from .sizes import to_dtype

        dtype = to_dtype(dtype)

    source = value if value is not None else old
    if source is None:
        return
    if value is None and old is not None and old.device.type == "meta" and target.type != "meta":
        raise ValueError(
            f"{tensor_name} is on the meta device and has no data; pass `value=` to place it on {target}."
        )
    if value is not None and old is not None and old.shape != value.shape:
        raise ValueError(
            f"Value for {tensor_name!r} has shape {tuple(value.shape)} but the model expects "
            f"{tuple(old.shape)}; the checkpoint does not match the model (check its config and path)."
        )
    if tied_params_map is not None and source.device.type != "meta" and not is_tensor_subclass(source):
        cached = tied_params_map.get(source.data_ptr(), {}).get(target)
        if cached is not None:
            slots = submodule._buffers if name in submodule._buffers else submodule._parameters
            slots[name] = cached  # type: ignore[assignment]
            return
    new = _cast(source, old, dtype, non_blocking).to(target, non_blocking=non_blocking)
    if name in submodule._buffers:
        submodule._buffers[name] = new
    else:
        param = old if isinstance(old, nn.Parameter) else nn.Parameter(old)
        if new is old:
            return
        submodule._parameters[name] = as_parameter(new.data if isinstance(new, nn.Parameter) else new, param)
    if fp16_statistics is not None:
        submodule.SCB = fp16_statistics.to(target)
    if tied_params_map is not None and value is not None and value.device.type != "meta" and not is_tensor_subclass(value):
        if value.data_ptr() in tied_params_map:
            tied_params_map[value.data_ptr()][target] = submodule._parameters.get(name, new)
    if clear_cache:
        empty_cache(target)


def hold_meta_placeholder(
    model: nn.Module, tensor_name: str, dtype: torch.dtype, memo: dict[int, torch.Tensor] | None = None
) -> None:
    """Replace a tensor of ``model`` by a ``meta`` tensor of the same shape in ``dtype`` (its value lives elsewhere).

    What a loader leaves for a tensor whose value it wrote to disk: the offload hook computes in
    ``dtype``, and a value the model held before (a buffer built with its initial value) never
    shadows the stored one.  A Parameter stays a Parameter of its class.

    Args:
        model: the root module.
        tensor_name: dotted name of the parameter or buffer.
        dtype: the dtype the model computes the tensor in.
        memo: id of a replaced tensor → its placeholder, shared across calls so tied names stay tied.

    Raises:
        AttributeError: the model has no such submodule (names it).
    """
    module, attr = get_submodule_and_name(model, tensor_name)
    slots = module._parameters if attr in module._parameters else module._buffers
    old = slots[attr]
    if old is None or (old.is_meta and old.dtype == dtype):
        return
    memo = {} if memo is None else memo
    new = memo.get(id(old))
    if new is None:
        if is_tensor_subclass(old):  # such subclasses mostly cannot be made on meta: a plain placeholder
            meta = torch.empty(old.shape, device="meta", dtype=dtype)
        else:
            meta = torch.empty_like(old, device="meta", dtype=dtype)
        new = memo[id(old)] = as_parameter(meta, old) if isinstance(old, nn.Parameter) else meta
    slots[attr] = new  # type: ignore[assignment]


def find_tied_parameters(model: nn.Module, **kwargs: object) -> list[list[str]]:
    """Groups of parameter names that share one Parameter object (tied weights).

    Extra keyword arguments (accepted by older callers of this API) are ignored.

    Returns:
        A list of groups, each a sorted list of ≥ 2 dotted names, e.g.
        ``[["lm_head.weight", "model.embed_tokens.weight"]]``; groups sorted by first name.
        Works on meta models: ties are found by object identity, not storage.
    """
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return sorted((sorted(names) for names in groups.values() if len(names) > 1), key=lambda g: g[0])


def retie_parameters(model: nn.Module, tied_params: Sequence[Sequence[str]]) -> None:
    """Make every name of each group point at one Parameter again (the first one not on ``meta``).

    Use after loading replaced tied parameters by separate tensors.  Groups whose members
    are all on ``meta`` are left alone.

    Raises:
        AttributeError: a name of a group is not a submodule path of ``model`` (names it).
    """
    for group in tied_params:
        params = [get_submodule_and_name(model, name) for name in group]
        source = next(
            (getattr(mod, attr) for mod, attr in params if getattr(mod, attr).device.type != "meta"), None
        )
        if source is None:
            continue
        for mod, attr in params:
            mod._parameters[attr] = source


def check_tied_parameters_on_same_device(tied_params: Sequence[Sequence[str]], device_map: Mapping[str, object]) -> None:
    """Log a warning for each tied group whose members the device map puts on different devices.

    Raises:
        KeyError: a member of a group is not covered by the device map (names it).
    """
    for group in tied_params:
        devices = {name: device_of(name, device_map) for name in group}
        if len(set(map(str, devices.values()))) > 1:
            logger.warning(
                "Tied parameters are on different devices: %s. Put their modules on one device in the device map.",
                devices,
            )


def get_module_size_with_ties(
    tied_params: Sequence[str],
    module_size: int,
    module_sizes: Mapping[str, int],
    modules_to_treat: Sequence[tuple[str, nn.Module]],
) -> tuple[int, list[str], list[nn.Module]]:
    """Size of a module together with the modules holding the partners of its tied parameters.

    Args:
        tied_params: names of parameters (outside the module) tied to the module's own.
        module_size: bytes of the module itself.
        module_sizes: bytes per name, from :func:`bigmodel.compute_module_sizes`.
        modules_to_treat: the ``(name, module)`` pairs still to place, searched for the partners.

    Returns:
        ``(bytes including the partner modules minus the shared tensors, partner names, partner modules)``.
    """
    names: list[str] = []
    modules: list[nn.Module] = []
    total = module_size
    for tied in tied_params:
        owner = next(((n, m) for n, m in modules_to_treat if not n or tied.startswith(n + ".")), None)
        if owner is None:
            continue
        names.append(owner[0])
        modules.append(owner[1])
        total += module_sizes.get(owner[0], 0) - module_sizes.get(tied, 0)
    return total, names, modules


def matches_module(name: str, modules: Iterable[str]) -> bool:
    """True if one of ``modules`` is a name segment or a dotted run of segments of ``name``.

    ``matches_module("model.layers.0.mlp.up.weight", ["mlp"])`` and ``[..., "layers.0"]`` are True;
    ``["mlp.up.w"]`` is not (segments match whole).
    """
    dotted = f".{name}."
    return any(f".{m.strip('.')}." in dotted for m in modules if m)


def loaded_dtype(
    name: str,
    source_dtype: torch.dtype,
    model_tensor: torch.Tensor | None,
    *,
    dtype: torch.dtype | None,
    keep_in_fp32: Iterable[str],
    use_model_dtype: bool,
) -> torch.dtype:
    """The dtype a checkpoint tensor is stored in once loaded (the rule of ``load_checkpoint_in_model``).

    The model's tensor decides whether the value is a float, as torch's ``load_state_dict`` copies
    a checkpoint tensor into the model's tensor: an integer or bool checkpoint tensor keeps its
    dtype unless the model tensor is floating, and a floating checkpoint tensor for an integer or
    bool model tensor (``position_ids`` saved as float16) takes the model's dtype.  A floating
    value then becomes float32 under ``keep_in_fp32`` modules; else ``dtype`` if given; else, with
    ``use_model_dtype`` (tensors placed in memory), the model tensor's floating dtype; else the
    checkpoint's dtype (an integer or bool checkpoint tensor: the model tensor's dtype).

    Raises:
        ValueError: a complex checkpoint tensor for a real model tensor (the cast would drop the
            imaginary part; names the tensor, both dtypes and the fix).
    """
    model_floating = model_tensor is not None and model_tensor.is_floating_point()
    if source_dtype.is_complex and model_tensor is not None and not model_tensor.is_complex():
        raise ValueError(
            f"Checkpoint tensor {name!r} is {source_dtype} but the model's is {model_tensor.dtype}: loading it would "
            "drop its imaginary part. Load the checkpoint this model was saved with (or convert that tensor first)."
        )
    if not source_dtype.is_floating_point:
        if not model_floating:
            return source_dtype
        fallback = model_tensor.dtype  # type: ignore[union-attr]  # an integer weight of a Linear computes nothing
    elif model_tensor is not None and not (model_floating or model_tensor.is_complex()):
        return model_tensor.dtype
    else:
        fallback = model_tensor.dtype if use_model_dtype and model_floating else source_dtype  # type: ignore[union-attr]
    if matches_module(name, keep_in_fp32):
        return torch.float32
    if dtype is not None:
        return dtype
    return fallback
