"""Layerwise casting composed with offloading: offloaded layers are stored and rounded exactly
like resident ones, in either order of attaching, and a tied head works.

The reference is always the plain model with layerwise casting attached: fp32 weights
rounded once through the storage dtype (fp8), then computed in fp32.  Offloading must not
change a bit of the output, nor the dtypes a user reads.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bigmodel import (
    attach_layerwise_casting_hooks,
    cpu_offload,
    disk_offload,
    dispatch_model,
    get_state_dict_offloaded_model,
    remove_hook_from_submodules,
)

STORAGE, COMPUTE = torch.float8_e4m3fn, torch.float32


class Recording(nn.Linear):
    """A Linear (so a supported layer) that records the dtype of its weight during its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = (self.weight.dtype, self.bias.dtype)
        return super().forward(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Recording(8, 16)
        self.b = Recording(16, 16)
        self.norm = nn.LayerNorm(16)
        self.c = Recording(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.norm(torch.relu(self.b(torch.relu(self.a(x))))))


def make() -> Net:
    torch.manual_seed(0)
    return Net().eval()


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
LINEAR_TENSORS = [f"{m}.{t}" for m in "abc" for t in ("weight", "bias")]


def reference() -> Net:
    model = make()
    attach_layerwise_casting_hooks(model, STORAGE, COMPUTE)
    return model


def run(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(X)


OFFLOADS = {
    "b_on_disk": lambda m, tmp: dispatch_model(m, {"a": "cpu", "b": "disk", "norm": "cpu", "c": "cpu"},
                                               offload_dir=tmp),
    "all_on_disk": lambda m, tmp: dispatch_model(m, {"a": "disk", "b": "disk", "norm": "disk", "c": "disk"},
                                                 offload_dir=tmp),
    "cpu_offload": lambda m, tmp: cpu_offload(m),
    "disk_offload": lambda m, tmp: disk_offload(m, tmp),
}


def offloaded(offload: str, order: str, tmp_path) -> nn.Module:
    model = make()
    if order == "cast_first":
        attach_layerwise_casting_hooks(model, STORAGE, COMPUTE)
    OFFLOADS[offload](model, tmp_path / "offload")
    if order == "offload_first":
        attach_layerwise_casting_hooks(model, STORAGE, COMPUTE)
    return model


@pytest.mark.parametrize("order", ["offload_first", "cast_first"])
@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_output_is_the_resident_one_bit_for_bit(offload, order, tmp_path):
    expected = run(reference())
    model = offloaded(offload, order, tmp_path)
    assert torch.equal(run(model), expected)
    assert torch.equal(run(model), expected)  # and again: nothing drifts between forwards
    assert model.b.seen == (COMPUTE, COMPUTE)  # the forward itself runs in the compute dtype


@pytest.mark.parametrize("order", ["offload_first", "cast_first"])
@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_weights_are_stored_in_the_storage_dtype_right_after_attaching(offload, order, tmp_path):
    plain = reference().state_dict()
    model = offloaded(offload, order, tmp_path)
    for state in (model.state_dict(), dict(model.named_parameters())):  # before any forward
        assert {k: state[k].dtype for k in LINEAR_TENSORS} == dict.fromkeys(LINEAR_TENSORS, STORAGE)
        assert state["norm.weight"].dtype == torch.float32  # LayerNorm is not a supported layer
    values = get_state_dict_offloaded_model(model)
    for name, value in plain.items():
        assert value.dtype == values[name].dtype and torch.equal(values[name], value), name
    run(model)
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in plain.items()}


@pytest.mark.parametrize("order", ["offload_first", "cast_first"])
@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_removing_the_hooks_gives_the_rounded_weights_in_the_compute_dtype(offload, order, tmp_path):
    plain = reference()
    run(plain)
    remove_hook_from_submodules(plain)
    model = offloaded(offload, order, tmp_path)
    run(model)
    remove_hook_from_submodules(model)
    expected = plain.state_dict()
    state = model.state_dict()
    assert list(state) == list(expected)
    for name, value in expected.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
    assert torch.equal(run(model), run(plain))


# --- a head tied to the input embedding ----------------------------------------------------


def tiny_tied_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))


