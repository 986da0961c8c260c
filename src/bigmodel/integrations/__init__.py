"""Integrations with the Hugging Face libraries: one-call loading of their model folders
(:mod:`~bigmodel.integrations.hf`) and running transformers, diffusers and peft on bigmodel
(:func:`use_bigmodel`, in :mod:`~bigmodel.integrations.ecosystem`)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BigmodelPatch", "is_active", "use_bigmodel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("bigmodel.integrations.ecosystem"), name)
    raise AttributeError(f"module 'bigmodel.integrations' has no attribute {name!r}")
