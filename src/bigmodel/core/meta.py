"""Build models without allocating their weights: ``init_empty_weights`` and ``init_on_device``.

Inside the context, every parameter registered on a module is moved to the target device
right at registration, so the initialisers that run afterwards (``reset_parameters``)
work on the target device (a no-op on ``meta``).  A parameter that is already on the
target device is kept as the same object, so ties made inside the context
(``b.weight = a.weight``) stay ties.  Contexts nest: the innermost one wins.

The registration hooks are installed on ``nn.Module`` when the first context opens (in any
thread) and the class gets back exactly what it held when the last one exits.  A function
another library installed there before (its own context open) keeps being called: bigmodel
wraps it instead of the original.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .devices import DeviceSpec
from .tensors import as_parameter


@dataclass(frozen=True)
class _Placement:
    device: torch.device
    include_buffers: bool


# The environment variable accelerate reads when ``include_buffers`` is None; honoured so that a
# deployment configured for accelerate builds the same models.
INCLUDE_BUFFERS_ENV = "ACCELERATE_INIT_INCLUDE_BUFFERS"
_TRUE = ("1", "y", "yes", "t", "true", "on")
_FALSE = ("0", "n", "no", "f", "false", "off")

# Open contexts are per thread (a model built in another thread meanwhile is unaffected);
# the class-level patch is shared, installed while any thread has a context open.
_LOCAL = threading.local()
_LOCK = threading.Lock()
_OPEN = [0]  # contexts open in all threads
_MISSING = object()
# What nn.Module's own __dict__ held for each patched name when the first context opened
# (put back when the last one exits), and the functions the patches call on (kept after
# exit, so a patch another library captured and reinstalls later still works).
_SAVED: dict[str, object] = {}
_WRAPPED: dict[str, object] = {
    "register_parameter": nn.Module.register_parameter,
    "register_buffer": nn.Module.register_buffer,
}


def _stack() -> list[_Placement]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _same_device(tensor: torch.Tensor, device: torch.device) -> bool:
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _WRAPPED["register_parameter"](module, name, param)
    stack = _stack()
    if param is None or not stack:
        return
    device = stack[-1].device
    if not _same_device(param, device):
        module._parameters[name] = as_parameter(param.data.to(device), param)


def _register_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
    _WRAPPED["register_buffer"](module, name, tensor, persistent=persistent)
    stack = _stack()
    if tensor is None or not stack or not stack[-1].include_buffers:
        return
    device = stack[-1].device
    if not _same_device(tensor, device):
        module._buffers[name] = tensor.to(device)


_PATCHES = {"register_parameter": _register_parameter, "register_buffer": _register_buffer}


def _install() -> None:
    """Put the registration hooks on nn.Module, remembering exactly what was there (called under _LOCK)."""
    for name, patch in _PATCHES.items():
        _SAVED[name] = vars(nn.Module).get(name, _MISSING)
        current = getattr(nn.Module, name)
        if current is not patch:  # a copy of ours left by another library must not wrap itself
            _WRAPPED[name] = current
        setattr(nn.Module, name, patch)


def _uninstall() -> None:
    """Give nn.Module back what :func:`_install` found (called under _LOCK).

    A name that holds another function now (another library's context opened inside ours and
    is still open) is left to that library, which puts back what it found when it exits.
    """
    for name, patch in _PATCHES.items():
        saved = _SAVED.pop(name, _MISSING)
        if vars(nn.Module).get(name) is not patch:
            continue
        if saved is _MISSING:
            delattr(nn.Module, name)
        else:
            setattr(nn.Module, name, saved)


# In-place initialisers that never change a tensor's metadata: on a meta tensor they have
# nothing to do, so they return at once instead of running torch's Python reference
# implementations (which dominate the cost of building a large model on meta).  Matched by
# name, because libraries wrap torch.nn.init (transformers swaps in its own ``normal_``).
_SHAPE_PRESERVING_INIT_OPS = frozenset(
    (
        "normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "copy_", "erfinv_", "mul_",
        "add_", "sub_", "div_", "clamp_", "exponential_", "bernoulli_", "random_", "log_normal_", "cauchy_",
        "geometric_", "masked_fill_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
        "xavier_normal_", "orthogonal_", "eye_", "dirac_", "sparse_",
    )
)


def _target(args: tuple, kwargs: dict) -> object:
    return args[0] if args else kwargs.get("tensor")


class _SkipMetaInit(TorchFunctionMode):
    """Return meta tensors untouched from in-place initialisers (their result carries no data)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _SHAPE_PRESERVING_INIT_OPS:
            tensor = _target(args, kwargs)
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def _default_include_buffers() -> bool:
    """``include_buffers`` when the caller passed None: the ``ACCELERATE_INIT_INCLUDE_BUFFERS``
    environment variable (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``), False if
    unset or empty.

    Raises:
        ValueError: the variable holds anything else (names it and the accepted values).
    """
    text = os.environ.get(INCLUDE_BUFFERS_ENV, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE or not text:
        return False
    raise ValueError(
        f"{INCLUDE_BUFFERS_ENV}={os.environ[INCLUDE_BUFFERS_ENV]!r} is not a boolean; set it to one of "
        f"{list(_TRUE)} or {list(_FALSE)}, or unset it."
    )


@contextlib.contextmanager
def init_on_device(device: DeviceSpec | torch.device, include_buffers: bool | None = None) -> Iterator[None]:
    """Context manager: parameters (and buffers if ``include_buffers``) created inside land on ``device``.

    Args:
        device: target device (``"meta"``, ``"cpu"``, ``0``, ``"cuda:1"``, a torch.device).
        include_buffers: also place buffers on ``device``.  None (the default) reads the
            environment variable ``ACCELERATE_INIT_INCLUDE_BUFFERS`` as accelerate does (False
            when unset); with True every tensor created inside the context (temporaries
            included) is created on ``device`` directly, which is the fastest way to build a model.

    Raises:
        ValueError: ``device`` is not a device spec, or names an accelerator torch cannot see;
            ``include_buffers`` is None and ``ACCELERATE_INIT_INCLUDE_BUFFERS`` is not a boolean.

    Example::

        with init_on_device("meta"):
            model = nn.Linear(100_000, 100_000)  # no memory used
    """
    from .devices import torch_device

    target = torch_device(device) if not isinstance(device, torch.device) else device
    if include_buffers is None:
        include_buffers = _default_include_buffers()
    placement = _Placement(target, bool(include_buffers))
    with _LOCK:
        if not _OPEN[0]:
            _install()
        _OPEN[0] += 1
    local = _stack()
    # An outer include_buffers context creates every tensor on its device; a real inner
    # target must then create them itself (a meta tensor cannot be copied to the cpu).
    outer_creates = any(p.include_buffers for p in local)
    local.append(placement)
    try:
        with contextlib.ExitStack() as stack:
            if placement.include_buffers or (outer_creates and target.type != "meta"):
                stack.enter_context(torch.device(target))
            if target.type == "meta":
                stack.enter_context(_SkipMetaInit())
            yield
    finally:
        local.remove(placement)
        with _LOCK:
            _OPEN[0] -= 1
            if not _OPEN[0]:
                _uninstall()


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Context manager: build a model whose parameters live on the ``meta`` device (no memory).

    Buffers stay real (on CPU) unless ``include_buffers`` is True (or, when it is None, the
    environment variable ``ACCELERATE_INIT_INCLUDE_BUFFERS`` is true, as with accelerate), so
    computed buffers such as rotary frequencies keep their values.  Load weights afterwards with
    :func:`bigmodel.load_checkpoint_and_dispatch`.

    Raises:
        ValueError: ``include_buffers`` is None and ``ACCELERATE_INIT_INCLUDE_BUFFERS`` is not a boolean.

    Example::

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield
