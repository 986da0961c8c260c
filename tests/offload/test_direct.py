"""Direct reads into slots (offload.direct): same bytes and alignment as the mapped views, slots never
rewritten while a tensor views them, and the mapped views used wherever a direct read cannot be trusted."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bigmodel.offload import direct
from bigmodel.offload.drop import Mappings
from bigmodel.offload.storage import OffloadedWeightsLoader

pytestmark = pytest.mark.skipif(not direct.layout_possible() or not os.path.exists("/proc/self/map_files"),
                                reason="needs O_DIRECT, /proc/self/maps and torch's storage use count")


def _mapped(folder: Path, tensors: dict[str, torch.Tensor], name: str = "w.safetensors") -> dict[str, torch.Tensor]:
    """``tensors`` saved as one safetensors file and read back in place (private file mappings)."""
    path = str(folder / name)
    save_file(tensors, path)
    index = {k: {"safetensors_file": path, "weight_name": k, "dtype": str(v.dtype).split(".")[1], "shape": list(v.shape)}
             for k, v in tensors.items()}
    loader = OffloadedWeightsLoader(index=index)
    return {k: loader[k] for k in tensors}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(300, 257, generator=g), "a.bias": torch.randn(257, generator=g),
            "b.weight": torch.randn(64, 1000, generator=g).to(torch.bfloat16), "c.scale": torch.randn(3, generator=g)}


def _read(streams: direct.Streams, values: dict[str, torch.Tensor], key: int = 1) -> dict[str, torch.Tensor] | None:
    assert streams.plan([values], count=2, available=1 << 40)
    assert streams.read(0, key)
    return streams.take(key)


def test_a_layout_reads_one_run_per_file_and_keeps_each_tensors_offset_within_its_page(tmp_path):
    values = _mapped(tmp_path, _tensors())
    plan = direct.layout(values, Mappings())
    assert plan is not None and len(plan.runs) == 1 and plan.others == {}
    run = plan.runs[0]
    assert run.offset % 4096 == 0 and run.length % 4096 == 0 and run.at == 0
    for key, at, dtype, shape in plan.views:
        assert at % 4096 == values[key].data_ptr() % 4096  # kernels see the alignment the mapping has
        assert (dtype, shape) == (values[key].dtype, values[key].shape)


def test_slot_views_equal_the_mapped_values_bit_for_bit(tmp_path):
    values = _mapped(tmp_path, _tensors())
    streams = direct.Streams()
    read = _read(streams, values)
    assert read is not None and set(read) == set(values)
    for key, value in values.items():
        assert torch.equal(read[key], value) and read[key].dtype == value.dtype
        assert read[key].data_ptr() != value.data_ptr()  # from the slot, not the mapping


def test_values_in_memory_pass_through_and_two_files_are_two_runs(tmp_path):
    values = {**_mapped(tmp_path, {"x": torch.arange(5000.0)}, "x.safetensors"),
              **_mapped(tmp_path, {"y": -torch.arange(7000.0)}, "y.safetensors"), "z": torch.ones(3)}
    plan = direct.layout(values, Mappings())
    assert plan is not None and len(plan.runs) == 2 and set(plan.others) == {"z"}
    read = _read(direct.Streams(), values)
    assert read is not None and read["z"] is values["z"]
    assert torch.equal(read["x"], values["x"]) and torch.equal(read["y"], values["y"])


def test_nothing_file_backed_has_no_layout():
    assert direct.layout({"w": torch.ones(10)}, Mappings()) is None


def test_a_slot_a_tensor_still_views_is_not_read_into(tmp_path):
    first = _mapped(tmp_path, _tensors(0), "first.safetensors")
    second = _mapped(tmp_path, _tensors(1), "second.safetensors")
    streams = direct.Streams()
    assert streams.plan([first, second], count=1, available=1 << 40)  # one slot only
    assert streams.read(0, 10)
    kept = streams.take(10)["a.weight"]  # e.g. an output aliasing a weight, or a tensor saved for backward
    assert streams.release(10)
    assert not streams.read(1, 11)  # the only slot is still viewed: the mapped views are used instead
    expected = kept.clone()
    del kept
    assert streams.read(1, 11)  # nothing views it any more
    read = streams.take(11)
    assert torch.equal(read["a.weight"], second["a.weight"]) and not torch.equal(read["a.weight"], expected)


def test_a_module_read_ahead_already_is_not_read_again(tmp_path):
    values = _mapped(tmp_path, _tensors())
    streams = direct.Streams()
    assert streams.plan([values], count=1, available=1 << 40)
    assert streams.read(0, 7) and streams.read(0, 7)  # the second: the reading in flight serves it
    assert streams.take(7) is not None and streams.take(7) is None  # taken once


def test_a_page_written_in_place_makes_the_module_use_its_mapped_views(tmp_path):
    values = _mapped(tmp_path, _tensors())
    bias = values["a.bias"]
    ctypes.memmove(bias.data_ptr() + 12, ctypes.byref(ctypes.c_float(123.0)), 4)  # no version bump: only the page tells
    assert float(bias[3]) == 123.0  # a private copy of that page: the file no longer holds the value
    assert _read(direct.Streams(), values) is None


def test_a_value_changed_in_place_after_the_layout_is_not_taken_from_the_slot(tmp_path):
    values = _mapped(tmp_path, _tensors())
    streams = direct.Streams()
    assert streams.plan([values], count=2, available=1 << 40)
    values["c.scale"].zero_()  # bumps the version counter (and writes a private page)
    assert streams.read(0, 1) and streams.take(1) is None


def test_slots_that_do_not_fit_the_memory_fraction_are_not_made(tmp_path):
    values = _mapped(tmp_path, _tensors())
    size = direct.layout(values, Mappings()).nbytes
    streams = direct.Streams(fraction=0.25)
    assert not streams.plan([values], count=4, available=4 * 4 * size - 1)
    assert not streams.read(0, 1)
    assert streams.plan([values], count=4, available=4 * 4 * size)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_file_under_dev_is_not_read_directly():
    """/dev/shm is tmpfs (no O_DIRECT before Linux 6.6); the read-ahead leaves mappings under /dev/ alone."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        values = _mapped(Path(folder), _tensors())
        assert direct.layout(values, Mappings()) is None
        assert not direct.Streams().plan([values], count=2, available=1 << 40)


