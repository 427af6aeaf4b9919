"""Measured activation profiles, kept on disk so the next start of the same model skips profiling.

The key holds everything that changes what profiling measures: the model's config, dtype, the device's
name, torch's version, the block size, the profiled shapes, and ladle's own source (a hash of its .py files:
stricter than a version number, since any code change means a fresh profile). An entry is the measured points;
the model is fitted from them again, so a change to the fit needs no new key.

Location: $LADLE_PROFILE_CACHE_DIR, else $XDG_CACHE_HOME/ladle/profiles (~/.cache/ladle/profiles).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ladle import paths
from ladle.startup.profiling import ProfilePoint

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


Shape = tuple[str, int, int]  # (kind, num_tokens, context), as profiling.profile_shapes lists them

_FIELDS = ("kind", "num_tokens", "context", "peak")


def _shape(s: Shape) -> str:
    return f"{s[0]} {s[1]}@{s[2]}"


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity by default; no measured peak is either.
    raise ValueError(f"{name} is not a measured value")


def check_entry(raw: Any, expected: Sequence[Shape], max_peak: int) -> list[ProfilePoint]:
    """The points of a decoded entry, or ValueError saying what is wrong. A well-formed but wrong entry
    otherwise fails far from here (an IndexError in the fit, a torch assert on NaN, a planner error on an
    absurd peak) on every start, so each point is held to exactly what this start would measure."""
    if not isinstance(raw, dict) or set(raw) != {"points"} or not isinstance(raw["points"], list):
        raise ValueError('not an object {"points": [...]}')
    points = []
    for i, p in enumerate(raw["points"]):
        if not isinstance(p, dict) or set(p) != set(_FIELDS):
            got = sorted(p) if isinstance(p, dict) else type(p).__name__
            raise ValueError(f"point {i} has {got}, not the fields {'/'.join(_FIELDS)}")
        if not isinstance(p["kind"], str) or p["kind"] not in ("prefill", "decode"):
            raise ValueError(f"point {i} has kind {p['kind']!r}, not 'prefill' or 'decode'")
        for name in ("num_tokens", "context"):
            if type(p[name]) is not int:  # bool is an int subclass, and 5.0 or 1e18 decode as floats
                raise ValueError(f"point {i} has {name} {p[name]!r}, not an integer")
        shape = _shape((p["kind"], p["num_tokens"], p["context"]))
        if type(p["peak"]) is not int:
            raise ValueError(f"peak of {shape} is {p['peak']!r}, not an integer")
        if not 0 <= p["peak"] <= max_peak:
            raise ValueError(f"peak of {shape} is {p['peak']}, outside 0..{max_peak} (the device's memory)")
        points.append(ProfilePoint(**p))
    # A multiset: the expected list may itself repeat a shape, and any other repeat is an extra point.
    have, want = Counter((p.kind, p.num_tokens, p.context) for p in points), Counter(expected)
    if have != want:
        missing, extra = sorted((want - have).elements()), sorted((have - want).elements())
        parts = ([f"missing {', '.join(map(_shape, missing))}"] if missing else []) + \
                ([f"unexpected {', '.join(map(_shape, extra))}"] if extra else [])
        raise ValueError("not the profiled shapes: " + "; ".join(parts))
    return points


def _discard(path: Path, problem: str) -> None:
    logger.warning("profile cache entry %s is %s; discarded, profiling again", path, problem)
    try:
        path.unlink()
    except OSError:
        pass  # at worst the next start finds it again, says so again, and the fresh store replaces it


def load(key: str, expected: Sequence[Shape], max_peak: int) -> list[ProfilePoint] | None:
    """The cached points for key, or None (profile again): absent, unreadable or not what this start would
    measure, in which case the file is named in a warning and deleted so that it cannot fail another start."""
    path = cache_dir() / f"{key}.json"
    try:
        raw = json.loads(path.read_text(), parse_constant=_reject_constant)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # ValueError covers bad JSON and bad UTF-8
        _discard(path, f"unreadable ({e})")
        return None
    try:
        return check_entry(raw, expected, max_peak)
    except ValueError as e:
        _discard(path, f"invalid ({e})")
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