def rounded_except_tied(model: nn.Module) -> nn.Module:
    """The values casting stores: every Linear rounded through the storage dtype, except the tied
    head (its weight is the embedding's, which is not a supported layer: it is kept as is)."""
    expected = copy.deepcopy(model)
    tied = expected.lm_head.weight
    for module in expected.modules():
        if isinstance(module, nn.Linear):
            for param in module.parameters(recurse=False):
                if param is not tied:
                    param.data = param.data.to(STORAGE).to(COMPUTE)
    return expected


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.slow
@pytest.mark.parametrize("offload", [None, "split_tie_disk_head", "cpu_offload", "disk_offload"])
def test_head_tied_to_the_embedding_works_and_keeps_its_tie(offload, tmp_path):
    model = tiny_tied_llama()
    expected = logits(rounded_except_tied(model))
    if offload == "split_tie_disk_head":
        dispatch_model(model, {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
                               "model.rotary_emb": "cpu", "lm_head": "disk"}, offload_dir=tmp_path)
    elif offload == "cpu_offload":
        cpu_offload(model)
    elif offload == "disk_offload":
        disk_offload(model, tmp_path)
    attach_layerwise_casting_hooks(model, STORAGE, COMPUTE)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == STORAGE
    assert model.lm_head.weight.dtype == torch.float32  # shared with the embedding: never stored in fp8
    if offload is None:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), expected)
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_cast_then_offload_keeps_a_tied_head_tied(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight
    expected = copy.deepcopy(model)
    expected[1].weight.data = expected[1].weight.data.to(STORAGE).to(COMPUTE)
    expected[1].bias.data = expected[1].bias.data.to(STORAGE).to(COMPUTE)
    ids = torch.tensor([[1, 2, 3]])
    attach_layerwise_casting_hooks(model, STORAGE, COMPUTE)
    assert model[2].weight is model[0].weight and model[0].weight.dtype == torch.float32
    disk_offload(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(model(ids), expected(ids))


# --- a model-wide cast after layerwise casting ---------------------------------------------------


class Chain(nn.Module):
    """Only supported layers: after ``.to(torch.float64)`` a float32 input still runs (compute dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Recording(8, 16), Recording(16, 16), Recording(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


CHAIN_OFFLOADS = {
    "b_on_disk": lambda m, tmp: dispatch_model(m, {"a": "cpu", "b": "disk", "c": "cpu"}, offload_dir=tmp),
    "all_on_disk": lambda m, tmp: dispatch_model(m, {"a": "disk", "b": "disk", "c": "disk"}, offload_dir=tmp),
    "cpu_offload": lambda m, tmp: cpu_offload(m),
    "disk_offload": lambda m, tmp: disk_offload(m, tmp),
    "preloaded": lambda m, tmp: dispatch_model(m, {"": "disk"}, offload_dir=tmp, preload_module_classes=["Chain"]),
}


def dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {name: value.dtype for name, value in model.state_dict().items()}


@pytest.mark.parametrize("cast", ["to_float64", "double", "to_bfloat16"])
@pytest.mark.parametrize("order", ["offload_first", "cast_first"])
@pytest.mark.parametrize("offload", list(CHAIN_OFFLOADS))
def test_a_model_wide_cast_lasts_until_the_next_forward_as_on_the_plain_model(offload, order, cast, tmp_path):
    """diffusers' rule, with or without offload: the cast changes the weights' dtype; the next forward
    computes with them rounded to the storage dtype and stores them in it again."""
    apply = {"to_float64": lambda m: m.to(torch.float64), "double": lambda m: m.double(),
             "to_bfloat16": lambda m: m.to(torch.bfloat16)}[cast]  # fmt: skip
    torch.manual_seed(0)
    plain = Chain().eval()
    model = copy.deepcopy(plain)
    attach_layerwise_casting_hooks(plain, STORAGE, COMPUTE)
    expected = run(plain)
    if order == "cast_first":
        attach_layerwise_casting_hooks(model, STORAGE, COMPUTE)
    CHAIN_OFFLOADS[offload](model, tmp_path / "offload")
    if order == "offload_first":
        attach_layerwise_casting_hooks(model, STORAGE, COMPUTE)
    apply(plain)
    apply(model)
    assert dtypes(model) == dtypes(plain) == dict.fromkeys(dtypes(plain), torch.float64 if "64" in cast or
                                                           cast == "double" else torch.bfloat16)  # fmt: skip
    for _ in range(2):
        assert torch.equal(run(plain), expected)
        assert torch.equal(run(model), expected)
        assert dtypes(model) == dtypes(plain) == dict.fromkeys(dtypes(plain), STORAGE)