def test_odd_dtypes_zero_size_and_unaligned_offsets_read_bit_for_bit(tmp_path):
    """int8 of odd length, bool, float16, bfloat16 and an empty tensor in one file: every value equals its
    mapped view (the empty one is passed on as it is)."""
    g = torch.Generator().manual_seed(3)
    tensors = {"i8": torch.randint(-128, 127, (4099,), generator=g, dtype=torch.int8),
               "flag": torch.rand(777, generator=g) > 0.5, "half": torch.randn(33, 17, generator=g).half(),
               "bf": torch.randn(5, 9, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 4)}
    values = _mapped(tmp_path, tensors)
    read = _read(direct.Streams(), values)
    assert read is not None and set(read) == set(values)
    for key, value in values.items():
        assert read[key].dtype == value.dtype and read[key].shape == value.shape and torch.equal(read[key], value), key


def test_a_file_truncated_after_the_layout_is_not_taken_from_a_stale_slot(tmp_path, monkeypatch):
    """The slot held another module's bytes: a read that ends early (the file is shorter than its layout)
    must not hand them out as this module's values.  Mapped without a lease (``BIGMODEL_MAPPED_WEIGHTS=map``
    where the file system has none, e.g. NFS): nothing copies the mapping into memory before the truncation."""
    from bigmodel.core import leases

    monkeypatch.setenv("BIGMODEL_MAPPED_WEIGHTS", "map")
    monkeypatch.setattr(leases, "supported", lambda: False)
    first = _mapped(tmp_path, _tensors(0), "first.safetensors")
    second = _mapped(tmp_path, _tensors(1), "second.safetensors")
    streams = direct.Streams()
    assert streams.plan([first, second], count=1, available=1 << 40)  # one slot: the second reuses the first's
    assert streams.read(0, 10) and streams.take(10) is not None
    assert streams.release(10)
    os.truncate(tmp_path / "second.safetensors", 4096)  # the mapped views of ``second`` are never touched again
    assert streams.read(1, 11)
    assert streams.take(11) is None


