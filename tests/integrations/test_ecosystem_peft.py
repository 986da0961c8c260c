"""peft's adapter loading, merging and unloading on a disk-offloaded model, on bigmodel through use_bigmodel().

The budgets name only "cpu", as peft's own offload tests do: peft re-plans the wrapped model
with them and expects "disk" as the implicit last device.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import transformers
from _tiny_ecosystem import IDS, hook_owner, write_lora_adapter
from _tiny_hf import write_tiny_llama

from bigmodel.integrations import use_bigmodel

pytestmark = pytest.mark.slow

BUDGETS = {"cpu": 60_000}


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # peft rewrites the offloaded safetensors files at paths relative to the working directory.
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eco-peft")
    base = write_tiny_llama(root / "model", tokenizer=False)
    return base, write_lora_adapter(base, root / "adapter")


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def whole_peft(folders: tuple[Path, Path]) -> peft.PeftModel:
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folders[0]), dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, str(folders[1])).eval()


def offloaded_peft(folders: tuple[Path, Path], offload: Path) -> peft.PeftModel:
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(folders[0]), dtype=torch.float32, device_map="auto", max_memory=dict(BUDGETS), offload_folder=str(offload)
    )
    assert "disk" in base.hf_device_map.values()
    model = peft.PeftModel.from_pretrained(
        base, str(folders[1]), max_memory=dict(BUDGETS), offload_folder=str(offload)
    ).eval()
    assert "disk" in model.hf_device_map.values()
    assert hook_owner(model) == {"bigmodel"}
    return model


def test_adapter_on_disk_offloaded_model_is_bit_exact(folders, tmp_path: Path) -> None:
    reference = whole_peft(folders)
    with use_bigmodel():
        model = offloaded_peft(folders, tmp_path)
        with reference.disable_adapter():
            assert not torch.equal(logits(model), logits(reference))  # the adapter does change the output
        assert torch.equal(logits(model), logits(reference))


def test_merge_unmerge_and_merge_and_unload_are_bit_exact(folders, tmp_path: Path) -> None:
    reference = whole_peft(folders)
    with use_bigmodel():
        model = offloaded_peft(folders, tmp_path)
        model.merge_adapter()
        reference.merge_adapter()
        assert torch.equal(logits(model), logits(reference))
        model.unmerge_adapter()
        reference.unmerge_adapter()
        assert torch.equal(logits(model), logits(reference))
        merged, merged_reference = model.merge_and_unload(), reference.merge_and_unload()
        assert type(merged) is type(merged_reference)
        assert torch.equal(logits(merged), logits(merged_reference))
        tokens = merged.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=1)
        assert torch.equal(tokens, merged_reference.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=1))


def test_checkpoint_files_are_not_touched_by_merging(folders, tmp_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in folders[0].iterdir() if p.is_file()}
    with use_bigmodel():
        model = offloaded_peft(folders, tmp_path)
        model.merge_and_unload()
    assert {p.name: p.read_bytes() for p in folders[0].iterdir() if p.is_file()} == before


LAZY_PEFT = """
import sys, torch, transformers
from bigmodel import cpu_offload
from bigmodel.integrations import use_bigmodel

with use_bigmodel():
    assert "peft" not in sys.modules
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = cpu_offload(transformers.LlamaForCausalLM(config).eval())
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        base = model(ids).logits
    import peft  # imported after use_bigmodel(): patched on import
    peft_model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj"], r=2))
    assert not [n for n, p in peft_model.named_parameters() if "lora_" in n and p.is_meta]
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, base)
assert not hasattr(peft.tuners.tuners_utils.BaseTuner.inject_adapter, "__wrapped__")
print("ok")
"""


def test_peft_imported_after_use_bigmodel_creates_adapters_on_the_execution_device() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LAZY_PEFT], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_merge_and_unload_of_layers_offloaded_to_dat_files(tmp_path: Path) -> None:
    """A ``.bin`` checkpoint in a hub cache: the disk layers are ``.dat`` files of the offload folder, whose
    index entries name no safetensors file.  peft's ``onload_layer`` looked one up (``KeyError:
    'safetensors_file'``, with accelerate too); merging gives the plain model's results."""
    from _tiny_hf import TWO_LAYERS_ON_DISK, as_torch_bin, hub_snapshot

    from bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    snapshot = hub_snapshot(tmp_path / "hub", as_torch_bin(write_tiny_llama(tmp_path / "src", tokenizer=False)))
    blobs = {p.name: p.read_bytes() for p in (snapshot.parents[1] / "blobs").iterdir()}
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False)
    whole = transformers.AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32).eval()
    torch.manual_seed(1)
    reference = peft.get_peft_model(whole, config).eval()
    with use_bigmodel():
        with init_empty_weights():
            empty = transformers.AutoModelForCausalLM.from_config(whole.config, dtype=torch.float32).eval()
        base = load_checkpoint_and_dispatch(empty, str(snapshot), TWO_LAYERS_ON_DISK, offload_folder=str(tmp_path / "off"))
        assert (tmp_path / "off" / "model.layers.1.self_attn.q_proj.weight.dat").is_file()
        torch.manual_seed(1)
        model = peft.get_peft_model(base, config).eval()
        assert torch.equal(logits(model), logits(reference))
        merged, merged_reference = model.merge_and_unload(), reference.merge_and_unload()
        assert torch.equal(logits(merged), logits(merged_reference))
        tokens = merged.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=1)
        assert torch.equal(tokens, merged_reference.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=1))
    assert {p.name: p.read_bytes() for p in (snapshot.parents[1] / "blobs").iterdir()} == blobs
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "generation_config.json", "pytorch_model.bin"]


def test_merge_and_unload_of_layers_with_quantized_offload_storage(tmp_path: Path) -> None:
    """With ``offload_quantization`` the disk layers' weights map has no offload index: peft's ``onload_layer``
    raised ``AttributeError: 'QuantizedWeightsMap' object has no attribute 'index'``.  Merged, the model gives
    the adapter model's results (its dequantized weights plus the adapters' product) within rounding."""
    pytest.importorskip("torchao")
    from _tiny_hf import TWO_LAYERS_ON_DISK, hub_snapshot

    from bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    snapshot = hub_snapshot(tmp_path / "hub", write_tiny_llama(tmp_path / "src", tokenizer=False))
    config = transformers.AutoConfig.from_pretrained(str(snapshot))
    with use_bigmodel():
        with init_empty_weights():
            empty = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        base = load_checkpoint_and_dispatch(empty, str(snapshot), TWO_LAYERS_ON_DISK,
                                            offload_folder=str(tmp_path / "off"), offload_quantization="int8")  # fmt: skip
        torch.manual_seed(1)
        model = peft.get_peft_model(base, peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4,
                                                          init_lora_weights=False)).eval()  # fmt: skip
        adapted = logits(model)
        with model.disable_adapter():
            assert not torch.allclose(logits(model), adapted, atol=1e-3)
        torch.testing.assert_close(logits(model.merge_and_unload()), adapted, atol=1e-5, rtol=1e-5)
