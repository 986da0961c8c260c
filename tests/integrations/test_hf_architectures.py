"""load_pretrained on every kind of transformers model, against transformers' own from_pretrained.

Each case builds a tiny model from a config, saves it as the hub stores such checkpoints
(transformers 5 writes MoE experts one key per expert and GPT-NeoX's head as ``embed_out``;
old BERT checkpoints say ``LayerNorm.gamma``; wav2vec2 checkpoints say ``weight_g``/``weight_v``),
loads it with ``bigmodel.load_pretrained`` over cpu + disk and all on cpu, and compares every
output tensor and every weight (values and dtypes) with ``AutoModelFor*.from_pretrained(folder)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")  # the checkpoint key conversions of transformers 5
from safetensors.torch import load_file, save_file  # noqa: E402

from bigmodel import load_pretrained  # noqa: E402
from bigmodel.utils import get_state_dict_offloaded_model  # noqa: E402

T = transformers
IDS = torch.tensor([[3, 9, 4, 20, 7, 11]])
DECODER_IDS = torch.tensor([[1, 5, 8]])


def _text() -> dict[str, torch.Tensor]:
    return {"input_ids": IDS}


def _seq2seq() -> dict[str, torch.Tensor]:
    return {"input_ids": IDS, "decoder_input_ids": DECODER_IDS}


def _image() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))}


def _mel() -> dict[str, torch.Tensor]:
    features = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    return {"input_features": features, "decoder_input_ids": DECODER_IDS}


def _audio() -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(1, 400, generator=torch.Generator().manual_seed(3))}


def _rename_keys(folder: Path, rename: Callable[[str], str]) -> None:
    """Rewrite model.safetensors with renamed keys (the layout of older hub checkpoints)."""
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    save_file({rename(k): v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def _legacy_layer_norm(folder: Path) -> None:
    _rename_keys(folder, lambda k: k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"))


def _legacy_weight_norm(folder: Path) -> None:
    names = {"parametrizations.weight.original0": "weight_g", "parametrizations.weight.original1": "weight_v"}
    _rename_keys(folder, lambda k: next((k.replace(a, b) for a, b in names.items() if a in k), k))


@dataclass(frozen=True)
class Case:
    config: Callable[[], Any]
    architecture: str  # the class save_pretrained records in config.architectures
    auto_class: str  # the AutoModelFor* a user would load it with
    inputs: Callable[[], dict[str, torch.Tensor]]
    legacy_key: str  # a key the saved checkpoint must hold: proves the renaming/fusing is exercised
    rewrite: Callable[[Path], None] | None = None
    shard_size: str | None = None  # save in shards this large (an expert group spread over files)


def _decoder(**kw: Any) -> dict[str, Any]:
    return dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **kw)


CASES = {
    "llama": Case(
        lambda: T.LlamaConfig(**_decoder(intermediate_size=64, num_key_value_heads=2)),
        "LlamaForCausalLM", "AutoModelForCausalLM", _text, "model.layers.0.mlp.up_proj.weight",
    ),
    "gpt_neox": Case(
        lambda: T.GPTNeoXConfig(**_decoder(intermediate_size=64)),
        "GPTNeoXForCausalLM", "AutoModelForCausalLM", _text, "embed_out.weight",
    ),
    "mixtral": Case(
        lambda: T.MixtralConfig(**_decoder(intermediate_size=48, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2)),
        "MixtralForCausalLM", "AutoModelForCausalLM", _text, "model.layers.1.block_sparse_moe.experts.3.w1.weight",
        shard_size="20KB",
    ),
    "qwen2_moe": Case(
        lambda: T.Qwen2MoeConfig(**_decoder(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2,
                                            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        "Qwen2MoeForCausalLM", "AutoModelForCausalLM", _text, "model.layers.0.mlp.experts.2.gate_proj.weight",
    ),
    "bert": Case(
        lambda: T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64),
        "BertForMaskedLM", "AutoModelForMaskedLM", _text, "bert.embeddings.LayerNorm.gamma",
        rewrite=_legacy_layer_norm,
    ),
    "t5": Case(
        lambda: T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                           decoder_start_token_id=0),
        "T5ForConditionalGeneration", "AutoModelForSeq2SeqLM", _seq2seq, "shared.weight",
    ),
    "bart": Case(
        lambda: T.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                             max_position_embeddings=32),
        "BartForConditionalGeneration", "AutoModelForSeq2SeqLM", _seq2seq, "model.shared.weight",
    ),
    "vit": Case(
        lambda: T.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, num_labels=3),
        "ViTForImageClassification", "AutoModelForImageClassification", _image, "classifier.weight",
    ),
    "whisper": Case(
        lambda: T.WhisperConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2),
        "WhisperForConditionalGeneration", "AutoModelForSpeechSeq2Seq", _mel, "model.encoder.conv1.weight",
    ),
    "wav2vec2": Case(
        lambda: T.Wav2Vec2Config(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                                 num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2),
        "Wav2Vec2ForCTC", "AutoModelForCTC", _audio, "wav2vec2.encoder.pos_conv_embed.conv.weight_g",
        rewrite=_legacy_weight_norm,
    ),
}  # fmt: skip


def _decoder_map(on_disk: str) -> dict[str, str]:
    """A device map of a 2-layer decoder (``model.*`` + ``lm_head``) with one module on disk."""
    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head"]
    return {name: "disk" if name == on_disk else "cpu" for name in names}


def _checkpoint_keys(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    return set(load_file(str(folder / "model.safetensors")))


def write_case(case: Case, folder: Path, seed: int = 0) -> Path:
    """Save the case's tiny model the way the hub stores it, and check the legacy layout is there."""
    config = case.config()
    torch.manual_seed(seed)
    model = getattr(T, case.architecture)(config).eval()
    if case.shard_size is None:
        model.save_pretrained(str(folder))
    else:
        model.save_pretrained(str(folder), max_shard_size=case.shard_size)
    if case.rewrite is not None:
        case.rewrite(folder)
    assert case.legacy_key in _checkpoint_keys(folder), sorted(_checkpoint_keys(folder))[:20]
    assert json.loads((folder / "config.json").read_text())["architectures"] == [case.architecture]
    return folder


def outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor field of a forward's output (caches and other objects left out)."""
    with torch.no_grad():
        result = model(**inputs)
    return {k: v for k, v in result.items() if isinstance(v, torch.Tensor)}


def assert_same_model(model: torch.nn.Module, reference: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    assert type(model) is type(reference)
    assert not model.training
    ours, theirs = get_state_dict_offloaded_model(model), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    differing = [k for k in theirs if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not differing, differing[:10]
    got, expected = outputs(model, inputs), outputs(reference, inputs)
    assert sorted(got) == sorted(expected) and expected
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Case, Path, Any]:
    case = CASES[request.param]
    folder = write_case(case, tmp_path_factory.mktemp(request.param) / "model")
    reference = getattr(T, case.auto_class).from_pretrained(str(folder)).eval()
    return case, folder, reference


def test_cpu_and_disk_is_bit_exact(saved: tuple[Case, Path, Any], tmp_path: Path) -> None:
    case, folder, reference = saved
    size = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    model = load_pretrained(
        folder, device_map="sequential", max_memory={"cpu": size * 4 // 5}, offload_folder=tmp_path / "off"
    )
    assert {"cpu", "disk"} <= set(model.hf_device_map.values()), model.hf_device_map
    assert_same_model(model, reference, case.inputs())


def test_all_on_cpu_is_bit_exact(saved: tuple[Case, Path, Any]) -> None:
    case, folder, reference = saved
    model = load_pretrained(folder, device_map={"": "cpu"})
    assert model.hf_device_map == {"": "cpu"}
    assert_same_model(model, reference, case.inputs())


def test_renamed_tensors_on_disk_point_into_the_checkpoint(tmp_path: Path) -> None:
    """A renamed key keeps bigmodel's in-place disk offload; a fused expert tensor is written once."""
    neox = write_case(CASES["gpt_neox"], tmp_path / "neox")
    model = load_pretrained(neox, device_map={"gpt_neox": "cpu", "lm_head": "disk"}, offload_folder=tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["index.json"]
    entry = json.loads((tmp_path / "a" / "index.json").read_text())["lm_head.weight"]
    assert entry["weight_name"] == "embed_out.weight"
    assert Path(entry["safetensors_file"]) == (neox / "model.safetensors").resolve()
    reference = T.AutoModelForCausalLM.from_pretrained(str(neox)).eval()
    assert_same_model(model, reference, _text())
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(IDS, **greedy), reference.generate(IDS, **greedy))

    moe = write_case(CASES["qwen2_moe"], tmp_path / "moe")
    load_pretrained(moe, device_map=_decoder_map("model.layers.1"), offload_folder=tmp_path / "b")
    index = json.loads((tmp_path / "b" / "index.json").read_text())
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert "safetensors_file" not in index[fused] and index[fused]["shape"] == [4, 32, 32]
    assert index["model.layers.1.mlp.gate.weight"]["weight_name"] == "model.layers.1.mlp.gate.weight"


def test_save_pretrained_writes_the_layout_it_was_loaded_from(tmp_path: Path) -> None:
    """As after from_pretrained, save_pretrained reverts the conversions that were used (gamma/beta kept)."""
    folder = write_case(CASES["bert"], tmp_path / "model")
    load_pretrained(folder, device_map={"": "cpu"}).save_pretrained(str(tmp_path / "ours"))
    T.AutoModelForMaskedLM.from_pretrained(str(folder)).save_pretrained(str(tmp_path / "theirs"))
    ours, theirs = _checkpoint_keys(tmp_path / "ours"), _checkpoint_keys(tmp_path / "theirs")
    assert ours == theirs and "bert.embeddings.LayerNorm.gamma" in ours


# ---------------------------------------------------------------- dtypes, kept-in-fp32 modules


@pytest.mark.parametrize(
    ("name", "dtype", "kept"),
    [
        ("t5", torch.float16, "encoder.block.0.layer.1.DenseReluDense.wo.weight"),  # T5 _keep_in_fp32_modules
        ("t5", torch.bfloat16, None),  # the non-strict list applies to float16 only
    ],
)
def test_dtype_and_kept_fp32_modules_match(
    name: str, dtype: torch.dtype, kept: str | None, tmp_path: Path
) -> None:
    case = CASES[name]
    folder = write_case(case, tmp_path / "model")
    reference = getattr(T, case.auto_class).from_pretrained(str(folder), dtype=dtype).eval()
    if kept is not None:
        assert reference.state_dict()[kept].dtype == torch.float32
    model = load_pretrained(
        folder, device_map="sequential", max_memory={"cpu": 20_000}, offload_folder=tmp_path / "off", dtype=dtype
    )
    assert "disk" in model.hf_device_map.values()
    assert_same_model(model, reference, case.inputs())


def test_strict_fp32_modules_in_bfloat16(tmp_path: Path) -> None:
    """DeepSeek-V3 keeps its router (``gate.weight``, ``e_score_correction_bias``) in float32 under bf16."""
    case = Case(
        lambda: T.DeepseekV3Config(**_decoder(
            intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
        )),
        "DeepseekV3ForCausalLM", "AutoModelForCausalLM", _text, "model.layers.1.mlp.experts.3.up_proj.weight",
    )  # fmt: skip
    folder = write_case(case, tmp_path / "model")
    reference = T.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    assert reference.state_dict()["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    model = load_pretrained(
        folder, device_map=_decoder_map("model.layers.1"), offload_folder=tmp_path / "off", dtype="bfloat16"
    )
    assert_same_model(model, reference, case.inputs())


def test_dtype_auto_reads_the_checkpoint_when_the_config_has_none(tmp_path: Path) -> None:
    folder = write_case(CASES["llama"], tmp_path / "model")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    reference = T.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert reference.dtype == torch.bfloat16
    model = load_pretrained(folder, device_map={"": "cpu"})
    assert_same_model(model, reference, _text())


# ---------------------------------------------------------------- tied weights as transformers ties them


def _tied_llama(folder: Path, keep: Callable[[str], bool], change: str | None = None) -> Path:
    case = Case(lambda: T.LlamaConfig(**_decoder(intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=True)),
                "LlamaForCausalLM", "AutoModelForCausalLM", _text, "model.embed_tokens.weight")  # fmt: skip
    write_case(case, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    if change is not None:
        tensors[change] = tensors[change] + 1.0
    save_file({k: v for k, v in tensors.items() if keep(k)}, str(folder / "model.safetensors"), {"format": "pt"})
    return folder


@pytest.mark.parametrize(
    ("keep", "change"),
    [
        (lambda k: k != "model.embed_tokens.weight", None),  # only the head is stored: ties the other way
        (lambda k: True, None),  # both stored, equal: tied
        (lambda k: True, "lm_head.weight"),  # both stored, different: transformers unties them
    ],
    ids=["head-only", "both-equal", "both-different"],
)
def test_tied_weights_follow_transformers(keep: Callable[[str], bool], change: str | None, tmp_path: Path) -> None:
    folder = _tied_llama(tmp_path / "model", keep, change)
    reference = T.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tied = reference.lm_head.weight is reference.model.embed_tokens.weight
    assert tied == (change is None)
    model = load_pretrained(folder, device_map={"": "cpu"})
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert_same_model(model, reference, _text())


# ---------------------------------------------------------------- what cannot be loaded says so


@pytest.mark.parametrize(
    ("extra", "why"),
    [({}, "has no such model class"), ({"auto_map": {"AutoModelForCausalLM": "modeling_x.LlamaForTimeTravel"}}, "custom code")],
    ids=["unknown", "custom-code"],
)
def test_a_class_transformers_does_not_have_is_named(extra: dict, why: str, tmp_path: Path) -> None:
    folder = write_case(CASES["llama"], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config.update(extra, architectures=["LlamaForTimeTravel"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"LlamaForTimeTravel.*{why}.*model_class=") as info:
        load_pretrained(folder, device_map={"": "cpu"})
    assert str(folder) in str(info.value)


def test_model_class_picks_another_head(tmp_path: Path) -> None:
    """A LlamaForCausalLM checkpoint loaded as the bare decoder: ``model.`` is stripped and the head left out."""
    folder = write_case(CASES["llama"], tmp_path / "model")
    reference = T.AutoModel.from_pretrained(str(folder)).eval()
    assert type(reference) is T.LlamaModel
    model = load_pretrained(folder, device_map={"": "cpu"}, model_class=T.LlamaModel)
    assert_same_model(model, reference, _text())
    by_name = load_pretrained(folder, device_map={"layers.0": "cpu", "layers.1": "disk", "embed_tokens": "cpu",
                                                  "norm": "cpu", "rotary_emb": "cpu"},
                              offload_folder=tmp_path / "off", model_class="AutoModel")  # fmt: skip
    assert_same_model(by_name, reference, _text())


def test_weights_missing_from_the_checkpoint_are_named(tmp_path: Path) -> None:
    """BertModel has a pooler that BertForMaskedLM lacks: transformers would initialise it at random, which
    bigmodel cannot match, so it says which weights are missing and what to do, before loading anything."""
    folder = write_case(CASES["bert"], tmp_path / "model")
    with pytest.raises(ValueError, match=r"pooler\.dense\.bias, pooler\.dense\.weight are missing.*model_class="):
        load_pretrained(folder, device_map={"": "cpu"}, model_class=T.BertModel)
