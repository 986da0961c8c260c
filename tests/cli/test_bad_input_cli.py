"""Bad command lines: argparse's own errors and repeated budgets end in the CLI's one error line too.

Every bad input to ``bigmodel`` ends in exactly one ``bigmodel: error: ...`` line naming the
problem and the fix, exit status 2, no traceback (see tests/cli/test_cli_errors.py for the
errors raised while running a command).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bigmodel.cli._options import parse_max_memory
from bigmodel.cli.main import main

SRC = Path(__file__).resolve().parents[2] / "src"

# argv → what the one error line must say (argparse rejects these before any command runs).
ARGPARSE_CASES = {
    "not-an-int": (["generate", "--max-new-tokens", "abc"], r"--max-new-tokens: invalid int value: 'abc'.*`bigmodel generate --help`"),
    "unknown-command": (["bogus"], r"invalid choice: 'bogus'.*`bigmodel --help`"),
    "unknown-strategy": (["plan", "m", "--device-map", "foo"], r"--device-map: invalid choice: 'foo'.*`bigmodel plan --help`"),
    "missing-model": (["estimate"], r"required: model; see `bigmodel estimate --help`"),
    "unknown-option": (["plan", "m", "--max-memroy", "cpu=1GB"], r"unrecognized arguments: --max-memroy"),
    "no-command": ([], r"no command given; run `bigmodel generate`"),
}  # fmt: skip


def _error_lines(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if line.startswith("bigmodel: error: ")]


@pytest.mark.parametrize("case", list(ARGPARSE_CASES))
def test_argparse_errors_are_the_cli_error_line(case, capsys, monkeypatch):
    monkeypatch.delenv("BIGMODEL_DEBUG", raising=False)
    argv, message = ARGPARSE_CASES[case]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse exits from parse_args
        status = exit_.code
    assert status == 2
    captured = capsys.readouterr()
    lines = _error_lines(captured.err)
    # Before the fix: usage lines, then "bigmodel generate: error: ...", not the CLI's error line.
    assert len(lines) == 1, captured.err
    assert captured.err.strip().splitlines()[-1] == lines[0]
    assert re.search(message, lines[0]), lines[0]
    assert captured.out == ""


def _run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args...`` in a fresh interpreter on this tree's sources, debug tracebacks off."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(SRC), "BIGMODEL_DEBUG": ""},
    )  # fmt: skip


def test_argparse_error_in_a_subprocess_is_the_only_line():
    result = _run_module("bigmodel.cli.main", "generate", "--max-new-tokens", "abc")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bigmodel: error: argument --max-new-tokens: invalid int value: 'abc'; see `bigmodel generate --help`."
    ]


@pytest.mark.parametrize("items", [["cpu=1GB", "cpu=2GB"], ["0=1GB", "cuda:0=2GB"], ["disk=1TB", " disk=2TB"]])
def test_a_device_budgeted_twice_is_refused(items):
    # Before the fix: the last budget silently won.
    with pytest.raises(ValueError, match=rf"--max-memory item '{re.escape(items[1])}' budgets .* a second time"):
        parse_max_memory(items)


def test_distinct_budgets_still_parse():
    assert parse_max_memory(["cpu=1GB", "0=2GiB", "disk=1TB"]) == {"cpu": 10**9, 0: 2 * 2**30, "disk": 10**12}


CONFIGS = {
    "deeply-nested": ("[" * 100_000, r"Cannot read the model config in '.*deep'"),  # was a RecursionError traceback
    "field-of-wrong-type": (
        '{"model_type": "llama", "hidden_size": "x"}',
        r"Cannot read the model config in '.*wrong'.*hidden_size",  # was huggingface_hub's StrictDataclassError
    ),
    # Both were an AttributeError traceback from transformers ("module 'torch' has no attribute 'float7'").
    "unknown-torch-dtype": ('{"model_type": "llama", "torch_dtype": "float7"}', r"config in '.*wrong'.*'float7'"),
    "unknown-dtype": ('{"model_type": "llama", "dtype": "float7"}', r"config in '.*wrong'.*'float7'"),
}


@pytest.mark.parametrize("command", ["plan", "estimate"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_bad_config_is_the_cli_error_line(case, command, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.delenv("BIGMODEL_DEBUG", raising=False)
    text, message = CONFIGS[case]
    folder = tmp_path / ("deep" if case == "deeply-nested" else "wrong")
    folder.mkdir()
    (folder / "config.json").write_text(text)
    assert main([command, str(folder)]) == 2
    captured = capsys.readouterr()
    lines = _error_lines(captured.err)
    assert len(lines) == 1 and captured.err.strip().splitlines()[-1] == lines[0], captured.err
    assert re.search(message, lines[0]), lines[0]


def test_python_dash_m_bigmodel_is_the_command():
    # Before: "No module named bigmodel.__main__; 'bigmodel' is a package and cannot be directly executed".
    result = _run_module("bigmodel", "generate", "--max-new-tokens", "abc")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("bigmodel: error: argument --max-new-tokens")
