"""extract_model_from_parallel: DataParallel/DDP and torch.compile wrappers."""

from __future__ import annotations

import torch
from torch import nn

from bigmodel.utils.other import extract_model_from_parallel


def test_unwraps_data_parallel():
    inner = nn.Linear(2, 2)
    assert extract_model_from_parallel(nn.DataParallel(inner)) is inner
    assert extract_model_from_parallel(inner) is inner


def test_unwraps_compiled_model():
    inner = nn.Linear(2, 2)
    compiled = torch.compile(inner, backend="eager")
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is inner
    kept = extract_model_from_parallel(compiled)
    assert kept is compiled and kept._orig_mod is inner


def test_compiled_data_parallel_and_recursive():
    inner = nn.Linear(2, 2)
    compiled = torch.compile(nn.DataParallel(inner), backend="eager")
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is inner
    outer = nn.Sequential(nn.DataParallel(nn.Linear(2, 2)))
    extract_model_from_parallel(outer, recursive=True)
    assert type(outer[0]) is nn.Linear
