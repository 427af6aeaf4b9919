"""The engine process's malloc tuning: a step-sized block (MiBs) comes from the heap instead of a fresh mmap, and
stays mapped once freed, so the next step reuses its pages instead of faulting in new ones (glibc's defaults
mmap blocks over 128 KiB and unmap them on free)."""
from __future__ import annotations

import subprocess
import sys

_PROBE = """
import ctypes, sys
from ladle.startup.allocator import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblkhd  # what imports mmapped already
block = libc.malloc(8 << 20)
mmapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(mmapped, libc.mallinfo2().arena)
"""


def _probe(mode: str) -> tuple[int, int]:
    """(bytes mmapped while an 8 MiB block is held, heap bytes still mapped after it is freed)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    mmapped, heap = map(int, out.stdout.split())
    return mmapped, heap


def test_a_step_sized_block_stays_on_the_heap_once_tuned():
    default_mmapped, _ = _probe("default")
    tuned_mmapped, tuned_heap = _probe("tuned")
    assert default_mmapped >= 8 << 20  # glibc's default: its own mmap, unmapped on free
    assert tuned_mmapped == 0 and tuned_heap >= 8 << 20  # tuned: from the heap, and kept after free
