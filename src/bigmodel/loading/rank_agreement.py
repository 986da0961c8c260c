"""Step 1 of distributed loading: every rank checks that all ranks built the same model (keys, shapes, layouts)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], str | None]:
    """Global shape (a DTensor's ``.shape`` is global) and, for DTensors, mesh shape and placements."""
    if not isinstance(tensor, DTensor):
        return tuple(tensor.shape), None
    return tuple(tensor.shape), f"{tuple(tensor.device_mesh.shape)} {tuple(tensor.placements)}"


def model_keys(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """State-dict names (tied names included) → (global shape, DTensor layout or None)."""
    keys = {name: layout(p) for name, p in model.named_parameters(remove_duplicate=False)}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                keys[f"{prefix}.{name}" if prefix else name] = layout(buf)
    return keys


def agree(keys: Mapping[str, tuple], local_error: str | None) -> None:
    """Raise on every rank if any rank has a local error or other keys, shapes or DTensor layouts."""
    signature = sorted(keys.items())
    digest = hashlib.sha256(repr(signature).encode()).hexdigest()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (digest, local_error))
    errors = [f"rank {rank}: {err}" for rank, (_, err) in enumerate(gathered) if err]
    if errors:
        raise ValueError("; ".join(errors))
    if len({d for d, _ in gathered}) == 1:
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, signature)
    raise ValueError(_describe_disagreement([dict(s) for s in everyone]))


def _describe_disagreement(per_rank: list[dict[str, tuple]], limit: int = 10) -> str:
    reference = per_rank[0]
    parts = []
    for rank, keys in enumerate(per_rank[1:], start=1):
        extra = sorted(set(keys) - set(reference))
        missing = sorted(set(reference) - set(keys))
        shapes = sorted(k for k in set(keys) & set(reference) if keys[k] != reference[k])
        if extra:
            parts.append(f"rank {rank} has keys rank 0 lacks: {extra[:limit]}")
        if missing:
            parts.append(f"rank {rank} lacks keys of rank 0: {missing[:limit]}")
        if shapes:
            parts.append(
                f"rank {rank} has other shapes or layouts for {[(k, keys[k], reference[k]) for k in shapes[:limit]]} "
                "((shape, layout) on that rank, then on rank 0)"
            )
    return (
        "The ranks' models disagree: " + "; ".join(parts) + ". Build the same model (same config) on every rank "
        "before loading with broadcast_from_rank0=True."
    )
