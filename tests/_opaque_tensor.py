"""A tensor subclass that intercepts every op but cannot be taken apart (no ``__tensor_flatten__``)."""

from __future__ import annotations

import torch


class Opaque(torch.Tensor):
    """A wrapper subclass over ``data_``: its own storage holds nothing, every op is run on ``data_``."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)
        out.data_ = data
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.data_ if isinstance(t, Opaque) else t  # noqa: E731
        if func is torch.ops.aten.detach.default:
            return Opaque(unwrap(args[0]).detach())
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
