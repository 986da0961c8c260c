"""Dropping used file pages cheaply (unmap, then drop the file range), never a page written in place."""

from __future__ import annotations

import os

import pytest
import torch
from _page_cache import drop as drop_cache
from safetensors.torch import save_file

from bigmodel.offload import readahead
from bigmodel.offload.drop import drop
from bigmodel.offload.storage import OffloadedWeightsLoader

pytestmark = pytest.mark.skipif(not readahead.supported(), reason="needs madvise/mincore and /proc/self/maps")


def _faulted_in(tmp_path) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A 4 MiB safetensors tensor read in place (a private file mapping), every page faulted in; its
    values (copied) and its page-aligned span."""
    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.arange(2**20, dtype=torch.float32)}, path)
    drop_cache(path)
    index = {"w": {"safetensors_file": path, "weight_name": "w", "dtype": "float32", "shape": [2**20]}}
    mapped = OffloadedWeightsLoader(index=index)["w"]
    expected = mapped.clone()  # faults every page in
    spans = readahead.file_spans([mapped], readahead.file_mappings())
    assert readahead.resident(spans)
    return mapped, expected, spans


def test_clean_pages_leave_memory_and_read_back_the_same(tmp_path):
    mapped, expected, spans = _faulted_in(tmp_path)
    assert drop(spans) == []
    (address, length), page = spans[0], 4096
    pages = [(address + k * page, page) for k in range(0, length // page, 64)]
    assert not any(readahead.resident([one]) for one in pages)  # dropped from the page cache, not only unmapped
    assert torch.equal(mapped, expected)  # read again from the file


def test_a_span_with_a_page_written_in_place_is_left_and_paged_out_keeping_the_write(tmp_path):
    mapped, expected, spans = _faulted_in(tmp_path)
    mapped[1000] = -1.0  # a private copy of that page: MADV_DONTNEED would put the file's value back
    assert drop(spans) == spans
    readahead.release(spans)
    assert float(mapped[1000]) == -1.0
    expected[1000] = -1.0
    assert torch.equal(mapped, expected)


def test_memory_outside_file_mappings_is_left(tmp_path):
    anonymous = torch.ones(2**20)
    page = 4096
    start = -(-anonymous.data_ptr() // page) * page
    span = (start, 16 * page)
    assert drop([span]) == [span]
    assert torch.equal(anonymous, torch.ones(2**20))


def _map_raw(path, values: torch.Tensor) -> torch.Tensor:
    """``values`` written to ``path`` (a new file, replacing any there), mapped privately as torch maps
    checkpoints."""
    tmp = path.with_suffix(".tmp")
    values.numpy().tofile(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:  # written back: drop() drops clean pages only (dirty ones stayed cached when writeback lagged, under load)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)  # a new inode at the same path
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=values.nbytes)
    return torch.tensor([], dtype=values.dtype).set_(storage)


def test_a_file_written_anew_at_the_same_path_is_dropped_too(tmp_path):
    """An offload folder's ``.dat`` file rewritten by a new dispatch is another file at the same path: its
    pages are dropped (not those of the file the path named before)."""
    path, page = tmp_path / "w.dat", 4096
    first = _map_raw(path, torch.arange(2**20, dtype=torch.float32))
    assert drop(readahead.file_spans([first], readahead.file_mappings())) == []
    second = _map_raw(path, -torch.arange(2**20, dtype=torch.float32))
    expected = second.clone()  # faults every page in
    spans = readahead.file_spans([second], readahead.file_mappings())
    assert drop(spans) == []
    (address, length) = spans[0]
    assert not any(readahead.resident([(address + k * page, page)]) for k in range(0, length // page, 64))
    assert torch.equal(second, expected) and float(first[5]) == 5.0


def test_another_file_mapped_where_a_dropped_one_was_is_dropped(tmp_path):
    """A model deleted and another loaded: the new file's mapping can take the old one's addresses, and the
    row kept from the old one must not be used (its file's pages would be dropped, the new ones kept)."""
    page = 4096
    for attempt in range(8):  # the kernel usually hands the freed range out again at once
        first = _map_raw(tmp_path / f"a{attempt}.dat", torch.arange(2**20, dtype=torch.float32))
        old = readahead.file_spans([first], readahead.file_mappings())
        assert drop(old) == []
        del first
        second = _map_raw(tmp_path / f"b{attempt}.dat", -torch.arange(2**20, dtype=torch.float32))
        drop_cache(tmp_path / f"b{attempt}.dat")  # written back: a dirty page is never dropped
        expected = second.clone()  # faults every page in
        spans = readahead.file_spans([second], readahead.file_mappings())
        if spans == old:
            break
    else:
        pytest.skip("the new mapping never took the old one's addresses")
    assert drop(spans) == []
    (address, length) = spans[0]
    assert not any(readahead.resident([(address + k * page, page)]) for k in range(0, length // page, 64))
    assert torch.equal(second, expected)


def test_a_dropped_file_is_not_held_open_once_its_views_are_gone(tmp_path):
    """Dropping keeps no descriptor of the file: a deleted model's files (and a removed offload folder's
    disk space) are freed with its views, not at the process's end."""
    import gc
    import os

    mapped, _, spans = _faulted_in(tmp_path)
    assert drop(spans) == []
    del mapped
    gc.collect()
    path = str(tmp_path / "w.safetensors")
    os.remove(path)
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(path):
                held.append(fd)
        except OSError:
            continue
    assert held == []


def test_a_page_written_in_place_then_swapped_out_counts_as_written(tmp_path, monkeypatch):
    """A private copy swapped out is not present (pagemap bit 63) but swapped (bit 62): it still holds the
    write, which ``MADV_DONTNEED`` would discard and a direct read would not see.  The kernel's pagemap
    entries are given from a file (a swapped page cannot be made on demand here: no swap)."""
    import os

    from bigmodel.offload import drop as drop_module

    page, address = 4096, 1 << 28
    entries = {"swapped": 1 << 62, "file page": (1 << 63) | (1 << 61), "never touched": 0,
               "written": 1 << 63}  # fmt: skip
    path = tmp_path / "pagemap"
    expected = {}
    for i, (name, entry) in enumerate(entries.items()):
        with open(path, "r+b" if path.exists() else "wb") as pagemap:
            pagemap.seek(8 * (address // page + i))
            pagemap.write(entry.to_bytes(8, "little"))
        expected[name] = name in ("swapped", "written")
    fd = os.open(path, os.O_RDONLY)
    monkeypatch.setitem(drop_module._PAGEMAP, os.getpid(), fd)
    try:
        found = {name: drop_module.written(address + i * page, page) for i, name in enumerate(entries)}
    finally:
        os.close(fd)
    assert found == expected
