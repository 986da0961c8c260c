"""A GGUF file's metadata is parsed once per process: config, tokenizer and weights share the parses."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from _gguf_files import tiny_llama, write_tiny_gguf

from bigmodel import load_pretrained
from bigmodel.checkpoints.gguf import open_reader
from bigmodel.checkpoints.gguf_meta import config_from_gguf


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The class of every ``gguf.GGUFReader`` built from now on: transformers' (``GGUFReader``) or ours."""
    seen: list[str] = []
    original = gguf.GGUFReader.__init__

    def counting(self, *args, **kwargs):
        seen.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    return seen


def test_transformers_parses_a_file_once_per_process_and_each_load_steps_over_it(
    tmp_path: Path, parses: list[str]
) -> None:
    reference = tiny_llama()
    path = write_tiny_gguf(tmp_path / "once.gguf", reference)
    ids = torch.tensor([[3, 5, 7, 11]])
    for _ in range(2):  # load_pretrained reads the config twice itself (build, load) and the weights once
        model = load_pretrained(path, max_memory={"cpu": 60_000}, offload_folder=tmp_path / "off")
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    # one check of the header and tensor ranges before the config, then one step-over per load
    assert sorted(parses) == ["CheckedReader"] * 3 + ["GGUFReader"], parses


def test_the_config_is_read_again_when_the_file_changes_and_each_caller_gets_its_own(
    tmp_path: Path, parses: list[str]
) -> None:
    path = write_tiny_gguf(tmp_path / "changed.gguf", tiny_llama())
    first = config_from_gguf(path)
    first.num_hidden_layers = 99
    assert config_from_gguf(path).num_hidden_layers == 4
    assert parses == ["CheckedReader", "GGUFReader"]  # the file checked first, then parsed by transformers
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # rewritten: same size, new mtime
    config_from_gguf(path)
    assert parses == ["CheckedReader", "GGUFReader"] * 2


def test_the_reader_serves_the_same_tensors_as_gguf_itself(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "bytes.gguf", tiny_llama(), quant="Q8_0")
    ours, plain = open_reader(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in plain.tensors]
    for mine, theirs in zip(ours.tensors, plain.tensors):
        assert mine.tensor_type == theirs.tensor_type and mine.data_offset == theirs.data_offset
        assert np.array_equal(mine.data, theirs.data)
    assert ours.fields["general.architecture"].contents() == "llama"


def write_with_metadata_arrays(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.tokens", [f"token {i}" for i in range(5000)])
    writer.add_array("test.token_types", [i % 7 for i in range(5000)])
    writer.add_array("test.short", ["en", "fr"])
    writer.add_uint32("test.after", 7)
    writer.add_tensor("weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_long_metadata_arrays_are_stepped_over_and_everything_after_them_read_as_gguf_reads_it(
    tmp_path: Path,
) -> None:
    path = write_with_metadata_arrays(tmp_path / "arrays.gguf")
    ours, plain = open_reader(path), gguf.GGUFReader(str(path))
    assert len(plain.fields["test.tokens"].contents()) == 5000
    assert ours.fields["test.tokens"].contents() == [] and ours.fields["test.token_types"].contents() == []
    assert ours.fields["test.tokens"].types == plain.fields["test.tokens"].types
    assert ours.fields["test.token_types"].types == plain.fields["test.token_types"].types
    assert ours.fields["test.short"].contents() == ["en", "fr"]
    assert ours.fields["test.after"].contents() == 7
    assert ours.data_offset == plain.data_offset
    assert np.array_equal(ours.tensors[0].data, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_a_file_cut_inside_a_long_array_is_refused(tmp_path: Path) -> None:
    whole = write_with_metadata_arrays(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: whole.index(b"token 2500")])
    with pytest.raises(ValueError, match=r"cut\.gguf.* is truncated or corrupted \(.*\); download it again"):
        open_reader(cut)
