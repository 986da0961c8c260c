"""The GGUF conversion of the embedded model honours BIGMODEL_DISABLE_PROGRESS and never draws into logs.

transformers draws a tqdm bar while it dequantizes GGUF tensors; in a terminal it may show,
but with stderr redirected to a file or pipe (CI logs) or with the switch set, nothing of it
(no ``\\r`` line) may be written.
"""

from __future__ import annotations

import importlib
import io
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from _tiny_gguf import write_tiny_gguf  # noqa: E402

from bigmodel.cli.embedded import convert_gguf  # noqa: E402

BAR_TEXT = "GGUF tensors"


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _convert(tiny_gguf, tmp_path, monkeypatch, stderr: io.StringIO) -> str:
    target = tmp_path / "out"
    target.mkdir()
    reader = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar_before = reader.tqdm
    monkeypatch.setattr(sys, "stderr", stderr)
    convert_gguf(tiny_gguf, target)
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    assert reader.tqdm is bar_before  # transformers' module is left as it was
    assert (target / "model.safetensors").is_file() and (target / "tokenizer_config.json").is_file()
    return stderr.getvalue()


def test_no_bar_when_stderr_is_not_a_terminal(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.delenv("BIGMODEL_DISABLE_PROGRESS", raising=False)
    written = _convert(tiny_gguf, tmp_path, monkeypatch, io.StringIO())
    assert "\r" not in written
    assert BAR_TEXT not in written


def test_no_bar_in_a_terminal_when_disabled(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMODEL_DISABLE_PROGRESS", "1")
    written = _convert(tiny_gguf, tmp_path, monkeypatch, Terminal())
    assert "\r" not in written
    assert BAR_TEXT not in written


def test_the_bar_shows_in_a_terminal_by_default(tiny_gguf, tmp_path, monkeypatch):
    """The converse of the two above: the bar is really there to hide."""
    monkeypatch.delenv("BIGMODEL_DISABLE_PROGRESS", raising=False)
    written = _convert(tiny_gguf, tmp_path, monkeypatch, Terminal())
    assert BAR_TEXT in written and "\r" in written
