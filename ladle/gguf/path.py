"""Which GGUF file a --model path names: the file itself, or the one .gguf in a directory without config.json.

A directory with config.json is an HF checkpoint even when a .gguf sits beside it (HF downloads often hold
both), so adding a GGUF to a checkpoint folder never changes what loads.
"""
from __future__ import annotations

from pathlib import Path

SUFFIX = ".gguf"


class GGUFPathError(FileNotFoundError):
    """The path looks like a GGUF checkpoint but does not name exactly one file."""


def gguf_file_of(path: str | Path) -> Path | None:
    """The GGUF file `path` names, or None where it is not a GGUF checkpoint (an HF directory, or nothing).
    Raises GGUFPathError for a directory holding several .gguf files and no config.json."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == SUFFIX else None
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == SUFFIX and f.is_file())
    if len(found) > 1:
        raise GGUFPathError(f"{p} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}) and no "
                            "config.json; pass --model FILE.gguf to say which")
    return found[0] if found else None
