"""Differential harness: an offloaded model must behave exactly like the plain one (helper, not a test module).

A *run* takes a model of the zoo (:mod:`_differential_models`), makes two copies of it,
applies an offload *path* to one (the other gets only the path's reference steps: the
same layerwise casting, a plain checkpoint load), then applies the same *operations* to
both and compares what each operation observes, exactly (tensors bit for bit, dtypes,
names, flags; an exception must be one of the same type on both sides).

Paths (:data:`PATHS`, each a sequence of :data:`STEPS`):

- ``dispatch_block`` / ``dispatch_leaf``: ``dispatch_model`` over cpu + disk, one map entry
  per block (no-split class) / per leaf module, each entry drawn cpu or disk (at least one
  disk), ``offload_buffers`` drawn;
- ``dispatch_auto``: ``infer_auto_device_map`` with a drawn CPU budget, then dispatch;
- ``cpu_offload``, ``disk_offload`` (``offload_buffers`` drawn), ``cpu_offload_with_hook``;
- ``casting``: ``attach_layerwise_casting_hooks`` (fp8 or bf16 storage, fp32 compute), on
  both sides;
- ``load_dispatch`` / ``load_dispatch_bf16``: the model saved as safetensors, built again
  under ``init_empty_weights`` and loaded with ``load_checkpoint_and_dispatch`` (drawn map,
  fp32 / ``dtype=torch.bfloat16``); the reference loads the same file with
  ``load_checkpoint_in_model`` and no map;
- compositions: casting before/after each offload, offloading again with another function,
  dispatching a dispatched model again.

Operations (:data:`OPERATIONS`): ``forward`` (no_grad), ``generate`` (greedy), ``state_dict``
(keys, dtypes, shapes; values through ``get_state_dict_offloaded_model``), ``named_parameters``
(names, dtypes, shapes, requires_grad, duplicates), ``named_buffers``, ``tied_parameters``,
``signature`` (``inspect.signature`` of every module's forward), ``backward``,
``freeze`` (``requires_grad_(False)`` then a grad-enabled forward), ``freeze_half``,
``unfreeze``, ``train`` / ``eval`` (modes, a seeded forward with dropout, BatchNorm stats),
``inference_then_grad`` (a forward under ``inference_mode`` then one with autograd),
``deepcopy`` (the copy runs alone: the original's weights are replaced and dropped),
``to_float64``, ``double``, ``to_bfloat16``, ``to_channels_last``, ``compile``
(``torch.compile``, eager backend) and ``remove_hooks`` (``remove_hook_from_submodules``:
no hook attribute left, every value back).

Adding an operation is one entry in :data:`OPERATIONS`; an operation or path that trips a
bug not fixed yet is one entry in :data:`KNOWN_BUGS` (a strict xfail runs its witness).
"""

from __future__ import annotations

import copy
import gc
import inspect
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _differential_models import MODELS_BY_NAME, ModelCase, output_tensor
from _differential_paths import PATHS_BY_NAME, Choices, OffloadPath, apply_path
from torch import nn

import bigmodel

SEED = 1234


