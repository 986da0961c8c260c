"""Real transformers models: a Llama built from a config, and the embedded SmolLM2-135M checkpoint.

Logits of dispatched/offloaded models equal the plain model's bit for bit on CPU, and
``generate()`` produces the same tokens with half of the layers on disk.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bigmodel import (  # noqa: E402
    cpu_offload,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    remove_hook_from_submodules,
)

pytestmark = pytest.mark.slow


def half_on_disk(n_layers: int, prefix: str = "model") -> dict[str, str]:
    device_map = {f"{prefix}.embed_tokens": "cpu", f"{prefix}.norm": "cpu", f"{prefix}.rotary_emb": "cpu", "lm_head": "cpu"}
    for i in range(n_layers):
        device_map[f"{prefix}.layers.{i}"] = "cpu" if i < n_layers // 2 else "disk"
    return device_map


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    return config, model.state_dict(), ids, logits, tokens


def rebuilt(config, state):
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("kind", ["half_on_disk", "all_disk", "cpu_offload", "disk_offload"])
def test_llama_offloaded_logits_and_generate(kind, llama, tmp_path):
    config, state, ids, logits, tokens = llama
    model = rebuilt(config, state)
    if kind == "half_on_disk":
        dispatch_model(model, half_on_disk(4), offload_dir=tmp_path)
    elif kind == "all_disk":
        dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    elif kind == "cpu_offload":
        cpu_offload(model)
    else:
        disk_offload(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), tokens)
    remove_hook_from_submodules(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def smollm2_folder():
    try:
        from bigmodel.cli.embedded import embedded_model_folder
    except ImportError as err:  # pragma: no cover - the CLI helper's module is missing
        pytest.skip(f"bigmodel.cli.embedded is not available ({err})")
    try:
        return embedded_model_folder()
    except (FileNotFoundError, ImportError) as err:
        pytest.skip(f"SmolLM2-135M-Instruct is not available: {err}")


def test_smollm2_half_layers_on_disk(tmp_path):
    folder = smollm2_folder()
    config = transformers.AutoConfig.from_pretrained(folder)
    prompt = torch.tensor([[1, 9690, 314, 253, 3575, 282, 4649, 47, 2]])
    with init_empty_weights():
        plain = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    plain = load_checkpoint_and_dispatch(plain, folder, device_map={"": "cpu"})
    with torch.no_grad():
        logits = plain(prompt).logits
        tokens = plain.generate(prompt, max_new_tokens=3, do_sample=False)
    del plain

    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    device_map = half_on_disk(config.num_hidden_layers)
    model = load_checkpoint_and_dispatch(model, folder, device_map=device_map, offload_folder=tmp_path)
    assert model.hf_device_map == device_map
    assert model.model.layers[-1].mlp.up_proj.weight.is_meta
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, logits)
        assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False), tokens)
