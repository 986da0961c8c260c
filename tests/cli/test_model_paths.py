"""What MODEL may name for the CLI: a model folder, or a weights file in one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from _tiny_hf import write_tiny_llama  # noqa: E402

from bigmodel.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-paths") / "model")


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("bigmodel: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


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
