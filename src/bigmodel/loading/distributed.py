"""Loading one checkpoint into every process of a ``torch.distributed`` job: rank 0 reads, all ranks receive.

Every rank runs the same steps in the same order, so no rank ever waits on a collective
that another rank skipped (an error on one rank becomes the same error on every rank):

1. *agree*: ``all_gather_object`` of a hash of the model's keys, global shapes and DTensor
   layouts, plus any local argument error; ranks that disagree raise, naming the keys.
2. *manifest*: only rank 0 resolves and opens the checkpoint files; it broadcasts the list
   of ``(name, shape, dtype, bytes)`` (or the error it met) with ``broadcast_object_list``.
3. *stream*: for each tensor the model wants, a one-element status broadcast (rank 0's
   read may fail), then the tensor's raw bytes (``uint8``, so every dtype, fp8 included,
   arrives bit-exact): broadcast whole, or with ``full_state_dict=False`` sent as one
   shard per rank (``send``/``recv``).  One tensor in flight on every rank.
4. *place*: plain tensors go through :func:`set_module_tensor_to_device`; DTensor
   parameters (tensor parallel, FSDP2) keep only their local shard.

Transport: gloo sends CPU buffers; nccl-like backends send buffers on the current accelerator.
"""

from __future__ import annotations

import builtins
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..checkpoints.resolve import CheckpointNotFoundError
from ..core.devices import accelerator_type
from ..core.file_maps import is_mapped
from ..core.sizes import to_dtype
from ..core.tensors import (
    device_of,
    find_tied_parameters,
    get_submodule_and_name,
    loaded_dtype,
    retie_parameters,
    set_module_tensor_to_device,
)
from .rank_agreement import agree, model_keys
from .rank_zero_reader import RankZeroReader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Entry:
    """One checkpoint tensor as announced by rank 0 (global shape; size in bytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def load_checkpoint_broadcast(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    *,
    device_map: Mapping[str, object] | None = None,
    dtype: torch.dtype | str | None = None,
    keep_in_fp32_modules: Sequence[str] | None = None,
    strict: bool = False,
    full_state_dict: bool = True,
) -> None:
    """Load ``checkpoint`` into ``model`` on every rank, reading the files on rank 0 only.

    Every rank of the default process group must call this with a model of the same keys
    and shapes.  Rank 0 reads each tensor once and broadcasts it; each rank then places it:
    plain parameters and buffers receive the full value (on ``device_map``'s device, else
    their current device, else the broadcast device), DTensor parameters keep only their
    local shard in their own ``device_mesh`` and ``placements`` (the parameter stays a DTensor).

    ``full_state_dict`` says in which form values travel; the model always ends up in its
    own layout (a sharded DTensor parameter stays a sharded DTensor, nothing is gathered):

    - ``True`` (default): each tensor is broadcast whole and every rank cuts its shard out
      locally; peak memory per rank is its shard plus one full tensor.
    - ``False``: for DTensor parameters whose placements are ``Shard``/``Replicate``, rank 0
      slices the tensor and sends each rank only its own shard (point to point), so ranks
      other than 0 never hold a full tensor.  Plain tensors are broadcast whole either way.

    Args:
        model: the model, identical in keys and shapes on every rank (may be on ``meta``).
        checkpoint: on rank 0, a weights file, a ``*.index.json`` or a folder; ignored on
            other ranks (they never touch the file system for it).
        device_map: module/parameter name → device for plain tensors (``"disk"`` not supported).
        dtype: dtype for floating tensors (integer and bool tensors keep theirs).
        keep_in_fp32_modules: module names (a dotted-name component) whose floating tensors stay float32.
        strict: raise if the checkpoint misses model keys or has keys the model lacks.
        full_state_dict: ``False`` sends each rank only its shard of DTensor parameters (see above).

    Raises:
        RuntimeError: no initialised process group.
        ValueError: ranks disagree on the model's keys or shapes (names them); a shape
            differs from the checkpoint's; ``strict`` and missing/unexpected keys; ``"disk"``
            in the device map.  Raised on every rank at once.
        FileNotFoundError: the checkpoint is missing on rank 0 (raised on every rank).
        OSError / ValueError: any error rank 0 meets while reading, also mid-transfer, is
            raised on every rank (same type for builtin exceptions, else RuntimeError).
    """
    _require_process_group()
    dtype = to_dtype(dtype) if isinstance(dtype, str) else dtype
    keys = model_keys(model)
    agree(keys, _check_arguments(device_map, dtype))
    options = _Options(device_map or None, dtype, tuple(keep_in_fp32_modules or ()), full_state_dict)
    reader, entries = _announce(checkpoint)
    try:
        plan = _plan(model, keys, entries, strict)
        comm = _broadcast_device()
        tied = find_tied_parameters(model)
        with torch.no_grad():
            for entry in plan:
                _load_one(model, entry, reader, comm, options)
        retie_parameters(model, tied)
        logger.info("Loaded %d tensors broadcast from rank 0 (%d bytes).", len(plan), sum(e.nbytes for e in plan))
    finally:
        if reader is not None:
            reader.close()


@dataclass(frozen=True)
class _Options:
    device_map: Mapping[str, object] | None
    dtype: torch.dtype | None
    keep_in_fp32: tuple[str, ...]
    full_state_dict: bool


def _load_one(
    model: nn.Module, entry: _Entry, reader: RankZeroReader | None, comm: torch.device, options: _Options
) -> None:
    """Transfer one tensor from rank 0 and put it (or this rank's shard of it) into ``model``."""
    submodule, attr = get_submodule_and_name(model, entry.name)
    old = submodule._parameters[attr] if attr in submodule._parameters else submodule._buffers[attr]
    if not options.full_state_dict and _scatterable(old):
        local = _receive_shard(entry, reader, comm, old)
        target = _target_dtype(entry.name, local, old, options)
        _install_shard(submodule, attr, old, local.to(target))
        return
    value = _receive(entry, reader, comm)
    target = _target_dtype(entry.name, value, old, options)
    if isinstance(old, DTensor):
        _place_dtensor(submodule, attr, old, value.to(target))
        return
    if options.device_map:
        device = device_of(entry.name, options.device_map)
    else:
        device = old.device if old is not None and old.device.type != "meta" else comm
    set_module_tensor_to_device(model, entry.name, device, value=value, dtype=target, clear_cache=False)


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "broadcast_from_rank0=True needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun), or pass broadcast_from_rank0=False."
        )


