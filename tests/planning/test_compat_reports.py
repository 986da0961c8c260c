"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both.

The expected budgets below are the values accelerate 1.15.0's ``get_balanced_memory`` returned
for the same models and budgets (run side by side on a CPU-only machine: budgets keyed 0, 1, 2
are plain numbers to both).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from bigmodel import get_balanced_memory, infer_auto_device_map, init_empty_weights

BIG = 10**7


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ls = nn.ModuleList([nn.Linear(2, 2) for _ in range(10)])  # ten leaves of 24 bytes


class _OneBigLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(100, 100)  # 40,400 bytes
        self.blk = _Block()


@pytest.mark.parametrize("no_split", [None, ["_Block"]])
def test_balanced_slack_is_the_mean_leaf_when_no_split_modules_are_smaller(no_split):
    # 40,640 bytes over 2 accelerators: 20,320 each, plus 1.25 x the mean of the 11 leaves (3,694):
    # accelerate gives 24,937 (a slack from the largest leaf, 40,400, gave 70,820 and a map with
    # nearly everything on accelerator 0).
    budgets = get_balanced_memory(_OneBigLeaf(), {0: BIG, 1: BIG, "cpu": BIG}, no_split_module_classes=no_split)
    assert budgets == {0: 24_937, 1: BIG, "cpu": BIG}
    three = get_balanced_memory(_OneBigLeaf(), {0: BIG, 1: BIG, 2: BIG, "cpu": BIG}, no_split, low_zero=True)
    assert three == {0: 0, 1: 24_937, 2: BIG, "cpu": BIG}


def _llama(vocab: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    with init_empty_weights():
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("vocab", "no_split", "first"),
    [
        (2000, None, 350_965),  # mean leaf 16,516 (the 256,000-byte embedding is one of 40 leaves)
        (2000, ["LlamaDecoderLayer"], 376_720),  # largest decoder layer 37,120, not the embedding
        (2000, ["LlamaMLP"], 361_040),
        (64, None, 87_668),
        (64, ["LlamaDecoderLayer"], 128_912),
    ],
)
def test_balanced_budgets_of_a_llama_match_accelerate(vocab, no_split, first):
    model = _llama(vocab)
    assert get_balanced_memory(model, {0: BIG, 1: BIG, "cpu": BIG}, no_split)[0] == first


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)


class _DenseThenWide(nn.Module):
    """Two narrow layers, then two wide ones of the same class (a model whose first blocks are dense
    and later ones mixture-of-experts, e.g. DeepSeek-V3's ``first_k_dense_replace``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(4), _Layer(4), _Layer(40), _Layer(40)])  # 80, 80, 6,560, 6,560 bytes


def test_balanced_slack_sizes_a_no_split_class_by_its_first_module():
    # 13,280 bytes over 2 accelerators: 6,640 each, plus 1.25 x max(first _Layer: 80, mean leaf: 3,320):
    # accelerate gives 10,790 (a slack from the largest _Layer, 6,560, gave 14,840).
    budgets = get_balanced_memory(_DenseThenWide(), {0: BIG, 1: BIG, "cpu": BIG}, ["_Layer"])
    assert budgets == {0: 10_790, 1: BIG, "cpu": BIG}
    three = get_balanced_memory(_DenseThenWide(), {0: BIG, 1: BIG, 2: BIG}, ["_Layer"], low_zero=True)
    assert three == {0: 0, 1: 10_790, 2: BIG}


def _pr_2412_model() -> nn.Module:
    # The model of accelerate's PR #2412 test: three modules, each with an extra buffer of 10 rows.
    model = nn.Sequential(
        OrderedDict([("linear1", nn.Linear(3, 4)), ("batchnorm", nn.BatchNorm1d(4)), ("linear2", nn.Linear(4, 5))])
    )
    model.linear1.register_buffer("test_buffer1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("test_buffer2", torch.zeros(10, 3))
    model.linear2.register_buffer("test_buffer3", torch.zeros(10, 3))
    return model


def test_buffers_of_offloaded_modules_keep_room_on_the_execution_device():
    # accelerate 1.15 gives {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"} either way, warning that
    # the 280 bytes of offloaded buffers may not fit: with linear1's 144 bytes, device 0 would need 424 of
    # its 400. bigmodel keeps room for them (README: "Device maps with accelerator budgets").
    budgets = {0: 400, "cpu": 10**9}
    assert infer_auto_device_map(_pr_2412_model(), dict(budgets)) == {"": "cpu"}
    offloaded = infer_auto_device_map(_pr_2412_model(), dict(budgets), offload_buffers=True)
    assert offloaded == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}


def _tiny_t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
    with init_empty_weights():
        return transformers.T5ForConditionalGeneration(config)


def test_fallback_allocation_also_works_when_the_module_that_did_not_fit_has_ties():
    """README (session 10): T5's ``shared`` (tied to both embed_tokens and lm_head) does not fit the CPU; the
    fallback still finds ``encoder.final_layer_norm`` for it. accelerate 1.15 skips the fallback there."""
    model = _tiny_t5()
    budget = {"cpu": 53_760}  # 30% of the model; the largest layer (a decoder block) leaves 3,712 bytes
    plain = infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=["T5Block"])
    assert set(plain.values()) == {"disk"}
    fallback = infer_auto_device_map(
        model, max_memory=dict(budget), no_split_module_classes=["T5Block"], fallback_allocation=True
    )
    assert [name for name, device in fallback.items() if device == "cpu"] == ["encoder.final_layer_norm"]
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    theirs = accelerate_modeling.infer_auto_device_map(
        model, max_memory=dict(budget), no_split_module_classes=["T5Block"], fallback_allocation=True
    )
    assert dict(theirs) == {"": "disk"}
