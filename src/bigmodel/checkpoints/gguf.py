"""GGUF checkpoints (llama.cpp's format): names mapped to a transformers model, tensors dequantized one at a time.

A ``.gguf`` file holds metadata (the config and the tokenizer) and tensors under llama.cpp's
names (``blk.3.attn_q.weight``), most of them quantized in blocks (``Q4_1``, ``Q8_0``, ``Q4_K``
...).  :class:`GGUFCheckpoint` opens one for a given transformers model:

- the file is read with the ``gguf`` package's ``GGUFReader`` (a memory map: nothing is read
  until a tensor is), long metadata arrays (the vocabulary) stepped over, after checking every tensor's quantization type and byte range, so a corrupted file is
  refused before anything is loaded, with the tensor named;
- names are mapped with transformers' GGUF integration (``get_gguf_hf_weights_map`` and the
  architecture's tensor processor, which also undoes llama.cpp's query/key row permutation);
- :meth:`GGUFCheckpoint.tensors` dequantizes one tensor at a time, in row chunks, into one
  float32 buffer: the loader places it on its device (or writes it to the offload folder)
  before the next one is read, so the whole model is never in RAM.

transformers and gguf are optional (``pip install bigmodel[hf]``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .access import check_readable
from .files import TensorInfo
from .gguf_header import GGUFHeader, corrupted_message, read_header

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# llama.cpp stores tensors that transformers computes from the config (rotary frequencies).
COMPUTED_PREFIXES = ("rope_freqs.", "rope_factors_long.", "rope_factors_short.")
_CHUNK_BYTES = 4 * 2**20  # dequantize this many output bytes at a time
_KEPT_ARRAY_LENGTH = 4096  # metadata arrays longer than this are stepped over (see open_reader)
_INTEGER_TYPES = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def is_gguf(path: str | os.PathLike) -> bool:
    """True if ``path`` names a ``.gguf`` file (by its suffix)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as error:
        raise ImportError(
            "Reading GGUF files needs the gguf package; run `pip install bigmodel[hf]`."
        ) from error
    return gguf


def _dequantizable(gguf: Any, qtype: Any) -> bool:
    """True if gguf's ``dequantize`` handles ``qtype`` (or it is a plain integer type)."""
    if qtype.name in _INTEGER_TYPES:
        return True
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def file_key(path: str | os.PathLike) -> tuple[str, int, int]:
    """``(resolved path, size, mtime in ns)``: what per-process caches of a file's parse are keyed by.

    Raises:
        FileNotFoundError: no such file.
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise FileNotFoundError(
            f"GGUF file {str(path)!r} does not exist; pass the path of a .gguf file."
        )
    stat = resolved.stat()
    return str(resolved), stat.st_size, stat.st_mtime_ns


def open_reader(path: str | os.PathLike) -> Any:
    """A ``gguf.GGUFReader`` for ``path``, each tensor's type and byte range checked first.

    Metadata arrays longer than 4096 entries (a vocabulary, its merges) are stepped over and
    their values not kept (``field.contents()`` is empty): gguf's reader would build one numpy
    view per entry, seconds and 100+ MiB for a large vocabulary (0.2 s and 1.5 MiB this way for
    SmolLM2); the tokenizer and config are read by transformers
    (:mod:`bigmodel.checkpoints.gguf_meta`, once per process).  The reader is not kept: its
    memory map would hold every page read through it.

    Raises:
        FileNotFoundError: no such file.
        PermissionError / OSError: the file cannot be opened (names it and the fix).
        ValueError: not a GGUF file (names what it starts with), a header that runs past the end
            of the file (names the counts it declares and the file's size), a repeated metadata key;
            a tensor with a quantization type gguf cannot read, or whose bytes run past the end of
            the file (names the tensor and the fix).
    """
    gguf = _require_gguf()
    path = Path(file_key(path)[0])
    check_readable(path, "GGUF file")
    supported: dict[int, bool] = {}

    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class CheckedReader(gguf.GGUFReader):
        def _get_field_parts(self, start: int, raw_type: int) -> tuple[int, list, list, list]:
            if raw_type != array:
                return super()._get_field_parts(start, raw_type)
            item_type, count = self._get(start, np.uint32), self._get(start + 4, np.uint64)
            scalar = self.gguf_scalar_to_np.get(int(item_type[0]))
            if count[0] <= _KEPT_ARRAY_LENGTH or (scalar is None and item_type[0] != string):
                return super()._get_field_parts(start, raw_type)
            # A long array (a vocabulary, its merges and token types: 10^5 entries) is stepped
            # over, not read as one numpy view per entry (seconds, and 100+ MiB that outlive the
            # parse).  Its values are not kept: the tokenizer is transformers' to read (gguf_meta).
            offset = start + 12 + int(count[0]) * np.dtype(scalar).itemsize if scalar is not None else start + 12
            if scalar is None:
                length = struct.Struct("<Q" if (sys.byteorder == "little") != (self.byte_order == "S") else ">Q")
                for _ in range(int(count[0])):
                    offset += 8 + length.unpack_from(self.data, offset)[0]
            return offset - start, [item_type, count], [], [array, gguf.GGUFValueType(int(item_type[0]))]

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _check_tensor_field(gguf, path, len(self.data), start_offs, field, supported)
            super()._build_tensors(start_offs, fields)

    header = read_header(path)  # not GGUF at all, or cut inside the first 24 bytes: said so
    try:
        return CheckedReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as error:
        if str(path) in str(error):
            raise
        raise ValueError(corrupted_message(path, _failure(error, header))) from error


def _failure(error: BaseException, header: GGUFHeader) -> str:
    """What gguf's reader failed on, in words: it reads past a truncated end as empty views (IndexError)."""
    if isinstance(error, (IndexError, struct.error)):
        return (
            f"its header declares {header.tensors:,} tensors and {header.entries:,} metadata entries, but the file "
            f"ends at byte {header.size:,} before they are all described"
        )
    if isinstance(error, KeyError):  # gguf: "Duplicate <key> already in list at offset <n>"
        return f"{error.args[0] if error.args else error}: a metadata key appears twice"
    return str(error)


def check_file(path: str | os.PathLike) -> None:
    """Check that ``path``'s header parses and every tensor's bytes lie inside the file (cached per file).

    Run before anything else parses the file (transformers' config reader fails on a cut file
    with a reshape or struct error that does not say the file is cut).  About 0.2 s for a
    100 MB file (the header only; no tensor is read); a file checked once in this process is
    not checked again until its size or modification time changes.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is truncated or corrupted (see :func:`open_reader`).
    """
    _checked(file_key(path))


@functools.lru_cache(maxsize=16)
def _checked(key: tuple[str, int, int]) -> None:
    open_reader(key[0])  # raises on a bad header or a tensor past the end; the reader is let go


def _check_tensor_field(
    gguf: Any,
    path: Path,
    file_size: int,
    start: int,
    field: Any,
    supported: dict[int, bool],
) -> None:
    """Raise ValueError naming the tensor if its type is unknown/unreadable or its bytes pass the file's end."""
    _, name_data, _, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", "replace")
    code = int(raw_type[0])
    try:
        qtype = gguf.GGMLQuantizationType(code)
    except ValueError:
        qtype = None
    if qtype is not None and code not in supported:
        supported[code] = _dequantizable(gguf, qtype)
    if qtype is None or not supported[code]:
        label = f"{code}" if qtype is None else f"{qtype.name} ({code})"
        raise ValueError(
            f"GGUF file {str(path)!r}: tensor {name!r} has quantization type {label}, which the installed gguf "
            f"package ({getattr(gguf, '__version__', 'this version')}) cannot dequantize; upgrade gguf "
            "(`pip install -U gguf`) or convert the file with a type it supports."
        )
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    end = start + int(offset[0]) + math.prod(int(d) for d in dims) * size // block  # Python ints: no overflow
    if end > file_size:
        raise ValueError(
            corrupted_message(path, f"tensor {name!r} needs bytes up to {end:,} but the file has {file_size:,}")
        )


class GGUFCheckpoint:
    """One GGUF file opened for loading into a transformers model.

    Args:
        path: the ``.gguf`` file.
        model: the transformers model (usually on ``meta``) whose names the GGUF names are mapped to.

    Raises:
        ImportError: transformers or gguf is missing.
        FileNotFoundError: no such file.
        ValueError: a corrupted file (see :func:`open_reader`), an architecture transformers
            cannot map, or GGUF tensors that match no parameter of ``model`` (named).
    """

    def __init__(self, path: str | os.PathLike, model: nn.Module) -> None:
        self.path = Path(path).resolve()
        self.reader = open_reader(self.path)
        field = self.reader.fields.get("general.architecture")
        self.architecture = str(field.contents()) if field is not None else "?"
        self._processor, self._names = _name_map(self.path, self.architecture, model)
        expected = model.state_dict(keep_vars=True)
        self._entries: dict[str, tuple[str, Any]] = {}
        unmatched = []
        for tensor in self.reader.tensors:
            hf_name = self._names.get(tensor.name)
            if hf_name is None:
                if tensor.name.startswith(COMPUTED_PREFIXES):
                    logger.debug(
                        "%s: skipping %r (computed from the config by transformers).",
                        self.path,
                        tensor.name,
                    )
                else:
                    unmatched.append(tensor.name)
                continue
            self._entries[hf_name] = (tensor.name, tensor)
        if unmatched:
            raise ValueError(
                f"GGUF file {str(self.path)!r}: tensor(s) {unmatched[:20]} match no parameter of "
                f"{type(model).__name__} (through transformers' GGUF name mapping for {self.architecture!r}); "
                "build the model from the file's own config (transformers.AutoConfig.from_pretrained(folder, "
                "gguf_file=name)) or load a GGUF file made for this model."
            )
        self._shapes = {
            n: tuple(expected[n].shape) for n in self._entries if n in expected
        }

    def infos(self) -> dict[str, TensorInfo]:
        """Model name → :class:`TensorInfo` (float32, or the integer type, and the shape once dequantized)."""
        infos = {}
        for hf_name, (_, tensor) in self._entries.items():
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            model_shape = self._shapes.get(hf_name)
            if (
                model_shape is not None
                and model_shape != shape
                and np.prod(model_shape) == np.prod(shape)
            ):
                shape = model_shape  # a processor that reshapes (e.g. transposes) the tensor
            infos[hf_name] = TensorInfo(hf_name, _torch_dtype(tensor), shape, self.path)
        return infos

    def source_of(self, name: str) -> tuple[str, str, int, int]:
        """``(GGUF name, quantization type name, byte offset, byte count)`` of the model tensor ``name``."""
        gguf_name, tensor = self._entries[name]
        return (
            gguf_name,
            tensor.tensor_type.name,
            int(tensor.data_offset),
            int(tensor.n_bytes),
        )

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(model name, tensor)`` in file order, each dequantized into its own CPU buffer.

        Raises:
            ValueError: the architecture's processor changed a tensor's name or size (names it).
        """
        infos = self.infos()
        for hf_name, (gguf_name, tensor) in self._entries.items():
            array = dequantize_tensor(tensor)
            result = self._processor.process(
                weights=array,
                name=gguf_name,
                tensor_key_mapping=self._names,
                parsed_parameters={"tensors": {}},
            )
            mapped = self._names.get(result.name)
            value = torch.from_numpy(np.ascontiguousarray(result.weights))
            if mapped != hf_name or value.numel() != int(np.prod(infos[hf_name].shape)):
                raise ValueError(
                    f"GGUF file {str(self.path)!r}: transformers' {type(self._processor).__name__} turned tensor "
                    f"{gguf_name!r} into {result.name!r} {list(value.shape)}; bigmodel loads architectures whose "
                    "tensors map one to one; load this file with transformers instead."
                )
            yield hf_name, value.reshape(infos[hf_name].shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """Dequantize one ``ReaderTensor`` into a new float32 array (integer types keep theirs), in row chunks.

    The output has the tensor's numpy shape (GGUF dimensions reversed); temporaries stay
    near ``_CHUNK_BYTES``, so the peak is about the output itself.
    """
    gguf = _require_gguf()
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    qtype = tensor.tensor_type
    if qtype.name in _INTEGER_TYPES:
        return np.array(tensor.data, dtype=_INTEGER_TYPES[qtype.name]).reshape(shape)
    out = np.empty(shape, dtype=np.float32)
    if out.size == 0:
        return out
    data = (
        tensor.data.reshape(-1, tensor.data.shape[-1])
        if tensor.data.ndim > 1
        else tensor.data.reshape(1, -1)
    )
    flat = out.reshape(data.shape[0], -1)
    rows = max(1, _CHUNK_BYTES // max(1, flat.shape[1] * 4))
    for start in range(0, data.shape[0], rows):
        flat[start : start + rows] = gguf.quants.dequantize(
            np.asarray(data[start : start + rows]), qtype
        )
    return out


def _torch_dtype(tensor: Any) -> torch.dtype:
    name = tensor.tensor_type.name
    return (
        getattr(torch, np.dtype(_INTEGER_TYPES[name]).name)
        if name in _INTEGER_TYPES
        else torch.float32
    )


@contextlib.contextmanager
def name_maps_built_once() -> Iterator[None]:
    """Serve repeated ``gguf.get_tensor_name_map(arch, layers)`` calls from a cache for the block.

    transformers' ``get_gguf_hf_weights_map`` walks every submodule and asks gguf for the
    same name map at each one: ~400 builds of ~0.03 s for SmolLM2, 12 s of the load, 0.05 s
    with the repeats cached (the map is a pure function of its arguments).  transformers
    imports the function when it runs, so it picks the cached one up; were that to change,
    the mapping would be as right, only as slow as before.  Restored on exit.
    """
    gguf = _require_gguf()
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _name_map(
    path: Path, architecture: str, model: nn.Module
) -> tuple[Any, dict[str, str]]:
    """transformers' tensor processor for the architecture and its GGUF → model name map."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )
    except ImportError as error:
        raise ImportError(
            "Loading GGUF files needs transformers; run `pip install bigmodel[hf]`."
        ) from error
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(
            f"GGUF file {str(path)!r}: {type(model).__name__} is not a transformers model (no .config); GGUF names "
            "are mapped through transformers, so build the model with transformers."
        )
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
        config=config.to_dict()
    )
    try:
        with name_maps_built_once():
            names = get_gguf_hf_weights_map(model, processor)
    except NotImplementedError as error:
        raise ValueError(
            f"GGUF file {str(path)!r}: transformers cannot map architecture {architecture!r} to "
            f"{type(model).__name__} ({error}); upgrade transformers and gguf."
        ) from error
    return processor, dict(names)
