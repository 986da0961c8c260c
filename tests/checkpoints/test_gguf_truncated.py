"""A cut or corrupted GGUF file is named as such everywhere, before transformers parses its metadata."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from _gguf_files import tiny_llama, write_tiny_gguf

from bigmodel import load_pretrained
from bigmodel.checkpoints.gguf_meta import config_from_gguf
from bigmodel.cli.main import main

MESSAGE = r"GGUF file '.*{name}' is truncated or corrupted \((?P<detail>.+)\); download it again\.$"


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-cut") / "whole.gguf", tiny_llama(layers=2), quant="Q8_0")


def _cut(whole: Path, tmp_path: Path, name: str, keep: int) -> Path:
    data = whole.read_bytes()
    path = tmp_path / name
    path.write_bytes(data[:keep])
    return path


@pytest.mark.parametrize(
    ("name", "keep", "detail"),
    [
        ("end.gguf", -100, r"tensor '.+' needs bytes up to [\d,]+ but the file has [\d,]+"),
        ("head.gguf", 1000, r".+"),
        ("tiny.gguf", 10, r".+"),
    ],
)
def test_the_config_reader_names_a_cut_file(whole: Path, tmp_path: Path, name: str, keep: int, detail: str) -> None:
    path = _cut(whole, tmp_path, name, keep)
    with pytest.raises(ValueError, match=MESSAGE.format(name=name)) as info:
        config_from_gguf(path)
    assert "transformers" not in str(info.value)
    assert re.fullmatch(detail, re.search(MESSAGE.format(name=name), str(info.value))["detail"])


def test_the_whole_file_still_reads(whole: Path) -> None:
    assert config_from_gguf(whole).num_hidden_layers == 2


def test_load_pretrained_names_a_cut_header(whole: Path, tmp_path: Path) -> None:
    path = _cut(whole, tmp_path, "head.gguf", 1000)
    with pytest.raises(ValueError, match=MESSAGE.format(name="head.gguf")):
        load_pretrained(path, device_map="cpu")


@pytest.mark.parametrize("command", ["estimate", "generate"])
@pytest.mark.parametrize("keep", [1000, -100])
def test_the_cli_prints_one_line_and_exits_2(
    whole: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, keep: int
) -> None:
    path = _cut(whole, tmp_path, "cut.gguf", keep)
    argv = [command, str(path)] + (["--prompt", "a", "--max-new-tokens", "1"] if command == "generate" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("bigmodel: error: GGUF file ") and "cut.gguf' is truncated or corrupted (" in err, err
    assert err.endswith("; download it again."), err
