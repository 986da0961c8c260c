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


def write_wide_llama(path: Path, layers: int = 4, *, vocab: int = 64, tied: bool = False, seed: int = 0,
                     dtype: torch.dtype = torch.float32, **save: object) -> Path:
    """Save a random ``layers``-layer Llama (hidden 512, 16 MB per float32 layer; untied head unless ``tied``) of
    ``dtype`` at ``path``, drawn with ``seed``; ``save`` goes to ``save_pretrained`` (``max_shard_size``)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(dtype).eval().save_pretrained(str(path), **save)
    return path