def _check_arguments(device_map: Mapping[str, object] | None, dtype: object) -> str | None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        return f"dtype={dtype!r} has no torch dtype; pass a floating torch dtype such as torch.bfloat16."
    if device_map is None:
        return None
    if not isinstance(device_map, Mapping):
        return (
            f"device_map={device_map!r} must be a dict when broadcasting from rank 0; "
            "compute it first with infer_auto_device_map."
        )
    disk = sorted(name for name, dev in device_map.items() if dev == "disk")
    if disk:
        return f"device_map puts {disk} on 'disk', which broadcast_from_rank0 does not support; map them to 'cpu'."
    return None


def _announce(checkpoint: str | os.PathLike) -> tuple[RankZeroReader | None, list[_Entry]]:
    """Rank 0 opens the checkpoint and broadcasts its manifest (or its error) to every rank."""
    reader, payload, error = None, None, None
    if dist.get_rank() == 0:
        try:
            reader = RankZeroReader(checkpoint)
            payload = ("ok", [_Entry(n, s, d, b) for n, s, d, b in reader.manifest()])
        except Exception as err:  # forwarded to every rank, re-raised below
            error = err
            payload = ("error", (type(err).__name__, f"{err}"))
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    status, body = box[0]
    if status == "ok":
        return reader, body
    if error is not None:
        raise error
    raise _rebuild_error(*body)


