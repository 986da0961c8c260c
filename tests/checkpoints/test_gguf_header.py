"""A file that is not GGUF, or whose header is damaged, is named with what it is and what is wrong.

Before: a git-lfs pointer, a safetensors or torch file named ``.gguf`` were "truncated or corrupted
(GGUF magic invalid); download it again"; a header cut short said "index 0 is out of bounds for
axis 0 with size 0"; a repeated metadata key escaped as gguf's raw ``KeyError``; a tensor whose
dimensions overflow 64 bits passed the byte-range check.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from _gguf_files import tiny_llama, write_tiny_gguf

from bigmodel.checkpoints.gguf import open_reader
from bigmodel.checkpoints.gguf_meta import config_from_gguf
from bigmodel.cli.main import main

CORRUPTED = r"GGUF file '.*{name}' is truncated or corrupted \({detail}\); download it again\.$"


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-header") / "whole.gguf", tiny_llama(layers=2), quant="Q8_0")


def _safetensors_bytes(tmp_path: Path) -> bytes:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    return (tmp_path / "w.safetensors").read_bytes()


def _torch_bytes(tmp_path: Path) -> bytes:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.bin")
    return (tmp_path / "w.bin").read_bytes()


LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 1000\n"
NOT_GGUF = {
    "lfs-pointer": (lambda tmp: LFS, r"b'version http', not b'GGUF'; it looks like a git-lfs pointer, not the file"),
    "safetensors": (_safetensors_bytes, r"not b'GGUF'; it looks like a safetensors file: pass its model folder"),
    "torch-zip": (_torch_bytes, r"b'PK\\x03\\x04.*', not b'GGUF'; it looks like a zip archive"),
    "html": (lambda tmp: b"<!DOCTYPE html><html>Not found</html>", r"it looks like text or HTML"),
    "other": (lambda tmp: bytes(range(40)), r"not b'GGUF'; pass a file in llama\.cpp's GGUF format"),
}


@pytest.mark.parametrize("case", list(NOT_GGUF))
def test_a_file_that_is_not_gguf_says_what_it_looks_like(tmp_path: Path, case: str) -> None:
    content, detail = NOT_GGUF[case]
    path = tmp_path / "model.gguf"
    path.write_bytes(content(tmp_path))
    message = rf"^'{re.escape(str(path))}' is not a GGUF file: it starts with .*{detail}"
    with pytest.raises(ValueError, match=message):
        config_from_gguf(path)
    with pytest.raises(ValueError, match=message):
        open_reader(path)


def test_the_cli_says_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv("BIGMODEL_DEBUG", raising=False)
    path = tmp_path / "model.gguf"
    path.write_bytes(LFS)
    assert main(["estimate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"bigmodel: error: '{path}' is not a GGUF file: it starts with b'version http', not b'GGUF'; it looks like "
        "a git-lfs pointer, not the file itself: run `git lfs pull` or download the file."
    )


def test_an_empty_file_is_named_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^GGUF file '.*empty\.gguf' is empty \(0 bytes\); download it again\.$"):
        config_from_gguf(path)


def test_a_file_cut_inside_the_first_24_bytes_says_where(whole: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole.read_bytes()[:10])
    detail = "the file ends at byte 10, inside the 24-byte header"
    with pytest.raises(ValueError, match=CORRUPTED.format(name="cut.gguf", detail=detail)):
        config_from_gguf(path)


def test_a_header_cut_short_gives_its_counts_and_the_file_end(whole: Path, tmp_path: Path) -> None:
    data = whole.read_bytes()
    tensors, entries = struct.unpack_from("<QQ", data, 8)
    assert tensors == len(gguf.GGUFReader(str(whole)).tensors) > 0
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:1000])
    detail = (
        rf"its header declares {tensors} tensors and {entries} metadata entries, but the file ends at byte 1,000 "
        "before they are all described"
    )
    with pytest.raises(ValueError, match=CORRUPTED.format(name="cut.gguf", detail=detail)):
        open_reader(path)


def test_a_repeated_metadata_key_is_named(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "first.gguf"), "llama")
    writer.add_uint32("test.aaaa", 1)
    writer.add_uint32("test.bbbb", 2)
    writer.add_tensor("weight", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = tmp_path / "twice.gguf"
    path.write_bytes((tmp_path / "first.gguf").read_bytes().replace(b"test.bbbb", b"test.aaaa"))
    detail = r"Duplicate test\.aaaa already in list at offset \d+: a metadata key appears twice"
    with pytest.raises(ValueError, match=CORRUPTED.format(name="twice.gguf", detail=detail)):
        open_reader(path)


def test_dimensions_that_overflow_64_bits_are_past_the_end(whole: Path, tmp_path: Path) -> None:
    path = tmp_path / "huge.gguf"
    path.write_bytes(whole.read_bytes())
    reader = gguf.GGUFReader(str(path), "r+")
    field = next(t.field for t in reader.tensors if t.name == "output_norm.weight")
    field.parts[3][0] = 2**63  # elements: negative once cast to int64, so the end fell before the start
    reader.data.flush()
    del reader, field
    detail = r"tensor 'output_norm\.weight' needs bytes up to [\d,]+ but the file has [\d,]+"
    with pytest.raises(ValueError, match=CORRUPTED.format(name="huge.gguf", detail=detail)):
        open_reader(path)
