import pytest
import torch
from torch import nn

from bigmodel import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    get_max_layer_size,
    init_empty_weights,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10GiB", 10 * 2**30),
        ("500MB", 500 * 10**6),
        ("2KB", 2000),
        ("1.5GB", 1_500_000_000),
        ("1.5gb", 1_500_000_000),
        ("3kib", 3072),
        ("123", 123),
        (4096, 4096),
    ],
)
def test_convert_file_size_to_int(text, expected):
    assert convert_file_size_to_int(text) == expected


@pytest.mark.parametrize("bad", ["10 GiBs", "ten GB", "", "-5MB", -1, True])
def test_convert_file_size_to_int_rejects(bad):
    with pytest.raises(ValueError, match="memory size|negative"):
        convert_file_size_to_int(bad)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float32, 4),
        (torch.bfloat16, 2),
        (torch.float16, 2),
        (torch.float8_e4m3fn, 1),
        (torch.float8_e5m2, 1),
        (torch.int64, 8),
        (torch.bool, 1),
        (torch.complex64, 8),
        (torch.uint4, 0.5),
        (torch.int2, 0.25),
        (torch.uint1, 0.125),
        ("int4", 0.5),
        ("fp4", 0.5),
        ("bf16", 2),
        ("torch.float16", 2),
    ],
)
def test_dtype_byte_size(dtype, expected):
    assert dtype_byte_size(dtype) == expected


def test_dtype_byte_size_every_torch_dtype_is_positive():
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    for dtype in dtypes:
        assert dtype_byte_size(dtype) > 0, dtype


def test_dtype_byte_size_unknown_name():
    with pytest.raises(ValueError, match="'floaty'"):
        dtype_byte_size("floaty")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 8)  # 32 + 8 floats
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64), persistent=False)


def _model():
    model = nn.Sequential(nn.Embedding(10, 4), Block(), nn.Linear(8, 10, bias=False))
    return model


def test_compute_module_sizes_values():
    sizes = compute_module_sizes(_model())
    assert sizes["0"] == 10 * 4 * 4
    assert sizes["1.linear.weight"] == 32 * 4
    assert sizes["1.linear"] == 40 * 4
    assert sizes["1"] == 40 * 4 + 2 * 4 + 3 * 8
    assert sizes["2"] == 80 * 4
    assert sizes[""] == sizes["0"] + sizes["1"] + sizes["2"]


def test_compute_module_sizes_dtype_keeps_integers():
    sizes = compute_module_sizes(_model(), dtype=torch.float16)
    assert sizes["1"] == 40 * 2 + 2 * 2 + 3 * 8
    special = compute_module_sizes(_model(), dtype=torch.float16, special_dtypes={"2.weight": torch.float32})
    assert special["2"] == 80 * 4


def test_compute_module_sizes_ties_counted_once_and_meta_equal():
    with init_empty_weights():
        meta = _model()
        meta[2].weight = nn.Parameter(torch.empty(10, 8))
    real = _model()
    assert compute_module_sizes(meta) == compute_module_sizes(real)
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert compute_module_sizes(tied)[""] == 160


def test_buffer_size_and_max_layer():
    model = nn.Sequential(nn.Embedding(10, 4), Block(), nn.Linear(8, 2, bias=False))
    assert compute_module_total_buffer_size(model) == 2 * 4 + 3 * 8
    sizes = compute_module_sizes(model)
    size, names = get_max_layer_size(list(model.named_children()), sizes, [])
    assert (size, names) == (160, ["0", "1.linear"])
    size, names = get_max_layer_size(list(model.named_children()), sizes, ["Block"])
    assert (size, names) == (192, ["1"])


def test_calculate_maximum_sizes_uses_no_split_attribute():
    model = _model()
    model._no_split_modules = ["Block"]
    total, (largest, names) = calculate_maximum_sizes(model)
    assert total == compute_module_sizes(model)[""]
    assert (largest, names) == (320, ["2"])
    model[2] = nn.Linear(8, 2, bias=False)
    assert calculate_maximum_sizes(model)[1] == (192, ["1"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1e3MB", 10**9), ("1E3MB", 10**9), ("+5GB", 5 * 10**9), ("1_000MB", 10**9), ("1e-3GB", 10**6),
     ("5e3KiB", 5_120_000), ("1.5e0MiB", 1_572_864), ("-0GB", 0)],
)  # fmt: skip
def test_size_numbers_are_read_as_float_reads_them(text, expected):
    """accelerate 1.15 reads the number before the unit with float(): exponents, a sign, underscores."""
    assert convert_file_size_to_int(text) == expected


@pytest.mark.parametrize("bad", ["1__0MB", "1_MB", "_1MB", "1eGB", "infGB", "nanGB", "1e400GB", "-1e3MB", "0x10MB"])
def test_numbers_float_refuses_or_not_finite_are_still_refused(bad):
    with pytest.raises(ValueError, match="memory size"):
        convert_file_size_to_int(bad)