def _rebuild_error(type_name: str, message: str) -> Exception:
    cls = CheckpointNotFoundError if type_name == CheckpointNotFoundError.__name__ else getattr(builtins, type_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    return cls(f"rank 0 failed to read the checkpoint: {message}")


def _plan(model: nn.Module, keys: Mapping[str, tuple], entries: list[_Entry], strict: bool) -> list[_Entry]:
    """The entries to transfer, in file order; one per tied group.  Same verdict on every rank."""
    partners = {name: group for group in find_tied_parameters(model) for name in group}
    wanted, covered = [], set()
    for entry in entries:
        if entry.name not in keys or entry.name in covered:
            continue
        wanted.append(entry)
        covered.update(partners.get(entry.name, [entry.name]))
    unexpected = sorted(e.name for e in entries if e.name not in keys)
    missing = sorted(set(keys) - covered)
    bad = [(e.name, e.shape, keys[e.name][0]) for e in wanted if tuple(e.shape) != keys[e.name][0]]
    if bad:
        raise ValueError(
            f"Checkpoint shapes differ from the model's for {bad[:10]} (checkpoint shape, model shape); "
            "build the model from the checkpoint's config."
        )
    if strict and (missing or unexpected):
        raise ValueError(
            f"Checkpoint does not match the model (strict=True): missing keys {missing[:20]}, unexpected keys "
            f"{unexpected[:20]}. Fix the checkpoint or the model, or pass strict=False."
        )
    if missing:
        logger.warning("Keys not in the checkpoint, left as they are: %s", missing[:20])
    return wanted


def _broadcast_device() -> torch.device:
    """Where broadcast buffers live: CPU for gloo/mpi, the current accelerator otherwise (nccl ...)."""
    backend = str(dist.get_backend())
    kind = accelerator_type()
    if kind is None or "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def _read_or_fail(entry: _Entry, reader: RankZeroReader | None, comm: torch.device) -> torch.Tensor | None:
    """Rank 0 reads ``entry``; a one-element status broadcast tells every rank whether it could.

    Raises:
        the error rank 0 met (rebuilt by name on the other ranks), on every rank.
    """
    status = torch.zeros(1, dtype=torch.int64, device=comm)
    data, error = None, None
    if reader is not None:
        try:
            data = reader.read_bytes(entry.name)
        except Exception as err:  # forwarded to every rank
            error = err
            status.fill_(1)
    dist.broadcast(status, src=0)
    if int(status.item()):
        box = [(type(error).__name__, f"{error}") if error is not None else None]
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        raise _rebuild_error(*box[0])
    return data


def _receive(entry: _Entry, reader: RankZeroReader | None, comm: torch.device) -> torch.Tensor:
    """Broadcast one full tensor from rank 0; every rank returns it (checkpoint shape and dtype)."""
    data = _read_or_fail(entry, reader, comm)
    buf = data.to(comm) if data is not None else torch.empty(entry.nbytes, dtype=torch.uint8, device=comm)
    if is_mapped(buf):  # a .bin's mapped bytes on a CPU rank 0: never left mapped (see loading.loader)
        buf = buf.clone()
    if entry.nbytes:
        dist.broadcast(buf, src=0)
    return buf.view(entry.dtype).reshape(entry.shape)


def _scatterable(old: torch.Tensor | None) -> bool:
    """A DTensor over a mesh of every rank, placed by plain ``Shard``/``Replicate`` (shards are slices).

    Other layouts (sub-meshes of a 2-D mesh, FSDP2+TP strided shards) are broadcast whole.
    """
    return (
        isinstance(old, DTensor)
        and old.device_mesh.mesh.numel() == dist.get_world_size()
        and all(type(p) in (Shard, Replicate) for p in old.placements)
    )


def _receive_shard(entry: _Entry, reader: RankZeroReader | None, comm: torch.device, old) -> torch.Tensor:
    """Rank 0 sends every rank of ``old``'s mesh only its own shard (point to point); returns this rank's."""
    data = _read_or_fail(entry, reader, comm)
    mesh, placements = old.device_mesh, old.placements
    if data is None:
        local_shape = tuple(old.to_local().shape)
        buf = torch.empty(math.prod(local_shape) * entry.dtype.itemsize, dtype=torch.uint8, device=comm)
        if buf.numel():
            dist.recv(buf, src=0)
        return buf.view(entry.dtype).reshape(local_shape)
    full = data.view(entry.dtype).reshape(entry.shape)
    for rank in range(1, dist.get_world_size()):
        coordinate = _coordinate(mesh, rank)
        if coordinate is None:
            continue
        piece = _shard_of(full, mesh, placements, coordinate).contiguous()
        if piece.numel():
            dist.send(piece.reshape(-1).view(torch.uint8).to(comm), dst=rank)
        del piece
    return _shard_of(full, mesh, placements, _coordinate(mesh, 0)).clone()


def _coordinate(mesh, rank: int) -> tuple[int, ...] | None:
    """``rank``'s coordinate in ``mesh`` (None if the mesh does not hold it)."""
    found = (mesh.mesh == rank).nonzero()
    return tuple(int(i) for i in found[0]) if len(found) else None


def _shard_of(full: torch.Tensor, mesh, placements, coordinate: tuple[int, ...]) -> torch.Tensor:
    """The slice of ``full`` that the mesh position ``coordinate`` holds (torch.chunk along each Shard)."""
    out = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(out, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            out = chunks[index] if index < len(chunks) else out.narrow(placement.dim, 0, 0)
    return out


def _target_dtype(name: str, value: torch.Tensor, old: torch.Tensor | None, options: _Options) -> torch.dtype:
    """The dtype a received tensor is stored in; the same rule as ``load_checkpoint_in_model``.

    Non-floating tensors keep the checkpoint's dtype; ``keep_in_fp32_modules`` (a name segment
    or dotted run of segments) → float32; else ``dtype``; else, without a device map, the
    model tensor's floating dtype; else the checkpoint's.
    """
    return loaded_dtype(
        name,
        value.dtype,
        old,
        dtype=options.dtype,
        keep_in_fp32=options.keep_in_fp32,
        use_model_dtype=True,
    )


def _place_dtensor(submodule: nn.Module, attr: str, old, full: torch.Tensor) -> None:
    """Keep this rank's shard of ``full`` in ``old``'s mesh and placements (no communication)."""
    local = distribute_tensor(full, old.device_mesh, old.placements, src_data_rank=None).to_local()
    if local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
        local = local.clone()  # do not keep the whole received tensor alive through a view
    _install_shard(submodule, attr, old, local)


def _install_shard(submodule: nn.Module, attr: str, old, local: torch.Tensor) -> None:
    """Make ``local`` this rank's shard of ``submodule.attr``: copied in place when it is materialised."""
    old_local = old.to_local()
    if old_local.device.type != "meta" and old_local.dtype == local.dtype and old_local.shape == local.shape:
        old_local.copy_(local)  # keep the Parameter object: optimizers and FSDP2 hold references to it
        return
    local = local.to(old.device_mesh.device_type)
    mesh, placements = old.device_mesh, old.placements
    new = DTensor.from_local(local, mesh, placements, run_check=False, shape=old.shape, stride=old.stride())
    if attr in submodule._parameters:
        submodule._parameters[attr] = nn.Parameter(new, requires_grad=old.requires_grad and new.is_floating_point())
    else:
        submodule._buffers[attr] = new
