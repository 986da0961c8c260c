"""Accelerator tests: offloaded execution on a real device equals the model fully on the device.

Every test here needs an accelerator (skipped without one) and uses bigmodel's public API only,
except the first group, which checks the transfer layer (pinned memory, side-stream copies) that
the offload hooks use.  Outputs are compared with ``torch.equal``: the same kernels run on the same
device either way, only where the weights lived in between differs.

Run: ``pytest -m accelerator`` (scripts/accelerator_check.sh does it on a lent GPU machine).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bigmodel

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator (torch.accelerator)"),
]


@pytest.fixture
def device() -> torch.device:
    return torch.device(torch.accelerator.current_accelerator().type, 0)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _net(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype).eval()


def _reference(model: nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    on_device = copy.deepcopy(model).to(device)
    with torch.no_grad():
        return on_device(x.to(device))


def _inputs(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 5, 16).to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8) if tensor.is_floating_point() else tensor


# ----------------------------------------------------------------------------- transfer layer


def test_pinned_side_stream_copies_keep_dtype_and_values(device):
    from bigmodel.transfer.copies import CopyStream
    from bigmodel.transfer.pinned import pin_tensors

    tensors = {
        "bf16": torch.randn(256, 256).to(torch.bfloat16),
        "fp8": torch.randn(256, 256).to(torch.float8_e4m3fn),
        "int": torch.arange(10),
    }
    tensors["tied"] = tensors["bf16"]
    pinned = pin_tensors(tensors)
    assert all(t.is_pinned() for t in pinned.values())
    assert pinned["tied"] is pinned["bf16"]
    stream = CopyStream(device)
    pending = stream.copy(pinned)
    assert pending.event is not None
    out = pending.wait()
    for name, tensor in tensors.items():
        assert out[name].device == device and out[name].dtype == tensor.dtype
        assert torch.equal(_bits(out[name].cpu()), _bits(tensor)), name
    assert out["tied"] is out["bf16"]


def _late_copies(stream, device: torch.device) -> None:
    """Queue a sleep on the copy stream, so the next copy finishes long after it was issued."""
    if device.type == "cuda":
        with stream.stream:
            torch.cuda._sleep(10_000_000)  # about 5 ms: a 4 MiB copy takes about 0.1 ms


@pytest.mark.parametrize("late", [False, True], ids=["busy-consumer", "late-copies"])
def test_side_stream_copies_are_ordered_under_load_and_memory_reuse(device, late):
    """Many copies consumed while the compute stream is busy (a missing record_stream shows), or
    while the copies themselves run late (a missing event wait shows): no value is read early or overwritten."""
    from bigmodel.transfer.copies import CopyStream
    from bigmodel.transfer.pinned import pin_tensors

    if late and device.type != "cuda":
        pytest.skip("late copies are made with torch.cuda._sleep")
    stream = CopyStream(device)
    sources = pin_tensors({str(i): torch.full((1 << 20,), float(i)) for i in range(24)})
    busy = torch.randn(2048, 2048, device=device)
    total = torch.zeros((), device=device)
    for i in range(24):
        if late:
            _late_copies(stream, device)
        else:
            busy = busy @ busy / 2048  # keep the compute stream busy while the next copy is in flight
        weight = stream.copy({"w": sources[str(i)]}).wait()["w"]
        total += weight.sum()
        del weight  # freed right after use: the next copy may reuse its memory only after this sum
    assert total.item() == float(sum(range(24)) * (1 << 20))


def test_staging_buffer_round_trip_to_device(device):
    from bigmodel.transfer.copies import CopyStream
    from bigmodel.transfer.staging import StagingBuffer

    staging = StagingBuffer("8MiB")
    assert staging.pinned
    stream = CopyStream(device)
    outs = []
    for i in range(6):  # 6 x 4 MiB through an 8 MiB ring, each copy late: regions wait for their copies
        batch = staging.stage({"w": torch.full((1 << 20,), float(i))}, timeout=30)
        _late_copies(stream, device)
        pending = stream.copy(batch.tensors)
        batch.release(after=pending)
        outs.append(pending.wait()["w"])
    assert [int(o[0].item()) for o in outs] == list(range(6))
    assert all(torch.equal(o, torch.full_like(o, float(i))) for i, o in enumerate(outs))


# ----------------------------------------------------------------------------- dispatch and offload


def test_dispatch_over_accelerator_cpu_and_disk_equals_on_device(device, tmp_path):
    model, x = _net(), _inputs()
    expected = _reference(model, x, device)
    device_map = {"embed": 0, "blocks.0": 0, "blocks.1": "cpu", "blocks.2": "disk", "blocks.3": "cpu",
                  "head": "disk"}
    bigmodel.dispatch_model(model, device_map, offload_dir=str(tmp_path))
    assert model.hf_device_map == device_map
    with torch.no_grad():
        first, second = model(x.to(device)), model(x)  # inputs from the device and from the CPU
    assert first.device == device
    assert torch.equal(first, expected) and torch.equal(second.to(device), expected)


def test_cpu_offload_equals_on_device(device):
    model, x = _net(torch.bfloat16), _inputs(torch.bfloat16)
    expected = _reference(model, x, device)
    bigmodel.cpu_offload(model, execution_device=device)
    with torch.no_grad():
        for _ in range(2):  # the second pass runs with whatever the first pass learned (prefetch order)
            out = model(x.to(device))
            assert torch.equal(out, expected)


def test_disk_offload_equals_on_device(device, tmp_path):
    model, x = _net(torch.bfloat16), _inputs(torch.bfloat16)
    expected = _reference(model, x, device)
    bigmodel.disk_offload(model, str(tmp_path), execution_device=device)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x.to(device)), expected)


def test_cpu_offload_with_hook_chain(device):
    first, second, x = _net(), _net(), _inputs()
    torch.manual_seed(2)
    for p in second.parameters():  # a different second model
        p.data.normal_()
    with torch.no_grad():
        h = _reference(first, x, device)
        expected = _reference(second, torch.cat([h, h], -1), device)
    first, hook1 = bigmodel.cpu_offload_with_hook(first, execution_device=device)
    second, hook2 = bigmodel.cpu_offload_with_hook(second, execution_device=device, prev_module_hook=hook1)
    with torch.no_grad():
        h = first(x.to(device))
        assert next(first.parameters()).device == device  # stays until the next model runs
        out = second(torch.cat([h, h], -1))
    assert next(first.parameters()).device.type == "cpu"  # offloaded when the next model ran
    assert next(second.parameters()).device == device
    hook2.offload()
    assert next(second.parameters()).device.type == "cpu"
    assert torch.equal(out, expected)


class Fp8Linear(nn.Module):
    """Stores its weight in fp8 and upcasts inside forward; records what the forward received."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width).to(torch.float8_e4m3fn), requires_grad=False)
        self.seen: list[tuple[torch.dtype, torch.device]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.weight.dtype, self.weight.device))
        return x @ self.weight.to(x.dtype).t()