def _first_wait_held(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """``Reading.wait`` made to stop at its first call: ``entered`` is set once it is there, and it goes on
    when ``go`` is set (a forward's take held while another thread acts)."""
    entered, go = threading.Event(), threading.Event()
    wait = direct.Reading.wait

    def slow_first(reading):
        if not entered.is_set():
            entered.set()
            assert go.wait(30)
        return wait(reading)

    monkeypatch.setattr(direct.Reading, "wait", slow_first)
    return entered, go


def test_a_module_taken_by_two_forwards_at_once_loses_no_slot(tmp_path, monkeypatch):
    """Two forwards of one model (two threads) take the same module: both slots go back to the pool."""
    values = _mapped(tmp_path, _tensors())
    streams = direct.Streams()
    assert streams.plan([values], count=2, available=1 << 40)
    entered, go = _first_wait_held(monkeypatch)
    taken = []
    assert streams.read(0, 5)
    other = threading.Thread(target=lambda: taken.append(streams.take(5)))
    other.start()
    assert entered.wait(30)  # the other forward waits for its reading (popped already)
    assert streams.read(0, 5)  # this forward reads the module again, into the second slot
    taken.append(streams.take(5))
    go.set()
    other.join(30)
    assert all(values is not None for values in taken)
    taken.clear()
    assert streams.release(5)
    assert streams.read(0, 6) and streams.read(0, 7)  # both slots are free again


def test_a_file_rewritten_while_its_module_is_read_is_not_taken_from_the_slot(tmp_path, monkeypatch):
    """A checkpoint rewritten in place under a live model: bigmodel's lease handler first copies the file's
    mappings into memory (the values keep their old bytes), then the writer goes on (here this thread).  A read checked
    before that and run after it got the new bytes: they must not be taken for the module's values."""
    from bigmodel.core import leases

    values = _mapped(tmp_path, _tensors())
    expected = {key: value.clone() for key, value in values.items()}
    streams = direct.Streams()
    assert streams.plan([values], count=1, available=1 << 40)
    if not leases.supported() or not leases.held():
        pytest.skip("needs a read lease on the mapped file (bigmodel's protection of rewritten checkpoints)")
    go = threading.Event()
    chunk = direct.Reader._chunk

    def held_back(reader, *args):
        assert go.wait(30)
        chunk(reader, *args)

    monkeypatch.setattr(direct.Reader, "_chunk", held_back)
    assert streams.read(0, 3)
    streams._reading[3].chunks[0].result()  # checked: no page written in place yet
    path = str(tmp_path / "w.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as rewritten:  # the lease breaks: the handler copies the mappings into memory first
        header = 8 + int.from_bytes(rewritten.read(8), "little")
        rewritten.seek(header)
        rewritten.write(os.urandom(size - header))  # the same inode, new bytes after the header
    go.set()
    read = streams.take(3)
    assert all(torch.equal(values[key], expected[key]) for key in values)  # the model keeps its values
    assert read is None or all(torch.equal(read[key], expected[key]) for key in values)


def test_a_slot_of_an_earlier_plan_taken_back_late_is_not_read_into(tmp_path, monkeypatch):
    """A forward still waiting for its module (another thread) while a new plan with larger modules drops
    the slots: the small slot it gives back afterwards must not be used for a larger module's values."""
    small = _mapped(tmp_path, {"s": torch.arange(1000.0)}, "small.safetensors")
    large = _mapped(tmp_path, _tensors(2), "large.safetensors")
    streams = direct.Streams()
    assert streams.plan([small], count=1, available=1 << 40)
    entered, go = _first_wait_held(monkeypatch)
    assert streams.read(0, 1)
    taken = []
    other = threading.Thread(target=lambda: taken.append(streams.take(1)))
    other.start()
    assert entered.wait(30)
    assert streams.plan([large], count=1, available=1 << 40)  # larger slots: the old ones are dropped
    go.set()
    other.join(30)
    taken.clear()
    streams.release(1)  # the old, small slot comes back
    assert streams.read(0, 2)
    read = streams.take(2)
    assert read is not None and all(torch.equal(read[key], value) for key, value in large.items())


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping holding ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= address < high
            elif inside and first == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(getattr(mmap, "MADV_HUGEPAGE", None) is None
                    or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="needs transparent huge pages")
def test_slots_ask_for_transparent_huge_pages():
    """A slot is read into with O_DIRECT at every forward: its memory is advised MADV_HUGEPAGE (smaps flag
    ``hg``), so the kernel pins 2 MB pages rather than 4 KB ones (a cold forward 1.30 -> 1.10-1.13x here)."""
    slot = direct.Slot(8 << 20)
    assert "hg" in _vm_flags(slot.tensor.data_ptr())


def test_values_far_apart_in_one_file_are_separate_runs_and_the_bytes_between_are_not_read(tmp_path):
    """A quantized layer reads its norms from the checkpoint, which lie around its full-precision weights:
    only their pages are read, not the ``GAP_BYTES`` or more between them."""
    g = torch.Generator().manual_seed(5)
    tensors = {"a.norm": torch.randn(576, generator=g), "b.big": torch.randn(1 << 19, generator=g),
               "c.norm": torch.randn(576, generator=g)}  # 2 MB between the norms
    mapped = _mapped(tmp_path, tensors)
    values = {"a.norm": mapped["a.norm"], "c.norm": mapped["c.norm"]}
    plan = direct.layout(values, Mappings())
    assert plan is not None and len(plan.runs) == 2
    assert sum(run.length for run in plan.runs) <= 4 * 4096  # the norms' pages, not the 2 MB between
    read = _read(direct.Streams(), values)
    assert read is not None and all(torch.equal(read[k], v) for k, v in values.items())
    close = {"a.norm": mapped["a.norm"], "b.big": mapped["b.big"]}  # touching: one run
    plan = direct.layout(close, Mappings())
    assert plan is not None and len(plan.runs) == 1
