"""Page-cache helpers for the read-ahead tests: drop a file's pages, write a Llama whose layers
(16 MB each, float32 safetensors) exceed the kernel's read-around of one page fault."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def drop(path: str | os.PathLike) -> None:
    """Write ``path``'s dirty pages out, then drop all its pages from the page cache (this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_wide_llama(path: Path, layers: int = 4) -> Path:
    """Save a random ``layers``-layer Llama (hidden 512, untied head, 16 MB per layer) at ``path``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(str(path))
    return path
