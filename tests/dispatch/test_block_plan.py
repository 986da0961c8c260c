"""A block whose members put in only kept values is served in one pass (hooks/block_plan.py) from its
second forward on, and falls back to the member-by-member path as soon as anything it relies on changed."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from _offloaded_llama import IDS, dispatched, folder, reference  # noqa: F401  (fixtures)
from torch import nn

from bigmodel.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from bigmodel.hooks import members as members_module
from bigmodel.hooks.forward import HookedForward
from bigmodel.utils import align_module_device, has_offloaded_params

BLOCK = "model.layers.1"


@pytest.fixture
def model(folder: Path, tmp_path: Path) -> nn.Module:
    return dispatched(folder, tmp_path)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the plan's fast passes in and back, and the member-by-member passes, of every block."""
    counts = {"planned": 0, "one by one": 0, "planned back": 0}
    put_in, put_back, bypass = members_module.put_in_plan, members_module.put_back_plan, members_module.bypass_members

    def counting_put_in(plan, grad):
        taken = put_in(plan, grad)
        counts["planned"] += taken is not None
        return taken

    def counting_put_back(taken):
        done = put_back(taken)
        counts["planned back"] += done
        return done

    def counting_bypass(members, split, plans=None):
        counts["one by one"] += 1
        return bypass(members, split, plans)

    monkeypatch.setattr(members_module, "put_in_plan", counting_put_in)
    monkeypatch.setattr(members_module, "put_back_plan", counting_put_back)
    monkeypatch.setattr(members_module, "bypass_members", counting_bypass)
    return counts


def _placeholders_back(block: nn.Module) -> None:
    for name, param in block.named_parameters():
        assert param.is_meta, name
    for name, sub in block.named_modules():
        if name and "_hf_hook" in sub.__dict__:
            assert type(sub.__dict__.get("forward")) is HookedForward, name


def test_blocks_are_served_by_their_plan_from_the_second_forward(model, reference, calls):
    with torch.no_grad():
        expected = reference(IDS).logits
        torch.testing.assert_close(model(IDS).logits, expected)
        assert calls == {"planned": 0, "one by one": 4, "planned back": 0}  # 4 blocks (2 resident, 2 on disk)
        for _ in range(2):
            torch.testing.assert_close(model(IDS).logits, expected)
    assert calls == {"planned": 8, "one by one": 4, "planned back": 8}
    _placeholders_back(model.get_submodule(BLOCK))


def test_a_member_hook_removed_between_forwards_ends_the_plan(model, reference, calls):
    with torch.no_grad():
        expected = reference(IDS).logits
        model(IDS)
        model(IDS)
        q_proj = model.get_submodule(BLOCK).self_attn.q_proj
        remove_hook_from_module(q_proj)  # its weights are put back in memory, its forward is plain again
        assert not q_proj.weight.is_meta
        planned = calls["planned"]
        torch.testing.assert_close(model(IDS).logits, expected)
        assert calls["planned"] == planned + 3  # the 3 other blocks; this one took its members one by one
        torch.testing.assert_close(model(IDS).logits, expected)
    assert "forward" not in q_proj.__dict__ and not q_proj.weight.is_meta


def test_a_hook_appended_to_a_member_runs(model, reference, calls):
    seen = []

    class Recording(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(module.weight.is_meta)
            return args, kwargs

    with torch.no_grad():
        expected = reference(IDS).logits
        model(IDS)
        model(IDS)
        up_proj = model.get_submodule(BLOCK).mlp.up_proj
        add_hook_to_module(up_proj, Recording(), append=True)
        torch.testing.assert_close(model(IDS).logits, expected)
        torch.testing.assert_close(model(IDS).logits, expected)
    assert seen == [False, False]  # it ran at each forward, after the offloading hook put the weight in


def test_a_forward_that_raises_puts_everything_back(model, reference, calls):
    block = model.get_submodule(BLOCK)
    with torch.no_grad():
        expected = reference(IDS).logits
        model(IDS)
        model(IDS)

        def fail(module, args):
            raise RuntimeError("boom")

        handle = block.mlp.down_proj.register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="boom"):
            model(IDS)
        handle.remove()
        _placeholders_back(block)
        assert calls["planned back"] == calls["planned"]  # the raising block too (through forward_failed)
        torch.testing.assert_close(model(IDS).logits, expected)
    _placeholders_back(block)


def test_a_value_changed_in_the_weights_map_is_used(model, reference, calls):
    block = model.get_submodule(BLOCK)
    hook = block.mlp.gate_proj._hf_hook
    with torch.no_grad():
        model(IDS)
        model(IDS)
        loader = hook.weights_map.dataset
        key = hook.weights_map.prefix + "weight"
        loader.state_dict[key] = loader[key] * 2  # what writing an offloaded value does
        reference.get_submodule(BLOCK).mlp.gate_proj.weight.mul_(2)
        try:
            torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)
            torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)
        finally:
            reference.get_submodule(BLOCK).mlp.gate_proj.weight.div_(2)


def test_a_changed_execution_device_ends_the_plan(folder, tmp_path, reference, calls, monkeypatch):
    # A member whose hook now computes elsewhere ("meta" stands in for an accelerator) gets its value
    # there, as accelerate's hook puts it on hook.execution_device at each forward.  Without prefetching
    # (which stages values for a hook computing off the CPU) the plan would put the kept CPU values in.
    monkeypatch.setenv("BIGMODEL_PREFETCH_DEPTH", "0")
    model = dispatched(folder, tmp_path)
    block = model.get_submodule(BLOCK)
    assert block._hf_hook.prefetcher is None
    hidden = torch.randn(1, 5, 32)
    position = torch.arange(5)[None]
    with torch.no_grad():
        rotary = model.model.rotary_emb(hidden, position)
        expected = block(hidden, position_embeddings=rotary, position_ids=position)
        expected = expected[0] if isinstance(expected, tuple) else expected
        for _ in range(2):
            model(IDS)
        planned = calls["planned"]
        hooks = [block._hf_hook] + [hook for _, hook in block._hf_hook.members]
        for hook in hooks:
            hook.execution_device = "meta"
        out = block(hidden, position_embeddings=rotary, position_ids=position)
        assert (out[0] if isinstance(out, tuple) else out).device.type == "meta"
        assert calls["planned"] == planned
        for hook in hooks:
            hook.execution_device = "cpu"
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)
    _placeholders_back(block)


def test_members_whose_offloading_was_turned_back_on_are_loaded_again(model, reference):
    # vllm-project/compressed-tensors' align_modules (used by llm-compressor's sequential pipelines): each
    # module of a block is put in with align_module_device and its hook's offload set to False while the
    # model runs, then set back.  A plan made meanwhile (no member offloading) must not serve the block
    # once they offload again: before, the next forwards ran the members with meta placeholders, each op
    # loading the weight on its own (a warning suggesting preload_module_classes).
    block = model.get_submodule(BLOCK)
    seen = []
    handle = block.mlp.up_proj.register_forward_pre_hook(lambda module, args: seen.append(module.weight.is_meta))
    with torch.no_grad():
        expected = reference(IDS).logits
        with contextlib.ExitStack() as stack:
            for module in block.modules():
                if has_offloaded_params(module):
                    stack.enter_context(align_module_device(module))
                    module._hf_hook.offload = False
                    stack.callback(setattr, module._hf_hook, "offload", True)
            for _ in range(2):
                torch.testing.assert_close(model(IDS).logits, expected)
        for _ in range(2):
            torch.testing.assert_close(model(IDS).logits, expected)
    handle.remove()
    assert seen == [False] * 4
    _placeholders_back(block)
