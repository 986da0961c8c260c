"""Every bad input to the CLI ends in one ``bigmodel: error: ...`` line naming the culprit, exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from _tiny_hf import LAYERS, write_tiny_llama  # noqa: E402

from bigmodel.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-errors") / "model")


GOOD_MAP = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
            "lm_head": "cpu"}  # fmt: skip


EXTRA = {"model.layers.55": "disk", "decoder": "cpu"}


def _without(device_map: dict, key: str) -> dict:
    return {k: v for k, v in device_map.items() if k != key}


def _map_file(tmp_path: Path, device_map: dict) -> str:
    path = tmp_path / "map.json"
    path.write_text(json.dumps(device_map))
    return str(path)


def _generate(tiny: Path, *extra: str) -> list[str]:
    return ["generate", str(tiny), "--prompt", "w1", "--max-new-tokens", "2", *extra]


CASES = {
    "map-misses-a-module": (
        lambda tiny, tmp: _generate(tiny, "--device-map", _map_file(tmp, _without(GOOD_MAP, "lm_head"))),
        r"map\.json': The device map does not cover 1 .*: lm_head\.weight\. Add them",
    ),
    "empty-map": (
        lambda tiny, tmp: _generate(tiny, "--device-map", _map_file(tmp, {})),
        r"map\.json': The device map does not cover .*model\.embed_tokens\.weight",
    ),
    "map-names-unknown-modules": (
        lambda tiny, tmp: _generate(tiny, "--device-map", _map_file(tmp, {**GOOD_MAP, **EXTRA})),
        r"map\.json' names 2 module\(s\) that LlamaForCausalLM does not have: 'model\.layers\.55', 'decoder'; remove",
    ),
    "offload-folder-is-a-file": (
        lambda tiny, tmp: _generate(tiny, "--max-memory", "cpu=60KB", "--offload-folder", str(_a_file(tmp))),
        r"Offload folder '.*a-file' is not writable: it is a file, not a folder; pass",
    ),
    "offload-folder-not-writable": (
        lambda tiny, tmp: _generate(tiny, "--max-memory", "cpu=60KB", "--offload-folder", "/proc/bigmodel-offload"),
        r"Offload folder '/proc/bigmodel-offload' is not writable",
    ),
    "empty-prompt": (
        lambda tiny, tmp: ["generate", str(tiny), "--prompt", ""],
        r"--prompt is empty; pass some text",
    ),
}  # fmt: skip


def _broken_copy(tiny: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    """A copy of the tiny model folder whose file ``name`` holds ``content``."""
    folder = tmp_path / "broken"
    folder.mkdir()
    for file in tiny.iterdir():
        (folder / file.name).write_bytes(content if file.name == name else file.read_bytes())
    return folder


# Before: the first was a traceback (transformers' OSError, exit 1), the others "'utf-8' codec can't decode
# byte 0xff in position 0: invalid start byte" naming no file.
BROKEN_FILES = {
    "generation-config-not-json": (
        lambda tiny, tmp: _generate(_broken_copy(tiny, tmp, "generation_config.json", b'{"a":')),
        r"Cannot read the generation_config\.json in '.*broken' \(.*not a valid JSON file\.\); fix the file",
    ),
    "tokenizer-not-utf8": (
        lambda tiny, tmp: _generate(_broken_copy(tiny, tmp, "tokenizer.json", b"\xff\xfe{}")),
        r"Cannot read the tokenizer files in '.*broken' \('utf-8' codec can't decode.*\); fix the file, or save",
    ),
    "map-file-not-utf8": (
        lambda tiny, tmp: _generate(tiny, "--device-map", str(_bytes_file(tmp, b"\xff\xfe{}"))),
        r"Device map file '.*map\.json' is not valid JSON \('utf-8' codec can't decode.*\); regenerate it\.",
    ),
}
CASES.update(BROKEN_FILES)


def _bytes_file(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "map.json"
    path.write_bytes(content)
    return path


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2(case: str, tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("BIGMODEL_DEBUG", raising=False)
    argv, message = CASES[case]
    assert main(argv(tiny, tmp_path)) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.strip().splitlines() if line.startswith("bigmodel: error: ")]
    assert len(lines) == 1, captured.err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_a_good_map_file_still_runs(tiny: Path, tmp_path: Path, capsys) -> None:
    assert main(_generate(tiny, "--device-map", _map_file(tmp_path, GOOD_MAP))) == 0
    assert f"{LAYERS}" in capsys.readouterr().out


def test_in_a_subprocess_the_error_is_the_last_line_and_no_traceback(tiny: Path, tmp_path: Path) -> None:
    argv = _generate(
        tiny, "--device-map", _map_file(tmp_path, {**GOOD_MAP, "model.layers.55": "disk"}),
        "--offload-folder", str(tmp_path / "offload"),
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "bigmodel.cli.main", *argv], capture_output=True, text=True, timeout=300,
        env={**os.environ, "BIGMODEL_DEBUG": ""},
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("bigmodel: error: ")
    assert "'model.layers.55'" in result.stderr
