"""Prompt encoding, greedy generation and the dispatched-vs-in-memory logits check, on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _tiny_hf import write_tiny_llama  # noqa: E402

from bigmodel.cli.generate import (  # noqa: E402
    check_against_in_memory,
    encode_prompt,
    forward_logits,
    generate,
    quiet_transformers,
)
from bigmodel.integrations.hf import load_pretrained, load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gen") / "model")


def test_encode_prompt_with_and_without_chat_template(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    assert encode_prompt(tokenizer, "w0 w1").tolist() == [[3, 4]]  # no template: plain encoding
    tokenizer.chat_template = "{% for m in messages %}w9 {{ m['content'] }}{% endfor %} w60"
    assert encode_prompt(tokenizer, "w0 w1").tolist() == [[12, 3, 4, 63]]
    assert encode_prompt(tokenizer, "w0 w1", chat=False).tolist() == [[3, 4]]


def test_offloaded_generation_equals_in_memory_generation(tiny: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    model = load_pretrained(tiny, max_memory={"cpu": 60_000}, offload_folder=tmp_path)
    assert "disk" in model.hf_device_map.values()
    result = generate(model, tokenizer, "w1 w2 w3", max_new_tokens=5)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    expected = generate(plain, tokenizer, "w1 w2 w3", max_new_tokens=5)
    assert result.input_ids.tolist() == [[4, 5, 6]]
    assert torch.equal(result.output_ids, expected.output_ids)
    assert result.text == expected.text and len(result.text.split()) == result.new_tokens == 5
    assert result.seconds > 0 and result.tokens_per_second > 0

    check = check_against_in_memory(model, tiny, result.output_ids)
    assert check.identical and check.max_abs_diff == 0.0 and check.tokens == 8
    assert torch.equal(forward_logits(model, result.output_ids), forward_logits(plain, result.output_ids))


def test_check_reports_a_difference(tiny: Path, tmp_path: Path) -> None:
    model = load_pretrained(tiny, max_memory={"cpu": "1GB"})
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    check = check_against_in_memory(model, tiny, torch.tensor([[4, 5, 6]]))
    assert not check.identical and check.max_abs_diff > 0


def test_max_new_tokens_must_be_positive(tiny: Path) -> None:
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    with pytest.raises(ValueError, match=r"max_new_tokens=0 must be at least 1"):
        generate(plain, load_tokenizer(tiny), "w1", max_new_tokens=0)


def test_check_shows_no_transformers_progress_and_restores_its_settings(tiny: Path, capfd) -> None:
    hf_logging = transformers.utils.logging
    hf_logging.enable_progress_bar()
    hf_logging.set_verbosity_warning()
    model = load_pretrained(tiny, max_memory={"cpu": "1GB"})
    capfd.readouterr()
    check = check_against_in_memory(model, tiny, torch.tensor([[4, 5, 6]]))
    assert check.identical
    assert "Loading weights" not in capfd.readouterr().err  # transformers draws it even without a terminal
    assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == hf_logging.WARNING
    with quiet_transformers(transformers):
        assert not hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == hf_logging.ERROR
