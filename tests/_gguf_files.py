"""Small GGUF files written with gguf.GGUFWriter from a tiny transformers Llama (helper, not a test module).

The tensors are written as llama.cpp's converter writes them: GGUF names (``blk.N.attn_q.weight``
...), the query/key rows permuted the llama.cpp way, 2-D weights optionally quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# HF name inside a decoder layer -> GGUF name inside ``blk.N``
LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip


def tiny_llama(tie: bool = False, layers: int = 4):
    """A float32 LlamaForCausalLM small enough for unit tests (hidden 32, 4 heads, 2 kv heads)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=2, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


def half_on_disk(layers: int = 4) -> dict[str, str]:
    """A Llama's device map: embeddings, final norm, rotary embedding, head and the first ``layers // 2``
    decoder layers on the CPU, the other layers on disk."""
    top = dict.fromkeys(("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"), "cpu")
    return {**top, **{f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)}}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to q/k projections (transformers undoes it)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_names(model) -> dict[str, str]:
    """HF name -> GGUF name for every tensor of a tiny Llama."""
    names = {}
    for hf_name in model.state_dict():
        if hf_name in TOP_NAMES:
            names[hf_name] = TOP_NAMES[hf_name]
            continue
        parts = hf_name.split(".")  # model.layers.N.rest
        names[hf_name] = f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}"
    return names


def write_tiny_gguf(
    path: Path,
    model,
    quant: str | None = None,
    extra: dict[str, np.ndarray] | None = None,
    edit: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> Path:
    """Write ``model`` as a llama GGUF file.

    Args:
        quant: a ``GGMLQuantizationType`` name (``"Q8_0"``, ``"Q4_1"`` ...) for the 2-D weights; F32 when None.
        extra: more tensors to write under their GGUF names (float32).
        edit: called with (GGUF name, array) before writing; returns the array to write.
    """
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    state = model.state_dict()
    names = gguf_names(model)
    if config.tie_word_embeddings:
        names.pop("lm_head.weight")
    for hf_name, gguf_name in names.items():
        array = state[hf_name].detach().numpy().astype(np.float32)
        if gguf_name.endswith("attn_q.weight"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if edit is not None:
            array = edit(gguf_name, array)
        _add(writer, gguf_name, np.ascontiguousarray(array), quant)
    for gguf_name, array in (extra or {}).items():
        _add(writer, gguf_name, array.astype(np.float32), None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer, name: str, array: np.ndarray, quant: str | None) -> None:
    import gguf

    if quant is None or array.ndim < 2:
        writer.add_tensor(name, array)
        return
    qtype = gguf.GGMLQuantizationType[quant]
    writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def set_tensor_type(path: Path, tensor: str, raw_type: int) -> None:
    """Overwrite the quantization type code of one tensor in place (to craft an unknown type)."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    field = next(t.field for t in reader.tensors if t.name == tensor)
    field.parts[4][0] = raw_type
    del reader