@dataclass
class Subject:
    """One side of a run: the model and how to call it."""

    case: ModelCase
    model: nn.Module

    def inputs(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        values = self.case.inputs()
        if dtype is not None:
            values = {k: v.to(dtype) if v.is_floating_point() else v for k, v in values.items()}
        return values

    def forward(self, module: Any = None, dtype: torch.dtype | None = None, **extra: Any) -> torch.Tensor:
        torch.manual_seed(SEED)  # dropout draws the same masks on both sides
        return output_tensor((module or self.model)(**self.inputs(dtype), **extra))

    def float_dtype(self) -> torch.dtype:
        """The dtype floating inputs get: the model's first floating parameter's."""
        for param in self.model.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.float32


# --- what observations are made of -------------------------------------------------------


@dataclass(frozen=True)
class Raised:
    """An operation raised: both sides must raise the same exception type."""

    kind: str
    text: str = field(compare=False)


@dataclass(frozen=True)
class Direct:
    """A tensor read straight off the model: the offloaded side may hold a ``meta`` placeholder
    (then only its dtype and shape are compared)."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class Grad:
    """A parameter's gradient: compared when the parameter is held in memory on both sides
    (an offloaded parameter's forward copy is dropped after the forward, its gradient with it)."""

    offloaded: bool
    grad: torch.Tensor | None


def compare(ref: Any, off: Any, where: str) -> None:
    """Assert that two observations are identical (tensors bit for bit); messages name ``where``."""
    if isinstance(ref, Raised) or isinstance(off, Raised):
        if isinstance(ref, Raised) and isinstance(off, Raised) and ref.kind == off.kind:
            return
        side, raised = ("offloaded", off) if isinstance(off, Raised) else ("reference", ref)
        raise AssertionError(f"{where}: only the {side} model raised:\n{raised.text}")
    if isinstance(ref, Grad):
        if not (ref.offloaded or off.offloaded):
            compare(ref.grad, off.grad, where)
        return
    if isinstance(ref, Direct):
        _compare_tensor(ref.tensor, off.tensor, where, meta_ok=True)
        return
    if isinstance(ref, torch.Tensor):
        assert isinstance(off, torch.Tensor), f"{where}: tensor vs {type(off).__name__}"
        _compare_tensor(ref, off, where, meta_ok=False)
        return
    if isinstance(ref, dict):
        assert isinstance(off, dict), f"{where}: dict vs {type(off).__name__}"
        assert list(ref) == list(off), f"{where}: keys differ: {_diff(list(ref), list(off))}"
        for key in ref:
            compare(ref[key], off[key], f"{where}[{key!r}]")
        return
    if isinstance(ref, (list, tuple)):
        assert type(ref) is type(off) and len(ref) == len(off), f"{where}: {_short(ref)} vs {_short(off)}"
        for i, (a, b) in enumerate(zip(ref, off)):
            compare(a, b, f"{where}[{i}]")
        return
    assert ref == off, f"{where}: {ref!r} (reference) vs {off!r} (offloaded)"


def _compare_tensor(ref: torch.Tensor, off: torch.Tensor, where: str, meta_ok: bool) -> None:
    assert (ref.dtype, ref.shape) == (off.dtype, off.shape), (
        f"{where}: {ref.dtype} {list(ref.shape)} (reference) vs {off.dtype} {list(off.shape)} (offloaded)"
    )
    if off.is_meta and meta_ok:
        return
    assert not off.is_meta and not ref.is_meta, f"{where}: a meta tensor where values are expected"
    assert ref.requires_grad == off.requires_grad, f"{where}: requires_grad {ref.requires_grad} vs {off.requires_grad}"
    a, b = ref.detach().cpu(), off.detach().cpu()
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "n/a"
        raise AssertionError(f"{where}: values differ (max abs diff {diff})")


def _diff(a: list, b: list) -> str:
    return f"only reference {sorted(set(a) - set(b))[:5]}, only offloaded {sorted(set(b) - set(a))[:5]}, order differs"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 200 else text[:200] + "..."


# --- the operations ------------------------------------------------------------------------


def _forward(s: Subject) -> Any:
    with torch.no_grad():
        return s.forward(dtype=s.float_dtype())


def _generate(s: Subject) -> Any:
    inputs = {k: v for k, v in s.inputs().items() if k != "decoder_input_ids"}
    return s.model.generate(**inputs, max_new_tokens=3, do_sample=False)


def _state_dict(s: Subject) -> Any:
    state = s.model.state_dict()
    return {
        "direct": {k: Direct(v) for k, v in state.items()},
        "values": bigmodel.get_state_dict_offloaded_model(s.model),
    }


def _named_parameters(s: Subject) -> Any:
    params = s.model.named_parameters(remove_duplicate=False)
    return {n: (Direct(p), isinstance(p, nn.Parameter), p.requires_grad) for n, p in params}


def _named_buffers(s: Subject) -> Any:
    return {n: Direct(b) for n, b in s.model.named_buffers(remove_duplicate=False)}


def _tied_parameters(s: Subject) -> Any:
    return bigmodel.find_tied_parameters(s.model)


def _signature(s: Subject) -> Any:
    return {name: str(inspect.signature(m.forward)) for name, m in s.model.named_modules()}


def _backward_observation(s: Subject) -> Any:
    """A grad-enabled forward, then backward of a scalar loss; gradients of inputs and parameters."""
    inputs = s.inputs(s.float_dtype())
    leaves = {k: v.requires_grad_() for k, v in inputs.items() if v.is_floating_point()}
    torch.manual_seed(SEED)
    out = output_tensor(s.model(**inputs))
    observed: dict[str, Any] = {"out": out, "requires_grad": out.requires_grad}
    if out.requires_grad:
        out.float().square().mean().backward()
    observed["input_grads"] = {k: v.grad for k, v in leaves.items()}
    observed["grads"] = {n: Grad(p.is_meta, p.grad) for n, p in s.model.named_parameters()}
    s.model.zero_grad(set_to_none=True)
    return observed


def _freeze(s: Subject) -> Any:
    s.model.requires_grad_(False)
    return _backward_observation(s)


def _freeze_half(s: Subject) -> Any:
    params = list(s.model.parameters())
    for param in params[: len(params) // 2]:
        param.requires_grad_(False)
    return _backward_observation(s)


def _unfreeze(s: Subject) -> Any:
    s.model.requires_grad_(True)
    return _backward_observation(s)


def _modes_and_forward(s: Subject, train: bool) -> Any:
    s.model.train(train)
    modes = [m.training for m in s.model.modules()]
    with torch.no_grad():
        out = s.forward(dtype=s.float_dtype())
    state = bigmodel.get_state_dict_offloaded_model(s.model)
    return {"modes": modes, "out": out, "buffers": {n: state[n] for n, _ in s.model.named_buffers() if n in state}}


def _inference_then_grad(s: Subject) -> Any:
    with torch.inference_mode():
        first = s.forward(dtype=s.float_dtype())
    return {"inference": first.clone(), "then": _backward_observation(s)}


def _deepcopy(s: Subject) -> Any:
    original = s.model
    s.model = copy.deepcopy(original)
    for module in original.modules():  # the copy must not run with the original's weights
        for name, param in list(module._parameters.items()):
            if param is not None and not param.is_meta:
                module._parameters[name] = nn.Parameter(torch.full_like(param, 7.0), param.requires_grad)
    del original, module
    gc.collect()
    return _forward(s)


def _cast(method: Callable[[nn.Module], nn.Module]) -> Callable[[Subject], Any]:
    def run(s: Subject) -> Any:
        s.model = method(s.model)
        return {"dtypes": sorted({str(p.dtype) for p in s.model.parameters()}), "out": _forward(s)}

    return run


def _compile(s: Subject) -> Any:
    compiled = torch.compile(s.model, backend="eager", dynamic=False)
    with torch.no_grad():
        return s.forward(compiled, dtype=s.float_dtype())


_HOOK_ATTRIBUTES = ("_hf_hook", "_old_forward", "_bigmodel_patches", "_apply", "_bigmodel_tied_params")


def _remove_hooks(s: Subject) -> Any:
    bigmodel.remove_hook_from_submodules(s.model)
    left = {name: sorted(a for a in (*_HOOK_ATTRIBUTES, "forward") if a in m.__dict__)
            for name, m in s.model.named_modules()}
    return {"left": {k: v for k, v in left.items() if v}, "state": s.model.state_dict(), "out": _forward(s)}


@dataclass(frozen=True)
class Operation:
    """One thing a user or library does to a model; ``run`` returns what it observes."""

    name: str
    run: Callable[[Subject], Any]
    applies: Callable[[ModelCase], bool] = lambda case: True


OPERATIONS: tuple[Operation, ...] = (
    Operation("forward", _forward),
    Operation("generate", _generate, lambda case: case.generates),
    Operation("state_dict", _state_dict),
    Operation("named_parameters", _named_parameters),
    Operation("named_buffers", _named_buffers),
    Operation("tied_parameters", _tied_parameters),
    Operation("signature", _signature),
    Operation("backward", _backward_observation),
    Operation("freeze", _freeze),
    Operation("freeze_half", _freeze_half),
    Operation("unfreeze", _unfreeze),
    Operation("train", lambda s: _modes_and_forward(s, True)),
    Operation("eval", lambda s: _modes_and_forward(s, False)),
    Operation("inference_then_grad", _inference_then_grad),
    Operation("deepcopy", _deepcopy),
    Operation("to_float64", _cast(lambda m: m.to(torch.float64))),
    Operation("double", _cast(lambda m: m.double())),
    Operation("to_bfloat16", _cast(lambda m: m.to(torch.bfloat16))),
    Operation("to_channels_last", _cast(lambda m: m.to(memory_format=torch.channels_last))),
    Operation("compile", _compile),
    Operation("remove_hooks", _remove_hooks),
)
OPERATIONS_BY_NAME = {op.name: op for op in OPERATIONS}


# --- known bugs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownBug:
    """An operation or path that still trips a bug of issue 12 not fixed yet.

    Runs that match ``matches(case, path, operation)`` are not drawn; the witness run
    (case, path, operations) is a strict xfail: it fails now, and its passing says the entry
    can go.
    """

    bullet: str
    matches: Callable[[str, str, str], bool]
    witness: tuple[str, str, tuple[str, ...]]


KNOWN_BUGS: tuple[KnownBug, ...] = ()


def known_bug(case: str, path: str, op: str) -> KnownBug | None:
    return next((bug for bug in KNOWN_BUGS if bug.matches(case, path, op)), None)


# --- a run -------------------------------------------------------------------------------------


_BASES: dict[str, nn.Module] = {}


def base_model(case: ModelCase) -> nn.Module:
    """The plain model of ``case``, built once per process (runs take deep copies)."""
    if case.name not in _BASES:
        _BASES[case.name] = case.build()
    return _BASES[case.name]


def _observe(op: Operation, subject: Subject) -> Any:
    torch.manual_seed(SEED)
    try:
        return op.run(subject)
    except Exception as err:  # the other side must raise the same type
        return Raised(type(err).__name__, "".join(traceback.format_exception(err)))


def run_differential(case_name: str, path_name: str, op_names: list[str], choices: Choices) -> None:
    """Apply path ``path_name`` to ``case_name``'s model and compare it with the plain one under ``op_names``.

    Raises:
        AssertionError: an observation differs; the message names the case, the path with
            its drawn choices (device map ...), the operations so far and what differs.
    """
    case, path = MODELS_BY_NAME[case_name], PATHS_BY_NAME[path_name]
    with tempfile.TemporaryDirectory(prefix="bigmodel-differential-") as tmp:
        reference = Subject(case, copy.deepcopy(base_model(case)))
        offloaded = Subject(case, copy.deepcopy(base_model(case)))
        reference.model, offloaded.model = apply_path(path, reference.model, offloaded.model, case, choices, Path(tmp))
        done: list[str] = []
        for name in op_names:
            op = OPERATIONS_BY_NAME[name]
            done.append(name)
            where = f"{case.name} / {path.name} {choices.log} / {' -> '.join(done)}"
            compare(_observe(op, reference), _observe(op, offloaded), where)
        del reference, offloaded
        gc.collect()


def applicable(case: ModelCase, path: OffloadPath) -> list[str]:
    """The operations a run of ``path`` on ``case`` may draw (known bugs left out)."""
    return [op.name for op in OPERATIONS
            if op.applies(case) and known_bug(case.name, path.name, op.name) is None]
