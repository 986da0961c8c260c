"""The warning given for a device move of a dispatched model (nothing offloaded) says what is true.

accelerate 1.15 warns "You shouldn't move a model that is dispatched using accelerate hooks." for
every move of a dispatched model; bigmodel warns too, and its text must hold for a one-device
dispatch with ``force_hooks=True`` (it used to claim the model was dispatched over several devices).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from bigmodel import dispatch_model


def test_moving_a_model_dispatched_on_one_device_warns_without_claiming_several(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    dispatch_model(model, {"": "cpu"}, force_hooks=True)
    with caplog.at_level(logging.WARNING, logger="bigmodel"):
        assert model.to("cpu") is model
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1, messages
    assert "several devices" not in messages[0]
    assert ".to()" in messages[0] and "hooks" in messages[0] and "'cpu'" in messages[0]
    assert torch.equal(model(x), expected)


def test_the_move_warning_opens_with_the_incumbents_words(caplog):
    """Code matches accelerate's warning by its text (log scanners, ``"you shouldn't move a model that is
    dispatched"``); bigmodel's opens with the same sentence, its explanation follows."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    dispatch_model(model, {"0": "cpu", "1": "cpu"}, force_hooks=True)
    with caplog.at_level(logging.WARNING, logger="bigmodel"):
        model.to("cpu")
    [message] = [record.getMessage() for record in caplog.records]
    assert message.startswith("You shouldn't move a model that is dispatched using accelerate hooks. ")


def test_no_warning_once_other_code_removed_the_hooks(caplog):
    """peft's ``PeftModel.from_pretrained`` removes the hooks with accelerate's ``remove_hook_from_submodules``,
    then moves the model as accelerate's ``dispatch_model`` does: no hook moves inputs any more, the warning
    (which named "execution devices (none)") would be false."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    dispatch_model(model, {"": "cpu"}, force_hooks=True)
    hooks.remove_hook_from_submodules(model)
    with caplog.at_level(logging.WARNING, logger="bigmodel"):
        assert model.to("cpu") is model
    assert [record.getMessage() for record in caplog.records] == []
    assert torch.equal(model(x), expected)
