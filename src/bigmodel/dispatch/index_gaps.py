"""Values of disk-mapped tensors that the offload index lacks but that are in memory.

``dispatch_model(..., offload_index=index)`` reads the disk part from ``index``.  Two kinds of
tensors of a disk module can be missing from it and still have a value:

- a tied weight, which a checkpoint stores once: a head mapped to disk whose weight is tied to
  embeddings kept on cpu has no entry; its hook reads the twin's value from memory;
- a tensor the checkpoint did not hold and that the caller initialised in the model: transformers'
  ``from_pretrained(device_map=...)`` of a model with a new head (``BertForSequenceClassification``
  from a ``BertModel`` checkpoint) initialises ``classifier`` in memory and passes an index of the
  checkpoint's tensors only; its hook reads the initialised value from memory, as the model without
  a device map uses it.

Tensors still on ``meta`` have no value anywhere and stay missing (the hook refuses them, naming them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.tensors import get_submodule_and_name
from ..offload.storage import extract_submodules_state_dict

__all__ = ["tensor_at", "values_the_index_lacks"]

logger = logging.getLogger(__name__)


def values_the_index_lacks(model: nn.Module, tied: list[list[str]], disk_modules: list[str],
                           index: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors of ``disk_modules`` missing from ``index`` whose values are in memory, by full name.

    Args:
        model: the model being dispatched (its hooks removed).
        tied: groups of tied parameter names (``find_tied_parameters(model)``).
        disk_modules: names of the modules mapped to ``"disk"`` (``""``: the whole model).
        index: the offload index the disk part is read from (name → entry).

    Returns:
        name → detached tensor (the model's own memory, not a copy): a tied twin's value for a tied
        name, else the model's value; names on ``meta`` in the whole group are left out.
    """
    out = _tied_in_memory(model, tied, disk_modules, index)
    state = extract_submodules_state_dict(model.state_dict(keep_vars=True), disk_modules)
    own = {name: t.detach() for name, t in state.items()
           if name not in index and name not in out and t.device.type != "meta"}  # fmt: skip
    if own:
        logger.info(
            "The offload index has no entry for %d tensor(s) mapped to disk that the model holds in memory "
            "(%s); their modules read them from memory.", len(own), sorted(own)[:10],
        )  # fmt: skip
    return {**out, **own}


def _tied_in_memory(model: nn.Module, tied: list[list[str]], disk_modules: list[str],
                    index: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tied names of disk modules that ``index`` lacks, each with a member's value in memory."""
    out: dict[str, torch.Tensor] = {}
    for group in tied:
        values = [tensor for tensor in (tensor_at(model, name) for name in group) if tensor.device.type != "meta"]
        for name in group:
            on_disk = any(not m or name == m or name.startswith(m + ".") for m in disk_modules)
            if values and on_disk and name not in index:
                out[name] = values[0].detach()
    return out


def tensor_at(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (dotted, from ``model``) as the model holds it."""
    sub, attr = get_submodule_and_name(model, name)
    return getattr(sub, attr)
