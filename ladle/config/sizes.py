"""Memory sizes as people write them ('8GiB', '512 MiB') and read them (1.50 GiB)."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: int | str, name: str = "a memory size", allow_zero: bool = False) -> int:
    """8589934592, '8GiB', '512 MiB', '1.5G' -> bytes; 0 only where allow_zero (a size whose 0 turns a thing off)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size; write bytes or a number with KiB/MiB/GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n


def format_bytes(n: int) -> str:
    """Bytes as a person reads them: 1.50 GiB, 37.2 MiB, 512 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"
