"""A tiny Hugging Face causal-LM folder for the CLI, loader and generation tests (helper, not a test module)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# The tiny Llama of write_tiny_llama with decoder layers 1 and 2 on disk, everything else on the CPU.
TWO_LAYERS_ON_DISK = {
    "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
    "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
}  # fmt: skip

VOCAB = ["[UNK]", "[PAD]", "[EOS]"] + [f"w{i}" for i in range(61)]
LAYERS = 4


def write_tiny_llama(folder: Path, tokenizer: bool = True, tie: bool = False) -> Path:
    """Save a 4-layer LlamaForCausalLM (float32, safetensors) and optionally a word-level tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=2, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    if tokenizer:
        backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
        )
        fast.save_pretrained(str(folder))
    return folder


def copy_without_tokenizer(source: Path, target: Path) -> Path:
    """A copy of a model folder with only config.json and the weights."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(source / name, target / name)
    return target
