"""Torch pickles never stay mapped under a loaded model: which are read into memory, which tensors are copied.

``torch.save(model.state_dict(), "pytorch_model.bin")`` over the checkpoint a model was loaded
from truncates the file first, then reads the tensors it saves, holding the GIL all along: a
tensor still viewing the mapped file would kill the process (SIGBUS) and leave the file empty,
and no lease can help (its signal handler cannot run).  So tensors of ``.bin``/``.pt``/``.pth``
files that stay on CPU are copies, as with the incumbent:

- a pickle file whose every tensor stays on CPU in its stored dtype is read into memory whole
  (``torch.load(mmap=False)``: one read per tensor, no mapping at all);
- in the other files (some tensors go to an accelerator, to disk, or are cast), the file is
  mapped while it is streamed and the tensors kept on CPU are cloned (:func:`unmapped`).

Safetensors stay zero-copy: their mappings are protected (:mod:`bigmodel.core.file_maps`), as
are those of the spill files :func:`bring_back` maps back into the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ..checkpoints.files import TensorInfo
from ..checkpoints.torch_pickle import load_torch_file
from ..core.file_maps import is_mapped
from ..core.tensors import set_module_tensor_to_device
from ..offload.storage import OffloadWriter, dat_path, load_offloaded_weight


class _Target(Protocol):
    device: torch.device | str
    dtype: torch.dtype


def _kept_as_stored(info: TensorInfo, target: _Target) -> bool:
    if isinstance(target.device, str) or target.device.type != "cpu":
        return False
    return target.dtype == info.dtype  # an integer tensor for a floating model tensor is cast (a copy)


def read_whole_pickles(
    infos: Mapping[str, TensorInfo],
    targets: Mapping[str, _Target],
    loaded: dict[Path, dict[str, torch.Tensor]],
    capped: bool = False,
) -> None:
    """Replace, in ``loaded``, each mapped pickle whose tensors all stay on CPU as stored by an in-memory load.

    Args:
        infos: model tensor name → the checkpoint tensor filling it.
        targets: model tensor name → its device and dtype.
        loaded: pickle file → its tensors (memory-mapped by the planning step); changed in place.
        capped: RAM is capped (``offload_state_dict``): keep streaming from the mappings.
    """
    if capped:
        return
    elsewhere = {
        info.file for name, info in infos.items() if name in targets and not _kept_as_stored(info, targets[name])
    }
    for path in [p for p in loaded if p not in elsewhere]:
        loaded[path] = {}  # drop the mapped tensors before reading the file
        loaded[path] = load_torch_file(path, mmap=False)


def unmapped(tensor: torch.Tensor, info: TensorInfo, targets: Sequence[_Target | None]) -> torch.Tensor:
    """``tensor``, cloned if it is a mapped pickle tensor that one of ``targets`` would keep as a view on CPU.

    Args:
        tensor: a tensor read from the checkpoint.
        info: the checkpoint tensor it comes from.
        targets: where it goes (a model tensor and the tied names it also fills; None: not loaded).
    """
    if info.is_safetensors or not is_mapped(tensor):
        return tensor
    if any(t is not None and _kept_as_stored(info, t) for t in targets):  # a move or a cast would copy
        return tensor.clone()
    return tensor


def bring_back(model: nn.Module, spill: OffloadWriter) -> None:
    """Map the spilled CPU tensors back into the model (protected zero-copy views of the spill files)."""
    for name, info in spill.index.items():
        value = load_offloaded_weight(dat_path(spill.folder, name), info)
        set_module_tensor_to_device(model, name, "cpu", value=value, dtype=value.dtype, clear_cache=False)
