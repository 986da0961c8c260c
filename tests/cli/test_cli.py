"""The ``bigmodel`` command line: real commands in a subprocess on a tiny model and on 405B / MoE configs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from _tiny_hf import LAYERS, copy_without_tokenizer, write_tiny_llama  # noqa: E402

import bigmodel  # noqa: E402
from bigmodel.cli._format import human_bytes  # noqa: E402
from bigmodel.cli.main import main  # noqa: E402
from bigmodel.core.tensors import device_of  # noqa: E402
from bigmodel.integrations.hf import empty_model  # noqa: E402

DATA = Path(__file__).parents[1] / "data"
LLAMA_405B = DATA / "llama-3.1-405b"
MIXTRAL = DATA / "mixtral-8x22b"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BIGMODEL_DEBUG": ""}
    return subprocess.run(
        [sys.executable, "-m", "bigmodel.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Rows of the device table, keyed by their first cell."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("device "))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells
    return rows


def test_generate_plan_json_round_trip_with_disk_and_check(tiny: Path, tmp_path: Path, capsys) -> None:
    assert main(["plan", str(tiny), "--max-memory", "cpu=60KB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "disk" in plan.values() and "cpu" in plan.values()
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps(plan))

    result = run_cli(
        "generate", str(tiny), "--prompt", "w1 w2 w3", "--max-new-tokens", "4",
        "--device-map", str(map_file), "--offload-folder", str(tmp_path / "offload"), "--check", "--threads", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert set(rows) == {"cpu", "disk", "total"}
    assert int(rows["total"][-2]) == LAYERS  # layers column
    assert "generated  4 tokens in" in result.stdout and "tokens/s" in result.stdout
    assert "peak RSS" in result.stdout and "load time" in result.stdout
    answer = result.stdout.split("prompt     w1 w2 w3\n\n")[1].splitlines()[0].split()
    assert len(answer) == 4 and all(word.startswith("w") for word in answer)
    assert "vs the model loaded whole in memory: identical" in result.stdout
    assert (tmp_path / "offload" / "index.json").is_file() or any((tmp_path / "offload").iterdir())


def test_generate_without_offload_folder_uses_a_temporary_one(tiny: Path) -> None:
    result = run_cli("generate", str(tiny), "--prompt", "w1 w2", "--max-new-tokens", "2", "--max-memory", "cpu=60KB")
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert int(rows["disk"][-3].replace(",", "")) > 0 and int(rows["total"][-2]) == LAYERS
    match = re.search(r"No --offload-folder: offloading [\d,]+ bytes to the temporary folder (\S+) \(removed at exit\)",
                      result.stderr)  # fmt: skip
    assert match, result.stderr
    assert not Path(match.group(1)).exists()
    answer = result.stdout.split("prompt     w1 w2\n\n")[1].splitlines()[0].split()
    assert len(answer) == 2 and all(word.startswith("w") for word in answer)


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_generate_reports_the_bytes_quantized_offload_stores(form: str, tiny: Path, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "offload"
    argv = ["generate", str(tiny), "--prompt", "w1", "--max-new-tokens", "2", "--max-memory", "cpu=60KB"]
    assert main([*argv, "--offload-folder", str(folder), "--offload-quantization", form]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows["disk"][-3:] == ["156,832", "4", "40"]  # planned float32 bytes, layers, tensors: as without quantization
    index = json.loads((folder / "index.json").read_text())
    quantized = {name: entry for name, entry in index.items() if "quantization" in entry}
    written = sum(file.stat().st_size for name in quantized for file in folder.glob(f"{name}*.dat"))
    as_float32 = sum(4 * entry["shape"][0] * entry["shape"][1] for entry in quantized.values())
    stored = 156_832 - as_float32 + written  # norms stay float32
    assert len(quantized) == 29 and written < as_float32 / 3
    note = (f"disk stores {human_bytes(stored)} ({stored:,} bytes) with --offload-quantization: 29 Linear weights as "
            f"{form} + {'scales and zero points' if form == 'int4' else 'scales'}, which 'planned' counts in float32.")  # fmt: skip
    assert f"\n\n{note}\n\n" in out
    assert main([*argv, "--offload-folder", str(tmp_path / "plain")]) == 0
    assert "disk stores" not in capsys.readouterr().out


def test_plan_shows_every_budgeted_device(tiny: Path, capsys) -> None:
    assert main(["plan", str(tiny), "--max-memory", "0=1KB", "cpu=60KB", "disk=1GB"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == ["0", "cpu", "disk", "total"]
    assert rows["0"][-3:] == ["0", "0", "0"]  # bytes, layers, tensors: budgeted but left empty


def test_estimate_and_plan_count_the_same_bytes(tiny: Path, capsys) -> None:
    assert main(["estimate", str(tiny), "--dtype", "bf16", "fp8"]) == 0
    out = capsys.readouterr().out
    estimated = {line.split()[0]: int(line.split()[3].replace(",", "")) for line in out.splitlines()
                 if line.startswith(("bfloat16 ", "float8_e4m3fn "))}  # fmt: skip
    assert "total: every parameter and buffer (tied weights once)" in out
    params = int(re.search(r"parameters\s+([\d,]+)", out).group(1).replace(",", ""))
    buffers = int(re.search(r"buffers\s+([\d,]+) elements", out).group(1).replace(",", ""))
    assert estimated["float8_e4m3fn"] == params + buffers  # 1 byte per element, the rotary buffers included
    assert main(["plan", str(tiny), "--dtype", "bf16"]) == 0
    planned = int(table_rows(capsys.readouterr().out)["total"][-3].replace(",", ""))
    assert planned == estimated["bfloat16"] == 2 * (params + buffers)  # float32 rotary buffers counted as planned


def test_plan_405b_json_respects_budgets(capsys) -> None:
    budgets = {"cpu": 200 * 10**9, "disk": 700 * 10**9}
    assert main(["plan", str(LLAMA_405B), "--max-memory", "cpu=200GB", "disk=700GB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    model = empty_model(LLAMA_405B)
    sizes = bigmodel.compute_module_sizes(model)
    used: dict[str, int] = {}
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        device = device_of(name, plan)
        used[device] = used.get(device, 0) + sizes[name]
    assert sum(used.values()) == sizes[""] > 800 * 10**9  # bf16: 811.7 GB, every tensor placed
    assert set(used) == {"cpu", "disk"}
    for device, nbytes in used.items():
        assert nbytes <= budgets[device], device
    assert used["cpu"] > 150 * 10**9  # the cpu budget is used, not skipped


def test_plan_moe_table_respects_budgets(capsys) -> None:
    assert main(["plan", str(MIXTRAL), "--max-memory", "cpu=100GiB", "disk=300GB"]) == 0
    rows = table_rows(capsys.readouterr().out)
    cpu_bytes, disk_bytes = int(rows["cpu"][-3].replace(",", "")), int(rows["disk"][-3].replace(",", ""))
    assert cpu_bytes <= 100 * 2**30 and disk_bytes <= 300 * 10**9
    assert cpu_bytes + disk_bytes == int(rows["total"][-3].replace(",", "")) > 280 * 10**9  # 140.6B params in bf16
    assert int(rows["cpu"][-2]) + int(rows["disk"][-2]) == int(rows["total"][-2]) == 56


def test_estimate_405b_sizes_per_dtype(capsys) -> None:
    assert main(["estimate", str(LLAMA_405B)]) == 0
    out = capsys.readouterr().out
    assert "parameters    405,853,388,800" in out
    assert "126 x LlamaDecoderLayer" in out and "config dtype  bfloat16" in out
    dtypes = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int4")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(dtypes)}
    params = 405_853_388_800
    assert int(rows["float32"][3].replace(",", "")) >= 4 * params
    assert int(rows["bfloat16"][3].replace(",", "")) >= 2 * params
    assert int(rows["float8_e4m3fn"][3].replace(",", "")) >= params
    assert params // 2 <= int(rows["int4"][3].replace(",", "")) < params
    assert rows["bfloat16"][-1] == "model.layers.0"


def test_unknown_dtype_in_a_subprocess_is_one_line_exit_2(tiny: Path) -> None:
    result = run_cli("generate", str(tiny), "--prompt", "w1", "--dtype", "float13")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("bigmodel: error: Unknown dtype 'float13'") and "bfloat16" in last


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-config", r"No config\.json in .*; pass a Hugging Face model folder"),
        ("no-tokenizer", r"has no tokenizer .* save one there with tokenizer\.save_pretrained"),
        ("tiny-budget", r"with the budgets \{'cpu': 1,000, 'disk': 1,000\} .* Raise the \"disk\" budget"),
        ("no-layer-fits", r"too small for even one layer outside disk and no --offload-folder .* pass --offload-folder"),
        ("all-disk-map-file", r"The device map file '.*all-disk\.json' puts the whole model on disk and no "
                              r"--offload-folder was given; pass --offload-folder DIR"),
        ("bad-budget", r"--max-memory item 'cpu' is not DEVICE=SIZE; write e\.g\. cpu=2GiB"),
        ("plan-no-config", r"No config\.json in"),
    ],
)
def test_bad_input_is_one_line_exit_2(case: str, message: str, tiny: Path, tmp_path: Path, capsys) -> None:
    argv = {
        "no-config": ["generate", str(tmp_path), "--prompt", "hi"],
        "no-tokenizer": ["generate", str(copy_without_tokenizer(tiny, tmp_path / "m")), "--prompt", "w1"],
        "tiny-budget": ["generate", str(tiny), "--prompt", "w1", "--max-memory", "cpu=1KB", "disk=1KB"],
        "no-layer-fits": ["generate", str(tiny), "--prompt", "w1", "--max-memory", "cpu=1KB"],
        "all-disk-map-file": ["generate", str(tiny), "--prompt", "w1", "--device-map", str(_write(tmp_path / "all-disk.json",
                                                                                                  '{"": "disk"}'))],
        "bad-budget": ["plan", str(tiny), "--max-memory", "cpu"],
        "plan-no-config": ["plan", str(tmp_path)],
    }[case]
    assert main(argv) == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("bigmodel: error: ")
    assert captured.out == ""  # nothing half-done on stdout
    assert re.search(message, last), last


def test_no_subcommand_prints_help_exit_2(capsys) -> None:
    assert main([]) == 2
    assert "generate" in capsys.readouterr().err


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_check_with_quantized_offload_judges_the_greedy_predictions(tiny: Path, tmp_path: Path, capsys) -> None:
    """Quantized disk layers change the logits by design: --check then passes when every position's greedy
    next token is the model's in memory (it exited 1 on any logit difference)."""
    argv = ["generate", str(tiny), "--prompt", "w1", "--max-new-tokens", "2", "--max-memory", "cpu=60KB",
            "--offload-folder", str(tmp_path / "offload"), "--check"]  # fmt: skip
    status = main([*argv, "--offload-quantization", "int8"])
    out = capsys.readouterr().out
    check = out.split("\ncheck      ")[1]
    positions = int(re.search(r"logits over (\d+) tokens", check).group(1))
    assert "DIFFERENT (max |diff|" in check.splitlines()[0]  # int8 weights: the logits move
    same = int(re.search(r"the same at (\d+) of (\d+) positions", check).group(1))
    assert f"of {positions} positions" in check and same == positions and status == 0
    assert main(argv) == 0 and "identical" in capsys.readouterr().out  # unquantized: bit for bit, as before