def test_offloaded_fp8_weights_cross_the_bus_as_fp8(device):
    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear(64), Fp8Linear(64)).eval()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = _reference(model, x, device)
    bigmodel.cpu_offload(model, execution_device=device)
    with torch.no_grad():
        out = model(x.to(device))
    assert torch.equal(out, expected)
    for layer in model:
        assert layer.seen[-1] == (torch.float8_e4m3fn, device)  # arrived as fp8 on the device
        assert layer.weight.dtype == torch.float8_e4m3fn


def test_layerwise_casting_keeps_fp8_storage_on_device(device):
    model = _net(torch.bfloat16).to(device)
    x = _inputs(torch.bfloat16).to(device)
    rounded = copy.deepcopy(model)
    for layer in rounded.modules():
        if isinstance(layer, nn.Linear):
            layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
            layer.bias.data = layer.bias.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
    with torch.no_grad():
        expected = rounded(x)
    bigmodel.attach_layerwise_casting_hooks(model, torch.float8_e4m3fn, torch.bfloat16)
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, expected)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight.device == device for m in linears)
    assert model.blocks[0].norm.weight.dtype == torch.bfloat16  # LayerNorm is not a casting layer


def test_load_checkpoint_and_dispatch_auto_map_with_small_budget(device, tmp_path):
    from safetensors.torch import save_file

    model, x = _net(), _inputs()
    expected = _reference(model, x, device)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with bigmodel.init_empty_weights():
        empty = Net()
    sizes = bigmodel.compute_module_sizes(empty)
    budget = {0: sizes["blocks.0"] * 3, "cpu": sizes["blocks.0"] * 2}
    empty = bigmodel.load_checkpoint_and_dispatch(
        empty, str(tmp_path), device_map="auto", max_memory=budget, offload_folder=str(tmp_path / "offload"),
        no_split_module_classes=["Block"],
    )
    placed = set(empty.hf_device_map.values())
    assert 0 in placed and ("cpu" in placed or "disk" in placed), empty.hf_device_map
    with torch.no_grad():
        assert torch.equal(empty.eval()(x.to(device)), expected)


# ----------------------------------------------------------------------------- transformers


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_generate_with_layers_on_cpu_and_disk_equals_on_device(device, tmp_path):
    model = _tiny_llama()
    reference = copy.deepcopy(model).to(device)
    ids = torch.randint(0, 256, (1, 12), device=device)
    with torch.no_grad():
        expected_logits = reference(ids).logits
        expected_tokens = reference.generate(ids, max_new_tokens=8, do_sample=False)
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": 0,
                  "model.rotary_emb": 0, "lm_head": "cpu"}
    bigmodel.dispatch_model(model, device_map, offload_dir=str(tmp_path))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(logits.to(device), expected_logits)
    assert torch.equal(tokens.to(device), expected_tokens)
