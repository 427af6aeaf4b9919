"""Loading a checkpoint's tokenizer with an error that names the file at fault.

transformers reports a truncated tokenizer.json as "Expecting value: line 619 column 1", naming no file; a
user with a dozen checkpoint folders needs the path.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ladle.gguf.path import gguf_file_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
               "added_tokens.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of an HF checkpoint directory, or of a GGUF file (or a directory holding one, and no
    config.json), built from the file's metadata."""
    from transformers import AutoTokenizer

    gguf = gguf_file_of(path)
    if gguf is not None:
        from ladle.gguf.reader import read_gguf
        from ladle.gguf.tokenizer import build_tokenizer

        return build_tokenizer(read_gguf(gguf))
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- whatever went wrong, the user needs the file's name
        why = _diagnose(Path(path)) or f"{type(e).__name__}: {e}"
        raise ValueError(f"cannot load the tokenizer from {path}: {why}") from e


def _diagnose(folder: Path) -> str | None:
    """The first tokenizer file that is not valid JSON, named with the parser's complaint."""
    for name in _JSON_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_bytes())
        except (ValueError, OSError) as e:
            return f"{file} is not valid JSON ({e}); the file is truncated or corrupt"
    return None
