"""Every API.md name resolves from bigmodel and from each compatibility path."""

import importlib
import subprocess
import sys

import pytest

import bigmodel
from bigmodel._exports import EXPORTS

COMPAT = [
    "bigmodel.big_modeling",
    "bigmodel.hooks",
    "bigmodel.utils",
    "bigmodel.utils.modeling",
    "bigmodel.utils.offload",
    "bigmodel.utils.constants",
    "bigmodel.utils.other",
]


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_top_level_name_resolves(name):
    assert getattr(bigmodel, name) is not None


@pytest.mark.parametrize("path", COMPAT)
def test_compat_paths_resolve_to_the_same_objects(path):
    module = importlib.import_module(path)
    assert module.__all__
    for name in module.__all__:
        assert getattr(module, name) is getattr(bigmodel, name), (path, name)


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        bigmodel.nope  # noqa: B018


def test_package_never_imports_accelerate():
    code = (
        "import sys, bigmodel\n"
        "[getattr(bigmodel, n) for n in bigmodel.__all__]\n"
        "import bigmodel.cli.main\n"
        "assert 'accelerate' not in sys.modules, 'accelerate imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
