"""Measured activation profiles, kept on disk so the next start of the same model skips profiling.

The key holds everything that changes what profiling measures: the model's config, dtype, the device's
name, torch's version, the block size, the profiled shapes, and ladle's own source (a hash of its .py files:
stricter than a version number, since any code change means a fresh profile). An entry is the measured points; the model is fitted from them
again, so a change to the fit needs no new key.

Location: $LADLE_PROFILE_CACHE_DIR, else $XDG_CACHE_HOME/ladle/profiles (~/.cache/ladle/profiles).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ladle import paths
from ladle.engine.profiling import ProfilePoint

logger = logging.getLogger("ladle")


def cache_dir() -> Path:
    return paths.cache_dir("profiles", "LADLE_PROFILE_CACHE_DIR")


def _source_hash() -> str:
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]  # the ladle package
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def profile_key(hf_config: Any, dtype: torch.dtype, device: torch.device, **shapes: Any) -> str:
    """A hex digest of everything the measured points depend on; `shapes` are the profiled sizes."""
    config = {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    parts = {"config": config, "dtype": str(dtype), "device": device_name(device), "torch": torch.__version__,
             "source": _source_hash(), "shapes": shapes}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(key: str) -> list[ProfilePoint] | None:
    path = cache_dir() / f"{key}.json"
    try:
        raw = json.loads(path.read_text())
        return [ProfilePoint(**p) for p in raw["points"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring the unreadable profile cache entry %s (%s); profiling again", path, e)
        return None


def store(key: str, points: list[ProfilePoint]) -> Path | None:
    """Write the entry atomically (a concurrent start reads the old one or the new, never half); None when
    the cache directory cannot be written, which costs only the next start's profiling."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"points": [dataclasses.asdict(p) for p in points]}, f)
        path = folder / f"{key}.json"
        os.replace(tmp, path)
        return path
    except OSError as e:
        logger.warning("could not write the profile cache in %s (%s); the next start profiles again", folder, e)
        return None
