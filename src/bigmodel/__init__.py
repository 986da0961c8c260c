"""bigmodel: run PyTorch models larger than the memory of any one device.

Build a model on the meta device, plan a device map under per-device budgets, load a
checkpoint straight onto the devices of the map (CPU RAM and disk included), and run it
with hooks that bring each module's weights to the execution device for its forward.
The public names and signatures follow Hugging Face Accelerate's big-model inference API.

Names are imported lazily, so ``import bigmodel`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._exports import EXPORTS, resolve
from .core import leases as _leases

# Only the main thread may install signal handlers: install the one that protects mapped weight
# files now, so that models loaded later by any thread are protected (bigmodel.core.file_maps).
_leases.install_handler()

__version__ = "0.1.0"
__all__ = sorted(EXPORTS)


# Compatibility subpackages reachable as attributes, as `accelerate.utils` is after `import accelerate`.
_SUBMODULES = ("big_modeling", "hooks", "utils")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    value = resolve(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))
