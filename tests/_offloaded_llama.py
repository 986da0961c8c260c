"""A tiny tied Llama (tests/_tiny_hf.py) with two decoder layers on disk, as the kept-value and block-plan
tests dispatch it: the device map, the input ids, the module-scoped ``folder`` and ``reference``
fixtures (import them into a test module to use them) and :func:`dispatched`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny_hf import TWO_LAYERS_ON_DISK, write_tiny_llama
from torch import nn

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch

transformers = pytest.importorskip("transformers")

MAP = TWO_LAYERS_ON_DISK
IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", tokenizer=False, tie=True)


@pytest.fixture(scope="module")
def reference(folder: Path) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def dispatched(folder: Path, tmp_path: Path) -> nn.Module:
    """The tiny Llama at ``folder`` dispatched with :data:`MAP`, its disk part read from the checkpoint."""
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    model.eval()
    return load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(tmp_path / "off"))
