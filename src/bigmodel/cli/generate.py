"""Prompt in, text out: greedy generation on a (dispatched) causal LM, timed, and the logits check.

The check answers "does offloading change anything?": the same token ids go through the
dispatched model and through the same checkpoint loaded whole in memory by transformers,
and the logits are compared bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class Generation:
    """The result of one greedy generation.

    Attributes:
        text: the decoded new tokens (special tokens skipped).
        input_ids: prompt token ids, shape ``(1, prompt_len)``.
        output_ids: prompt + new token ids, shape ``(1, prompt_len + new_tokens)``.
        new_tokens: number of generated tokens.
        seconds: wall time of the generation (seconds).
    """

    text: str
    input_ids: torch.Tensor
    output_ids: torch.Tensor
    new_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class LogitsCheck:
    """Dispatched vs in-memory logits on the same ids.

    Attributes:
        identical: True if every logit is bit-identical.
        max_abs_diff: largest absolute difference (0.0 when identical).
        tokens: number of positions compared.
        same_predictions: positions whose largest logit (the greedy next token) is the same token.
    """

    identical: bool
    max_abs_diff: float
    tokens: int
    same_predictions: int = 0


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> torch.Tensor:
    """Token ids ``(1, n)`` of ``prompt``; wrapped in the tokenizer's chat template when it has one and ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def input_device(model: nn.Module) -> torch.device:
    """Where input ids go: the device of the input embeddings (CPU for an offloaded embedding)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is None or weight.device.type == "meta":
        return torch.device("cpu")
    return weight.device


@contextlib.contextmanager
def quiet_transformers(transformers: Any) -> Iterator[None]:
    """Hide transformers' progress bars and messages below errors for the block; restores both after.

    The reference load of the logits check is not a load the user asked for: its "Loading
    weights" bar would land between the answer and the check line.
    """
    hf_logging = transformers.utils.logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@torch.inference_mode()
def generate(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 32, chat: bool = True) -> Generation:
    """Greedy generation (``do_sample=False``) of up to ``max_new_tokens`` tokens after ``prompt``.

    Raises:
        ValueError: ``max_new_tokens`` < 1.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    input_ids = encode_prompt(tokenizer, prompt, chat=chat).to(input_device(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    output_ids = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=pad,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    new = output_ids[0, input_ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    return Generation(text, input_ids.cpu(), output_ids.cpu(), int(new.numel()), seconds)


@torch.inference_mode()
def forward_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(1, n, vocab)`` of one forward over ``ids``, on CPU."""
    return model(ids.to(input_device(model)), use_cache=False).logits.float().cpu()


def check_against_in_memory(
    model: nn.Module, folder: str | os.PathLike, ids: torch.Tensor, dtype: torch.dtype | None = None
) -> LogitsCheck:
    """Compare the logits of ``model`` with those of the checkpoint loaded whole in memory by transformers.

    Args:
        model: the dispatched model.
        folder: the model folder it was loaded from.
        ids: token ids ``(1, n)`` to run through both.
        dtype: dtype to load the reference in; the dispatched model's parameter dtype when None.

    Returns:
        A :class:`LogitsCheck`.
    """
    from ..checkpoints.gguf import name_maps_built_once
    from ..integrations.hf import load_config, require_transformers
    from .embedded import gguf_progress_like_bigmodel

    transformers = require_transformers()
    if dtype is None:
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    dispatched = forward_logits(model, ids)
    with quiet_transformers(transformers):
        # a GGUF file: its config as already read (parsed once per process), its weights read by transformers
        where = {"gguf_file": Path(folder).name, "config": load_config(folder)} if str(folder).endswith(".gguf") else {}
        source = str(Path(folder).parent) if where else str(folder)
        with name_maps_built_once() if where else contextlib.nullcontext(), gguf_progress_like_bigmodel():
            reference_model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **where).eval()
    reference = forward_logits(reference_model, ids)
    del reference_model
    gc.collect()
    if dispatched.shape != reference.shape:
        return LogitsCheck(False, float("inf"), int(ids.shape[1]))
    diff = (dispatched - reference).abs().max().item()
    same = int((dispatched.argmax(-1) == reference.argmax(-1)).sum())
    return LogitsCheck(torch.equal(dispatched, reference), diff, int(ids.shape[1]), same)
