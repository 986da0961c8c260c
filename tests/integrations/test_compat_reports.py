"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _tiny_hf import write_tiny_llama

from bigmodel.integrations.hf import load_pretrained


def test_load_pretrained_keeps_computed_buffers_when_accelerates_include_buffers_variable_is_set(
    tmp_path, monkeypatch
):
    # ACCELERATE_INIT_INCLUDE_BUFFERS=1 (honoured by init_empty_weights() as with accelerate) must not
    # reach the model load_pretrained builds: the rotary inv_freq is computed, not in the checkpoint.
    folder = write_tiny_llama(tmp_path / "tiny", tokenizer=False)
    ids = torch.tensor([[3, 4, 5, 6]])
    want = load_pretrained(folder, device_map={"": "cpu"})(ids).logits
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "1")
    model = load_pretrained(folder, device_map={"": "cpu"})
    assert not any(buffer.is_meta for buffer in model.buffers())
    torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
