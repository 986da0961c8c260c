"""A torch pickle holding its state dict under a key ('state_dict') is named once, with the fix."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch


def test_a_nested_state_dict_is_named_once_and_refused(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    torch.save({"state_dict": nn.Linear(4, 3).state_dict(), "epoch": 3}, tmp_path / "pytorch_model.bin")
    with init_empty_weights():
        model = nn.Linear(4, 3)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match=r"still on the meta device.*weight, bias"):
        load_checkpoint_and_dispatch(model, tmp_path, device_map={"": "cpu"})
    nested = [r.getMessage() for r in caplog.records if "nested state dict" in r.getMessage()]
    assert len(nested) == 1, caplog.text
    assert "under 'state_dict' (2 tensors, e.g. 'weight')" in nested[0]
    assert "torch.save(ckpt['state_dict'], path)" in nested[0]
    assert sum("'epoch'" in r.getMessage() for r in caplog.records) == 1
