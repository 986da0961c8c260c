"""load_pretrained and the Hugging Face folder helpers, on tiny generated model folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _tiny_hf import copy_without_tokenizer, write_tiny_llama  # noqa: E402

from bigmodel.integrations import hf as _hf  # noqa: E402
from bigmodel.integrations.hf import (  # noqa: E402
    config_dtype,
    empty_model,
    load_pretrained,
    load_tokenizer,
    plan_device_map,
    read_device_map,
    resolve_model_folder,
)

IDS = torch.tensor([[3, 9, 4, 20, 7, 11]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def reference_logits(tiny: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_offloaded_load_is_bit_exact(tiny: Path, tmp_path: Path, reference_logits: torch.Tensor) -> None:
    model = load_pretrained(tiny, max_memory={"cpu": 60_000}, offload_folder=tmp_path)
    devices = set(model.hf_device_map.values())
    assert devices == {"cpu", "disk"}
    assert model.hf_device_map["model.embed_tokens"] == "cpu"
    assert torch.equal(logits(model), reference_logits)
    assert not model.training


def test_whole_model_in_memory_and_explicit_dtype(tiny: Path, reference_logits: torch.Tensor) -> None:
    model = load_pretrained(tiny, device_map="sequential", max_memory={"cpu": "1GB"})
    assert set(model.hf_device_map.values()) == {"cpu"}
    assert torch.equal(logits(model), reference_logits)
    half = load_pretrained(tiny, max_memory={"cpu": "1GB"}, dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_sharded_and_tied_checkpoints(tmp_path: Path) -> None:
    source = write_tiny_llama(tmp_path / "tied", tokenizer=False, tie=True)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    sharded = tmp_path / "sharded"
    plain.save_pretrained(str(sharded), max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    model = load_pretrained(sharded, max_memory={"cpu": 60_000}, offload_folder=tmp_path / "off")
    assert "disk" in model.hf_device_map.values()
    assert torch.equal(logits(model), logits(plain))


def test_device_map_file_is_read(tiny: Path, tmp_path: Path, reference_logits: torch.Tensor) -> None:
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps({"model": "cpu", "lm_head": "disk"}))
    assert read_device_map(map_file) == {"model": "cpu", "lm_head": "disk"}
    model = load_pretrained(tiny, device_map=str(map_file), offload_folder=tmp_path / "off")
    assert model.hf_device_map == {"model": "cpu", "lm_head": "disk"}
    assert torch.equal(logits(model), reference_logits)


def test_disk_without_offload_folder_is_refused_before_loading(tiny: Path) -> None:
    whole = r"leave the whole model \(165,024 bytes in all\) for disk but no offload folder.*largest layer 37,120 bytes"
    with pytest.raises(ValueError, match=whole):
        load_pretrained(tiny, max_memory={"cpu": 1000})
    some = r"1 module\(s\) such as 'lm_head' \([\d,]+ bytes in all\) for disk.*pass offload_folder"
    with pytest.raises(ValueError, match=some):
        load_pretrained(tiny, device_map={"model": "cpu", "lm_head": "disk"})


def test_folder_errors(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist; pass a model folder, its config\.json, or a \.gguf file"):
        resolve_model_folder(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"No config\.json in .*model\.save_pretrained\(folder\), or a \.gguf file"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(ValueError, match=r"holds no weights"):
        load_pretrained(tmp_path)
    assert resolve_model_folder(tiny / "config.json") == tiny


def test_a_weights_file_resolves_to_its_folder(tiny: Path, tmp_path: Path, caplog) -> None:
    with caplog.at_level("INFO", logger="bigmodel.integrations"):
        assert resolve_model_folder(tiny / "model.safetensors") == tiny
    assert "model.safetensors is a .safetensors weights file; using the model folder holding it" in caplog.text
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_text("{}")
    (index.parent / "config.json").write_text((tiny / "config.json").read_text())
    assert resolve_model_folder(index) == index.parent  # not read as a config file
    loose = tmp_path / "loose" / "model.safetensors"
    loose.parent.mkdir()
    loose.write_bytes((tiny / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"model\.safetensors' is a \.safetensors weights file, which holds no config, "
                       r"and its folder has no config\.json; pass the folder with config\.json"):
        resolve_model_folder(loose)
    bin_file = tmp_path / "loose" / "pytorch_model.bin"
    bin_file.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"is a \.bin weights file, which holds no config"):
        resolve_model_folder(bin_file)


def test_tokenizer(tiny: Path, tmp_path: Path) -> None:
    assert load_tokenizer(tiny)("w1 w2")["input_ids"] == [4, 5]
    bare = copy_without_tokenizer(tiny, tmp_path / "bare")
    with pytest.raises(ValueError, match=r"has no tokenizer .*tokenizer\.save_pretrained\(folder\)"):
        load_tokenizer(bare)


def test_empty_model_reads_no_weights_and_keeps_the_config(tiny: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(str(tiny))
    config.dtype = torch.bfloat16
    model = empty_model(config, dtype="float16")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert config.dtype == torch.bfloat16 and config_dtype(config) == torch.bfloat16
    assert _hf.no_split_classes(model) == ["LlamaDecoderLayer"]
    small = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_attention_heads=2, vocab_size=10,
        tie_word_embeddings=True,
    )  # fmt: skip
    tied = empty_model(small)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"Unknown dtype 'float13'"):
        empty_model(config, dtype="float13")


def test_config_json_path_and_bad_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match=r"Cannot read the model config in .*known 'model_type'"):
        _hf.load_config(tmp_path)
    other = tmp_path / "llama.json"
    other.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    assert _hf.load_config(other).num_hidden_layers == 3


def test_plan_device_map_strings_and_budgets(tiny: Path) -> None:
    model = empty_model(tiny)
    assert plan_device_map(model, "sequential", {"cpu": "1GB"}) == {"": "cpu"}
    spilled = plan_device_map(model, "auto", {"cpu": 60_000})
    assert "disk" in spilled.values()  # a disk budget is added when the budgets give none
    with pytest.raises(ValueError, match=r"Unknown device map 'fastest'; use one of auto, balanced"):
        plan_device_map(model, "fastest")
    assert plan_device_map(model, {"": "cpu:0"}) == {"": "cpu"}


def test_read_device_map_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist; pass auto, balanced, sequential"):
        read_device_map(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"is not valid JSON"):
        read_device_map(bad)
    bad.write_text(json.dumps({"model": "gpu?"}))
    with pytest.raises(ValueError, match=r"entry 'model'"):
        read_device_map(bad)


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str):
        raise ImportError(name)

    monkeypatch.setattr(_hf.importlib, "import_module", fail)
    with pytest.raises(ImportError, match=r"pip install bigmodel\[hf\]"):
        _hf.require_transformers()
