"""Shared helpers for the cases on the 2 GB Llama checkpoint."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import fixtures


def empty_llama(lib: Any) -> nn.Module:
    """The 2 GB Llama built under the library's own ``init_empty_weights`` (buffers stay real)."""
    from transformers import LlamaForCausalLM

    with lib.init_empty_weights():
        model = LlamaForCausalLM(fixtures.llama_config(fixtures.LLAMA_2GB))
    return model.eval()


def plain_llama() -> nn.Module:
    """The 2 GB Llama fully in memory, loaded by transformers (used by the floors only)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(fixtures.CACHE / "llama-st"), dtype=torch.float32).eval()


def resident_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter/buffer that is not on meta (offloaded ones are on meta between forwards)."""
    return [t for t in model.state_dict().values() if t.device.type != "meta"]


def input_ids(vocab: int, length: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def _safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def safetensors_names(path: str | Path) -> list[str]:
    return [name for name in _safetensors_header(path)[0] if name != "__metadata__"]


def safetensors_ranges(path: str | Path, names: set[str] | None = None) -> list[tuple[int, int]]:
    """Absolute byte ranges of the tensors ``names`` (all when None) in a safetensors file."""
    header, base = _safetensors_header(path)
    return [(base + info["data_offsets"][0], base + info["data_offsets"][1])
            for name, info in header.items()
            if name != "__metadata__" and (names is None or name in names)]


def names_on(device_map: dict[str, str], device: str, names: list[str]) -> set[str]:
    """The tensor names whose longest matching device-map prefix maps to ``device``."""
    out = set()
    for name in names:
        best = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        if device_map[best] == device:
            out.add(name)
    return out
