"""``offload_quantization`` in the dispatch entry points: which weights are stored quantized, and where.

``dispatch_model``, ``cpu_offload`` and ``disk_offload`` call these with the option's value:
the offloaded ``nn.Linear`` weights (see :func:`bigmodel.offload.quantized.quantizable_names`)
are quantized once, in RAM for CPU-offloaded parts and in the offload folder for disk parts
(reusing the folder's entries made from the same bytes in the same form), and the hooks get a
:class:`~bigmodel.offload.quantized_store.QuantizedWeightsMap` that serves them in stored form.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..offload.quantized import QuantizedWeight, quantizable_names, quantize
from ..offload.quantized_store import QuantizedWeightsMap, ensure_quantized

logger = logging.getLogger(__name__)


def split_for_quantization(
    model: nn.Module, state: Mapping[str, torch.Tensor], form: str | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(kept in full precision, to quantize)``: ``state`` split by :func:`quantizable_names`."""
    if form is None:
        return dict(state), {}
    names = quantizable_names(model, form)
    return {k: v for k, v in state.items() if k not in names}, {
        k: v for k, v in state.items() if k in names
    }


def quantize_in_ram(
    model: nn.Module, state: Mapping[str, torch.Tensor], form: str | None
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """``(full-precision rest, quantized weights on CPU)`` for the CPU-offloaded values ``state``."""
    rest, chosen = split_for_quantization(model, state, form)
    in_ram = {
        name: quantize(value.detach().to("cpu"), form) for name, value in chosen.items()
    }  # type: ignore[arg-type]
    if in_ram:
        logger.info("Offloaded weights: %d stored as %s in RAM.", len(in_ram), form)
    return rest, in_ram


def store_on_disk(
    model: nn.Module,
    folder: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    form: str | None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Quantize the chosen weights of ``state`` into ``folder`` (reusing matching entries).

    Returns:
        ``(the rest, to offload in full precision; the names stored quantized)``.
    """
    rest, chosen = split_for_quantization(model, state, form)
    if chosen:
        ensure_quantized(folder, chosen, form)  # type: ignore[arg-type]
    return rest, list(chosen)


def wrap_weights_map(
    weights_map: Mapping[str, torch.Tensor] | None,
    form: str | None,
    in_ram: Mapping[str, QuantizedWeight] | None = None,
    folder: str | os.PathLike | None = None,
    folder_names: Sequence[str] = (),
) -> Mapping[str, torch.Tensor] | None:
    """``weights_map`` as the hooks should read it: unchanged without ``form``, else serving stored forms."""
    if form is None or weights_map is None:
        return weights_map
    return QuantizedWeightsMap(
        weights_map, in_ram=in_ram, folder=folder, folder_names=folder_names
    )
