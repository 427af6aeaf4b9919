"""The CPU's instruction-set level as a setting (ladle.kernels.cpu_isa): shown with where it came from, and, where
LADLE_CPU_ISA lowers it, oneDNN's matmuls lowered with ladle's kernels so a run measures one level throughout."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ladle.kernels.cpu_isa import ONEDNN_CAPS, CpuIsa, cpu_flags, detect, resolve

if TYPE_CHECKING:
    from ladle.config.provenance import Provenance

ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"


def resolve_cpu_isa(prov: Provenance) -> CpuIsa:
    """The level ladle's kernels run at; a bad $LADLE_CPU_ISA is refused here, before anything loads."""
    flags = cpu_flags()
    level, why = resolve(os.environ, flags)
    if level < detect(flags):  # lowered by LADLE_CPU_ISA
        # oneDNN reads its cap when it first runs a primitive: early in a fresh engine process, as here.
        cap = os.environ.setdefault(ONEDNN_ENV, ONEDNN_CAPS[level])
        why += f"; oneDNN capped at {cap} ({ONEDNN_ENV}), torch's own ops are not (ATEN_CPU_CAPABILITY)"
    prov.put("cpu_isa", level.label, why)
    return level
