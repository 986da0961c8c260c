"""Differential tests: an offloaded model behaves exactly like the plain one.

Hypothesis draws a model of the zoo, the choices of an offload path (device map,
``offload_buffers``, storage dtype ...) and a sequence of operations; both models run the
operations and every observation must be identical (see ``tests/_differential.py`` for the
paths and operations, ``tests/_differential_models.py`` for the models).

Profiles: the fast one runs in CI (``pytest -q``), a few examples per path, derandomized so
a run is reproducible.  The long one draws many more, longer, sequences with a random seed::

    BIGMODEL_DIFFERENTIAL=long pytest -m differential_long tests/dispatch/test_differential.py

A failure prints the model, the path with its drawn choices and the operations; hypothesis
shrinks it to a short sequence first.
"""

from __future__ import annotations

import os

import pytest
from _differential import (
    KNOWN_BUGS,
    OPERATIONS,
    applicable,
    known_bug,
    run_differential,
)
from _differential_models import MODELS, MODELS_BY_NAME
from _differential_paths import PATHS, PATHS_BY_NAME, Choices
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

FAST_EXAMPLES = int(os.environ.get("BIGMODEL_DIFFERENTIAL_EXAMPLES", "4"))
LONG = os.environ.get("BIGMODEL_DIFFERENTIAL") == "long"
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _cases(path) -> list:
    return [case for case in MODELS if path.applies(case) and applicable(case, path)]


DRAWN_PATHS = [path for path in PATHS if _cases(path)]


def _run(data: st.DataObject, path, max_ops: int) -> None:
    case = data.draw(st.sampled_from(_cases(path)), label="model")
    ops = data.draw(st.lists(st.sampled_from(applicable(case, path)), min_size=1, max_size=max_ops), label="operations")
    run_differential(case.name, path.name, ops, Choices(data.draw))


@pytest.mark.slow
@pytest.mark.parametrize("path", DRAWN_PATHS, ids=str)
@settings(max_examples=FAST_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=_HEALTH)
@given(data=st.data())
def test_offloaded_model_behaves_like_the_plain_one(path, data):
    _run(data, path, max_ops=4)


@pytest.mark.slow
@pytest.mark.differential_long
@pytest.mark.skipif(not LONG, reason="the long profile runs with BIGMODEL_DIFFERENTIAL=long")
@settings(max_examples=400, deadline=None, suppress_health_check=_HEALTH)
@given(data=st.data())
def test_long_profile(data):
    _run(data, data.draw(st.sampled_from(DRAWN_PATHS), label="path"), max_ops=8)


@pytest.mark.slow
@pytest.mark.parametrize(
    "bug", [pytest.param(bug, marks=pytest.mark.xfail(strict=True, reason=bug.bullet), id="-".join(bug.witness[:2]))
            for bug in KNOWN_BUGS],
)
def test_known_bug_still_fails(bug):
    """Each known bug's witness run: it fails now; when it passes (strict xfail), drop the entry."""
    case, path, ops = bug.witness
    assert known_bug(case, path, ops[-1]) is bug
    run_differential(case, path, list(ops), Choices())


def test_every_operation_and_path_is_drawn_or_a_known_bug():
    for op in OPERATIONS:
        assert any(op.name in applicable(case, path) for case in MODELS for path in PATHS) or any(
            op.name == bug.witness[2][-1] for bug in KNOWN_BUGS), op.name
    for path in PATHS:
        assert path in DRAWN_PATHS or any(bug.witness[1] == path.name for bug in KNOWN_BUGS), path.name
    for bug in KNOWN_BUGS:
        case, path, ops = bug.witness
        assert case in MODELS_BY_NAME and path in PATHS_BY_NAME, bug.witness
