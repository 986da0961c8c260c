"""A config with sizes no model has (``num_hidden_layers: -1``...) is refused naming the key, the file and the fix.

Before: ``num_hidden_layers: -1`` built a model with no layers and `bigmodel estimate` printed its
sizes as if nothing were wrong; ``num_attention_heads: 0`` was a ``ZeroDivisionError`` traceback
from transformers; ``vocab_size: -5`` a ``RuntimeError`` traceback from torch ("Trying to create
tensor with negative dimension").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from bigmodel.cli.main import main
from bigmodel.integrations.hf import empty_model, load_config
from bigmodel.integrations.hf_models import check_config_sizes

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip

# key → (bad value, the range the message gives)
BAD = {
    "num_hidden_layers": (-1, "number of layers must be a whole number from 0 to 100,000"),
    "num_attention_heads": (0, "number of heads must be a whole number from 1 to 2,147,483,647"),
    "vocab_size": (-5, "size must be a whole number from 0 to 2,147,483,647"),
    "intermediate_size": (2**40, "size must be a whole number from 0 to 2,147,483,647"),
    "head_dim": (-8, "size must be a whole number from 0 to 2,147,483,647"),
}


def _folder(tmp_path: Path, **changes: object) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY, **changes}))
    return folder


def _message(path: str, key: str, value: object, rule: str) -> str:
    return (
        rf"In '{re.escape(path)}', {key} is {re.escape(repr(value))}, but a {rule}; correct {key} in "
        r"that config \(the model's published config\.json has the value it was trained with\)\."
    )


@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("key", list(BAD))
def test_the_cli_names_the_key_the_file_and_the_fix(tmp_path, capsys, monkeypatch, command: str, key: str) -> None:
    monkeypatch.delenv("BIGMODEL_DEBUG", raising=False)
    value, rule = BAD[key]
    folder = _folder(tmp_path, **{key: value})
    assert main([command, str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("bigmodel: error: ")]
    assert len(lines) == 1, captured.err
    assert re.fullmatch("bigmodel: error: " + _message(str(folder / "config.json"), key, value, rule), lines[0])


def test_generate_refuses_it_before_reading_anything(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("BIGMODEL_DEBUG", raising=False)
    folder = _folder(tmp_path, num_hidden_layers=-1)
    assert main(["generate", str(folder), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert "num_hidden_layers is -1, but a number of layers" in capsys.readouterr().err


def test_a_config_json_path_is_named_as_given(tmp_path) -> None:
    folder = _folder(tmp_path, num_hidden_layers=-1)
    message = _message(str(folder / "config.json"), "num_hidden_layers", -1, BAD["num_hidden_layers"][1])
    with pytest.raises(ValueError, match=message):
        load_config(folder / "config.json")


def test_a_nested_config_is_named_by_its_dotted_key(tmp_path) -> None:
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": -3, "num_attention_heads": 4,
            "vocab_size": 64, "model_type": "llama"}  # fmt: skip
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text}))
    with pytest.raises(ValueError, match=r"config\.json', text_config\.num_hidden_layers is -3, but a number of"):
        load_config(folder)


def test_a_config_object_is_checked_before_the_model_is_built() -> None:
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    config.num_hidden_layers = -1
    with pytest.raises(ValueError, match=r"^In the config, num_hidden_layers is -1, but a number of layers"):
        empty_model(config)


def test_sound_sizes_still_build(tmp_path) -> None:
    model = empty_model(_folder(tmp_path, num_hidden_layers=0, num_key_value_heads=None))
    assert len(model.model.layers) == 0 and model.config.num_key_value_heads == 4


def test_per_layer_lists_are_checked_item_by_item() -> None:
    check_config_sizes({"intermediate_size": [64, 128], "num_key_value_heads": None}, "'c.json'")
    with pytest.raises(ValueError, match=r"^In 'c\.json', intermediate_size\[1\] is -1, but a size must"):
        check_config_sizes({"intermediate_size": [64, -1]}, "'c.json'")
