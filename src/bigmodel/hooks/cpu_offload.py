"""The whole-model offload hooks of ``cpu_offload_with_hook``: ``CpuOffload``, ``PinnedCpuOffload``, ``UserCpuOffloadHook``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..transfer.copies import CopyStream
from ..transfer.pinned import pin_tensors
from .align import default_execution_device
from .moving import send_to_device
from .registry import ModelHook, remove_hook_from_module

__all__ = ["CpuOffload", "PinnedCpuOffload", "UserCpuOffloadHook", "move_values"]


def move_values(module: nn.Module, device: Any) -> nn.Module:
    """``module.to(device)`` for the tensors that hold values; placeholders of offloaded tensors stay on ``meta``.

    The tensors move as ``Module.to`` moves them (Parameter objects kept).  A model whose parts
    are offloaded by other hooks (``cpu_offload`` then ``cpu_offload_with_hook``, or the reverse)
    moves its resident parts; the offloading hooks bring the others' values at their forwards.
    The moved tensors stay in the module after the forward: they are never inference tensors,
    even when the move happens inside ``torch.inference_mode()``.
    """
    with torch.inference_mode(False):
        return type(module)._apply(module, lambda t: t if t.is_meta else t.to(device))


class CpuOffload(ModelHook):
    """Moves the whole module to ``execution_device`` at its forward; it stays there until offloaded.

    Args:
        execution_device: where the forward runs (default: the first accelerator, else the CPU).
        prev_module_hook: a :class:`UserCpuOffloadHook` whose model is sent back to the CPU
            when this module's forward starts (chains of models run one after another).
    """

    def __init__(self, execution_device: Any = None, prev_module_hook: UserCpuOffloadHook | None = None) -> None:
        self.execution_device = execution_device if execution_device is not None else default_execution_device()
        self.prev_module_hook = prev_module_hook

    def init_hook(self, module: nn.Module) -> nn.Module:
        return move_values(module, "cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        move_values(module, self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's tensors that hold values (offloaded placeholders on ``meta`` are not moved)."""
    return {n: t for n, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_meta}


class PinnedCpuOffload(CpuOffload):
    """:class:`CpuOffload` towards an accelerator: the CPU copy of the model is pinned once and reused.

    Offloading copies the device values back into the same pinned tensors (changes made on the
    device are kept); the forward's move to the device is a side-stream copy from pinned memory
    (:class:`~bigmodel.transfer.copies.CopyStream`) that the device's current stream waits for.  The
    pinned copy stays allocated while the model is on the device (``BIGMODEL_PIN_MEMORY=0``
    turns pinning off; the CPU copy is then pageable but still kept).
    """

    def __init__(self, execution_device: Any = None, prev_module_hook: UserCpuOffloadHook | None = None) -> None:
        super().__init__(execution_device, prev_module_hook)
        self._host: dict[str, torch.Tensor] = {}
        self._copies: CopyStream | None = None

    def init_hook(self, module: nn.Module) -> nn.Module:  # also what UserCpuOffloadHook.offload() runs
        tensors = _own_tensors(module)
        if set(tensors) != set(self._host):  # first call, or the module gained/lost tensors
            move_values(module, "cpu")
            tensors = _own_tensors(module)
            self._host = pin_tensors({name: t.detach() for name, t in tensors.items()})
            for name, tensor in tensors.items():
                tensor.data = self._host[name]
            return module
        for name, tensor in tensors.items():
            host = self._host[name]
            if tensor.data_ptr() != host.data_ptr():
                host.copy_(tensor.detach())  # device → pinned host (blocking): changes made on the device stay
                tensor.data = host
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        if self._copies is None:
            self._copies = CopyStream(self.execution_device)
        device = self._copies.device
        tensors = _own_tensors(module)
        with torch.inference_mode(False):  # the copies stay in the module after the forward
            moved = self._copies.copy({n: t.detach() for n, t in tensors.items() if t.device != device}).wait()
            for name, value in moved.items():
                tensors[name].data = value
        return send_to_device(args, device), send_to_device(kwargs, device)


class UserCpuOffloadHook:
    """Handle returned by ``cpu_offload_with_hook``: ``offload()`` sends the model back to the CPU,
    ``remove()`` removes the hook."""

    def __init__(self, model: nn.Module, hook: ModelHook) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model back to the CPU (it comes back to the device at its next forward)."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook from the model (the model stays where it is)."""
        remove_hook_from_module(self.model)
