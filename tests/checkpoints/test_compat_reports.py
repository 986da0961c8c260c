"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both."""

from __future__ import annotations

import pytest
from torch import nn

from bigmodel import load_checkpoint_and_dispatch
from bigmodel.utils import load_checkpoint_in_model


@pytest.mark.parametrize("load", [load_checkpoint_in_model, load_checkpoint_and_dispatch])
def test_a_missing_checkpoint_path_is_a_value_error_as_with_accelerate(tmp_path, load):
    # accelerate 1.15 raises ValueError for a path that is neither a file nor a folder; code
    # written for it catches ValueError (a fallback to another path, a friendly message).
    missing = tmp_path / "not-downloaded"
    with pytest.raises(ValueError, match=r"not-downloaded' does not exist; "):
        load(nn.Linear(2, 2), missing, device_map={"": "cpu"})
    with pytest.raises(FileNotFoundError):  # what bigmodel raised before: still caught the same way
        load(nn.Linear(2, 2), str(missing))
