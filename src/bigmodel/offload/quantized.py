"""Quantized offload storage: int8 (per channel), int4 (group-wise) or float8 weights, dequantized where they run.

Offloaded inference reads every offloaded weight once per token, so storing them in fewer
bytes is the only way past the bandwidth of disk, RAM or PCIe.  With ``offload_quantization``
set, the 2-D weights of the ``nn.Linear`` modules that are offloaded are stored as:

- ``"int8"``: symmetric int8 per output channel (one float32 scale per row);
- ``"int4"``: asymmetric 4-bit per group of 64 (or 32/128) input columns, two per byte, with a
  float16 scale and a uint8 zero point per group (about 4.4 bits per weight);
- ``"float8"``: ``float8_e4m3fn`` with one float32 scale per row.

Norms, embeddings, biases and weights tied to another tensor stay in full precision.  The
quantization math is torchao's affine primitives (``choose_qparams_affine``,
``quantize_affine``, ``dequantize_affine``); float8 is a scale and a cast in plain torch.

A :class:`QuantizedWeight` is moved to the execution device as it is stored (the packed bytes
and scales), then :meth:`QuantizedWeight.dequantize` runs there, in the hook's pre-forward.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..core.subclasses import is_tensor_subclass

logger = logging.getLogger(__name__)

FORMS = ("int8", "int4", "float8")
INT4_GROUP_SIZES = (64, 32, 128)
_FLOAT8 = getattr(torch, "float8_e4m3fn", None)


def check_form(form: str | None) -> str | None:
    """Validate an ``offload_quantization`` value.

    Raises:
        ValueError: not None nor one of :data:`FORMS` (lists them).
    """
    if form is None or form in FORMS:
        return form
    raise ValueError(
        f"offload_quantization={form!r} is not a storage form; use one of {', '.join(FORMS)} or None."
    )


def _torchao() -> Any:
    """torchao's quantization primitives (imported on first use; its import logs about CUDA kernels on CPU builds)."""
    try:
        previous = logging.getLogger("torchao").level
        logging.getLogger("torchao").setLevel(logging.ERROR)
        try:
            from torchao.quantization import quant_primitives
        finally:
            logging.getLogger("torchao").setLevel(previous)
    except ImportError as error:
        raise ImportError(
            "offload_quantization='int8'/'int4' needs torchao; run `pip install bigmodel[quant]` (or `pip install torchao`)."
        ) from error
    return quant_primitives


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight stored quantized: the packed values and their scales (and zero points), on one device.

    Attributes:
        form: ``"int8"``, ``"int4"`` or ``"float8"``.
        data: int8 ``(rows, cols)``, uint8 ``(rows, cols // 2)`` (int4, two per byte) or float8 ``(rows, cols)``.
        scale: float32 ``(rows, 1)``, or float16 ``(rows, cols // group_size)`` for int4.
        zero: uint8 ``(rows, cols // group_size)`` for int4, else None.
        shape: the weight's shape ``(rows, cols)``.
        dtype: the dtype it dequantizes to.
        group_size: columns per scale (``cols`` for the per-channel forms).
    """

    form: str
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    group_size: int

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes stored (data + scales + zero points)."""
        return sum(t.numel() * t.element_size() for t in self.parts().values())

    def parts(self) -> dict[str, torch.Tensor]:
        """The stored tensors by part name (``data``, ``scale``, ``zero``)."""
        parts = {"data": self.data, "scale": self.scale}
        if self.zero is not None:
            parts["zero"] = self.zero
        return parts

    def to(self, device: Any, non_blocking: bool = False) -> QuantizedWeight:
        """The same stored form on ``device`` (the packed bytes move, nothing is dequantized)."""
        moved = {
            k: v.to(device, non_blocking=non_blocking) for k, v in self.parts().items()
        }
        return replace(
            self, data=moved["data"], scale=moved["scale"], zero=moved.get("zero")
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight on this object's device, in ``dtype`` (its own dtype when None)."""
        dtype = dtype or self.dtype
        if self.form in (
            "float8",
            "int8",
        ):  # symmetric: what dequantize_affine computes with a zero point of 0
            return (self.data.to(torch.float32) * self.scale).to(dtype)
        rows, cols = self.shape
        low, high = self.data & 0x0F, self.data >> 4
        values = torch.stack((low, high), dim=-1).reshape(rows, cols)
        return _torchao().dequantize_affine(
            values, (1, self.group_size), self.scale.to(torch.float32), self.zero.to(torch.int32), torch.uint8,
            quant_min=0, quant_max=15, output_dtype=torch.float32,
        ).to(dtype)  # fmt: skip


def int4_group_size(cols: int) -> int | None:
    """The group size used for a weight with ``cols`` input columns (None: int4 does not apply)."""
    return next((g for g in INT4_GROUP_SIZES if cols % g == 0), None)


def quantize(weight: torch.Tensor, form: str) -> QuantizedWeight:
    """Quantize a 2-D floating weight (on its device; the result stays there).

    Raises:
        ValueError: unknown form, a weight that is not 2-D floating, or (int4) whose columns
            are not a multiple of 32.
    """
    check_form(form)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"Only 2-D floating weights are quantized, not {weight.dtype} {list(weight.shape)}."
        )
    rows, cols = weight.shape
    source = weight.detach().to(torch.float32)
    if form == "float8":
        if _FLOAT8 is None:
            raise ValueError(
                "This torch has no float8_e4m3fn; use offload_quantization='int8'."
            )
        scale = (
            source.abs().amax(dim=1, keepdim=True) / torch.finfo(_FLOAT8).max
        ).clamp(min=1e-12)
        return QuantizedWeight(
            form,
            (source / scale).to(_FLOAT8),
            scale,
            None,
            (rows, cols),
            weight.dtype,
            cols,
        )
    ao = _torchao()
    if form == "int8":
        block = (1, cols)
        scale, zero = ao.choose_qparams_affine(
            source, ao.MappingType.SYMMETRIC, block, torch.int8, eps=1e-12
        )
        data = ao.quantize_affine(source, block, scale, zero, torch.int8)
        return QuantizedWeight(
            form, data, scale.reshape(rows, 1), None, (rows, cols), weight.dtype, cols
        )
    group = int4_group_size(cols)
    if group is None:
        raise ValueError(
            f"int4 needs the weight's columns ({cols}) to be a multiple of 32."
        )
    block = (1, group)
    scale, zero = ao.choose_qparams_affine(
        source, ao.MappingType.ASYMMETRIC, block, torch.uint8, quant_min=0, quant_max=15, eps=1e-12,
        scale_dtype=torch.float16, zero_point_dtype=torch.uint8,
    )  # fmt: skip
    values = ao.quantize_affine(
        source, block, scale.to(torch.float32), zero.to(torch.int32), torch.uint8, 0, 15
    )
    packed = values.reshape(rows, cols // 2, 2)
    data = (packed[..., 0] | (packed[..., 1] << 4)).contiguous()
    groups = cols // group
    return QuantizedWeight(
        form,
        data,
        scale.reshape(rows, groups),
        zero.reshape(rows, groups),
        (rows, cols),
        weight.dtype,
        group,
    )


def quantizable_names(model: nn.Module, form: str) -> set[str]:
    """Names of the weights ``form`` applies to: 2-D floating weights of ``nn.Linear`` modules, not tied.

    Weights that already are wrapper tensor subclasses (torchao's quantized tensors) are left out.

    Norms, embeddings, biases and weights tied to another tensor (``lm_head`` ↔ embeddings)
    stay in full precision.
    """
    tied = _tied_names(model)
    names = set()
    for prefix, module in model.named_modules():
        weight = (
            module._parameters.get("weight") if isinstance(module, nn.Linear) else None
        )
        if weight is None or weight.dim() != 2 or not weight.is_floating_point() or is_tensor_subclass(weight):
            continue  # a weight already in a quantized subclass (torchao) is moved as it is
        name = f"{prefix}.weight" if prefix else "weight"
        if name in tied or (
            form == "int4" and int4_group_size(weight.shape[1]) is None
        ):
            continue
        names.add(name)
    return names


def _tied_names(model: nn.Module) -> set[str]:
    seen: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(param), []).append(name)
    return {n for names in seen.values() if len(names) > 1 for n in names}


def source_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's bytes, dtype and shape: what a quantized entry was made from."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tensor.dtype}|{list(tensor.shape)}|".encode())
    if flat.numel():
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()
