"""The models of the differential harness (helper, not a test module).

Each :class:`ModelCase` builds one small fp32 model in eval mode, always with the same
weights (seeded), and the inputs of its forward.  Transformers models are built from
configs (no hub); the tiny ``nn.Module`` ones cover what transformers models lack:
BatchNorm (float and integer buffers that a train-mode forward updates), a non-persistent
buffer, a float input that gradients flow back to, a forward assigned on an instance,
and a tied head over an embedding.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 64


@dataclass(frozen=True)
class ModelCase:
    """One model of the zoo.

    Args:
        name: short id shown in failure reports.
        build: returns the model (fp32, eval mode, deterministic weights).
        inputs: returns the forward's keyword arguments (fresh tensors each call).
        generates: the model has ``generate`` (a transformers LM).
        no_split: class names a block-granularity device map keeps whole.
        tags: facts the operations and paths ask about ("hf", "float_input", "tied", ...).
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    generates: bool = False
    no_split: tuple[str, ...] = ()
    tags: frozenset[str] = field(default_factory=frozenset)

    def __repr__(self) -> str:
        return self.name


def output_tensor(output: Any) -> torch.Tensor:
    """The tensor of a forward's result that the harness compares (``logits`` for transformers)."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"no tensor to compare in a {type(output).__name__}")


# --- tiny nn.Modules ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.norm = nn.BatchNorm1d(2 * dim)
        self.drop = nn.Dropout(0.25)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.relu(self.norm(self.up(x)))))


class TinyMLP(nn.Module):
    """Linear/BatchNorm/Dropout blocks, a LayerNorm, a non-persistent buffer, a Linear head."""

    _no_split_modules = ["Block"]

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(3)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 4)
        self.register_buffer("scale", torch.tensor([0.5]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)) * self.scale


def _head_forward(self: nn.Linear, x: torch.Tensor, bias_scale: float = 1.0) -> torch.Tensor:
    return nn.functional.linear(x, self.weight, self.bias * bias_scale)


def _mlp_with_instance_forward() -> nn.Module:
    """TinyMLP whose head has a forward assigned on the instance (a bound method with its own signature)."""
    model = _seeded(TinyMLP)
    model.head.forward = types.MethodType(_head_forward, model.head)
    return model


class TiedEmbeddingLM(nn.Module):
    """Embedding → two Linear layers → a head that shares the embedding's weight."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(input_ids)))


def _seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory().to(torch.float32).eval()


def _float_input() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(5, 8, generator=torch.Generator().manual_seed(1))}


def _ids(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(2))


def _lm_inputs() -> dict[str, torch.Tensor]:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _seq2seq_inputs() -> dict[str, torch.Tensor]:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": _ids(2, 3)}


# --- transformers models built from configs ------------------------------------------------


def _hf(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        return _seeded(lambda: getattr(transformers, model_name)(cfg))

    return build


_LLAMA = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
_MIXTRAL = dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2)
_T5 = dict(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
           relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
_BERT = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0)

MODELS: tuple[ModelCase, ...] = (
    ModelCase("mlp", lambda: _seeded(TinyMLP), _float_input, no_split=("Block",),
              tags=frozenset({"float_input", "batchnorm"})),
    ModelCase("mlp_instance_forward", _mlp_with_instance_forward, _float_input, no_split=("Block",),
              tags=frozenset({"float_input", "batchnorm", "instance_forward"})),
    ModelCase("tied_embedding", lambda: _seeded(TiedEmbeddingLM), lambda: {"input_ids": _ids()},
              tags=frozenset({"tied"})),
    ModelCase("llama", _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA, tie_word_embeddings=False), _lm_inputs,
              generates=True, no_split=("LlamaDecoderLayer",), tags=frozenset({"hf"})),
    ModelCase("llama_tied", _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA, tie_word_embeddings=True), _lm_inputs,
              generates=True, no_split=("LlamaDecoderLayer",), tags=frozenset({"hf", "tied"})),
    ModelCase("mixtral", _hf("MixtralConfig", "MixtralForCausalLM", **_MIXTRAL, tie_word_embeddings=False),
              _lm_inputs, generates=True, no_split=("MixtralDecoderLayer",), tags=frozenset({"hf", "moe"})),
    ModelCase("t5", _hf("T5Config", "T5ForConditionalGeneration", **_T5), _seq2seq_inputs, generates=True,
              no_split=("T5Block",), tags=frozenset({"hf", "tied", "seq2seq"})),
    ModelCase("bert", _hf("BertConfig", "BertForMaskedLM", **_BERT), _lm_inputs,
              no_split=("BertLayer",), tags=frozenset({"hf", "tied", "encoder"})),
)

MODELS_BY_NAME = {case.name: case for case in MODELS}