_UNITS = ["GB", "MB", "KB", "GiB", "MiB", "KiB"]  # uppercase "B": accelerate reads a lowercase "b" as bits


def _size_number():
    """Strings float() reads, written the ways people write budgets."""
    from hypothesis import strategies as st

    value = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
    return st.one_of(
        st.integers(0, 10**6).map(str),
        value.map(repr),
        value.map(lambda v: f"{v:e}"),
        value.map(lambda v: f"{v:E}"),
        value.map(lambda v: f"+{v:g}"),
        st.integers(0, 10**6).map(lambda v: f"{v:_}"),
    )


def test_size_strings_match_accelerate():
    """Any float-readable number before an uppercase-B unit gives accelerate's byte count."""
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None)
    @given(number=_size_number(), space=st.sampled_from(["", " "]), unit=st.sampled_from(_UNITS))
    def check(number, space, unit):
        text = f"{number}{space}{unit}"
        assert convert_file_size_to_int(text) == accelerate_modeling.convert_file_size_to_int(text), text

    check()


def test_module_sizes_come_in_accelerates_key_order():
    """Code printing or slicing ``compute_module_sizes(model)`` sees accelerate 1.15's order: per parameter,
    then per buffer, the enclosing modules outermost first, then the tensor; a tensorless model gives {}."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 1, bias=False)))
    model.register_buffer("scale", torch.ones(3))
    expected = ["", "0", "0.weight", "0.bias", "1", "1.0", "1.0.weight", "1.0.bias", "1.1", "1.1.weight",
                "scale", "1.0.running_mean", "1.0.running_var", "1.0.num_batches_tracked"]  # fmt: skip
    assert list(compute_module_sizes(model)) == expected
    assert list(compute_module_sizes(model, buffers_only=True)) == [
        "", "scale", "1", "1.0", "1.0.running_mean", "1.0.running_var", "1.0.num_batches_tracked"
    ]  # fmt: skip
    assert dict(compute_module_sizes(nn.Sequential(nn.ReLU()))) == {}
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    for kwargs in ({}, {"buffers_only": True}, {"dtype": torch.float16}):
        ours, theirs = compute_module_sizes(model, **kwargs), accelerate_modeling.compute_module_sizes(model, **kwargs)
        assert list(ours.items()) == list(theirs.items())


def test_module_sizes_of_a_tied_transformers_model_match_accelerate_in_order():
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    for kwargs in ({}, {"buffers_only": True}, {"dtype": torch.bfloat16, "special_dtypes": {"lm_head.weight": "float32"}}):
        ours, theirs = compute_module_sizes(model, **kwargs), accelerate_modeling.compute_module_sizes(model, **kwargs)
        assert list(ours.items()) == list(theirs.items())


def _random_model(data):
    """A nested model drawn by hypothesis: Linear/Embedding leaves, buffers, a reused module, tied weights."""
    from hypothesis import strategies as st

    def build(depth):
        module = nn.Module()
        for i in range(data.draw(st.integers(0 if depth else 1, 3))):
            kind = data.draw(st.sampled_from(["linear", "embed", "buffer", "nested"] if depth < 2 else ["linear", "buffer"]))
            if kind == "linear":
                module.add_module(f"m{i}", nn.Linear(data.draw(st.integers(1, 4)), 2, bias=data.draw(st.booleans())))
            elif kind == "embed":
                module.add_module(f"m{i}", nn.Embedding(3, 2))
            elif kind == "buffer":
                module.register_buffer(f"b{i}", torch.zeros(data.draw(st.integers(1, 3)), dtype=torch.int64),
                                       persistent=data.draw(st.booleans()))  # fmt: skip
            else:
                module.add_module(f"m{i}", build(depth + 1))
        return module

    model = build(0)
    leaves = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    if len(leaves) >= 2 and data.draw(st.booleans()):
        model.add_module("again", leaves[0])  # one module under two names
    same_shape = [m for m in leaves[1:] if m.weight.shape == leaves[0].weight.shape] if leaves else []
    if same_shape:
        same_shape[-1].weight = leaves[0].weight  # tied
    return model


def test_module_sizes_match_accelerate_in_order_on_random_models():
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None)
    @given(data=st.data(), dtype=st.sampled_from([None, torch.float16]), buffers_only=st.booleans())
    def check(data, dtype, buffers_only):
        model = _random_model(data)
        ours = compute_module_sizes(model, dtype=dtype, buffers_only=buffers_only)
        theirs = accelerate_modeling.compute_module_sizes(model, dtype=dtype, buffers_only=buffers_only)
        assert list(ours.items()) == list(theirs.items())

    check()
