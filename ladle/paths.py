"""Where ladle keeps what it builds or measures once per machine: $XDG_CACHE_HOME/ladle (~/.cache/ladle)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str, override_env: str | None = None) -> Path:
    """The folder for `kind` (profiles, kernels, demo-model), or $override_env where that is set."""
    explicit = os.environ.get(override_env) if override_env else None
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ladle" / kind
