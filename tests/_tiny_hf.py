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


def hub_snapshot(cache: Path, source: Path, repo: str = "models--tiny-org--tiny-llama") -> Path:
    """Lay ``source``'s files out as ``huggingface_hub`` caches a repo: ``cache/<repo>/blobs/<sha256>``, the
    snapshot's files relative links ``../../blobs/<sha256>``, ``refs/main``; returns the snapshot folder."""
    import hashlib
    import os

    revision = "0123456789abcdef0123456789abcdef01234567"
    root = cache / repo
    snapshot = root / "snapshots" / revision
    for folder in (root / "blobs", snapshot, root / "refs"):
        folder.mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    for path in sorted(p for p in source.iterdir() if p.is_file()):
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / digest).write_bytes(data)
        os.symlink(f"../../blobs/{digest}", snapshot / path.name)
    return snapshot


def as_torch_bin(folder: Path) -> Path:
    """Replace ``folder``'s ``model.safetensors`` by the same tensors in ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder
