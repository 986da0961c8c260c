"""A GGUF file's transformers config and tokenizer, each parsed once per process.

transformers rebuilds both from the file's metadata (``AutoConfig`` / ``AutoTokenizer`` with
``gguf_file=``); parsing a large vocabulary's metadata takes seconds, so the config is read
once per file (keyed by :func:`bigmodel.checkpoints.gguf.file_key`) and the tokenizer class
is chosen from it instead of parsing the file again.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

from .gguf import check_file, file_key


def config_from_gguf(path: str | os.PathLike) -> Any:
    """The transformers config stored in a GGUF file's metadata (``AutoConfig(..., gguf_file=)``).

    transformers parses the file for it (seconds for a large vocabulary); the config is read
    once per process for a given file (see :func:`file_key`) and each call gets its own copy.

    Raises:
        ImportError: transformers or gguf is missing.
        FileNotFoundError: no such file.
        ValueError: the file is truncated or corrupted, or transformers does not support its
            architecture (names the file).
    """
    return copy.deepcopy(_cached_config(file_key(path)))


@functools.lru_cache(maxsize=4)
def _cached_config(key: tuple[str, int, int]) -> Any:
    import transformers

    path = Path(key[0])
    check_file(path)  # a cut file is named as such, not as an architecture transformers cannot read
    try:
        return transformers.AutoConfig.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(
            f"Cannot read a transformers config from GGUF file {str(path)!r} ({error}); "
            "check that transformers supports its architecture."
        ) from error


def tokenizer_from_gguf(path: str | os.PathLike) -> Any:
    """The tokenizer stored in a GGUF file (transformers' GGUF tokenizer conversion).

    ``AutoTokenizer(..., gguf_file=)`` reads the file's config only to choose the tokenizer
    class; here the class is named from :func:`config_from_gguf`'s cached config, so the file's
    metadata is not parsed again for it (transformers' own GGUF tokenizer reader is fast).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no tokenizer transformers can rebuild (names the file).
    """
    import transformers

    path = Path(path)
    tokenizer_class = _tokenizer_class(transformers, config_from_gguf(path), path)
    try:
        return tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(
            f"Cannot rebuild a tokenizer from GGUF file {str(path)!r} ({error}); pass a model folder with one."
        ) from error


def _tokenizer_class(transformers: Any, config: Any, path: Path) -> Any:
    """The class ``AutoTokenizer`` picks for a GGUF file, named without parsing the file's config again.

    A GGUF config names no tokenizer class, so transformers 5 takes its mapping's class for
    the config (``TokenizersBackend`` when it has none).  Anything else (a
    ``tokenizer_config.json`` beside the file, a Mistral backend, transformers 4) is left to
    ``AutoTokenizer`` itself.
    """
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    backend = getattr(transformers, "TokenizersBackend", None)
    if backend is None or getattr(config, "tokenizer_class", None) or (path.parent / "tokenizer_config.json").exists():
        return transformers.AutoTokenizer
    chosen = TOKENIZER_MAPPING.get(type(config), backend)
    if not isinstance(chosen, type) or chosen.__name__ == "MistralCommonBackend":
        return transformers.AutoTokenizer
    return chosen
