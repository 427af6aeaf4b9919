"""The checkpoint files a file tier (moe_backing mmap) reads experts from, read so that a file changed on disk
after load is an error, never different tokens.

At load each file is opened once and its identity recorded (device, inode, size, mtime), and every expert
tensor's bytes are read once for a checksum (ladle.experts.slice_checksum). Every later read checks the identity
first (a truncated, rewritten, replaced or removed file is refused at once, without reading), then the bytes read
against their checksum (a write that kept the size and put the mtime back, or a disk returning other bytes). A
refused read raises ExpertFileError naming the file and the expert; the engine ends the requests that need that
expert with its message and keeps serving the rest (ladle.engine.step_executor), so a persistent fault never loops
on restarts. Slots already holding an expert were checked when filled, so they keep serving the load's weights."""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ladle.experts.slice_checksum import slice_checksum

logger = logging.getLogger("ladle")


class Span(Protocol):
    """Where an expert tensor's bytes lie (ladle.experts.backing.TensorLocation)."""
    @property
    def path(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


class ExpertFileError(OSError):
    """A tiered expert's bytes cannot be read as they were at load; the message names the file and the expert
    and says what to do."""


@dataclass(frozen=True)
class FileIdentity:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def change(self, now: FileIdentity) -> str | None:
        """What differs from `now`, in words (None: nothing). The ctime is left out: a chmod or a new hard link
        changes it and not the bytes, and a write that puts the mtime back is the checksum's to catch."""
        if (now.device, now.inode) != (self.device, self.inode):
            return "another file replaced it"
        if now.size != self.size:
            how = "truncated" if now.size < self.size else "grown"
            return f"it is now {now.size} bytes, {self.size} when loaded ({how})"
        if now.mtime_ns != self.mtime_ns:
            return "it was written to after the server loaded it (its mtime changed)"
        return None


class ExpertFiles:
    """The files, open as long as the model lives (as a mapping would be), with what load found in them."""

    def __init__(self, locations: Iterable[Span]) -> None:
        ordered = sorted(set(locations), key=lambda loc: (loc.path, loc.offset))  # one pass through each file
        # FileIO objects, so the descriptors close with the model; reads go through os.preadv on their fileno.
        self._files = {path: open(path, "rb", buffering=0)  # noqa: SIM115 -- held open for the model's lifetime
                       for path in dict.fromkeys(loc.path for loc in ordered)}
        self._identity = {path: FileIdentity.of(os.fstat(f.fileno())) for path, f in self._files.items()}
        self._sums: dict[tuple[str, int], int] = {}
        scratch = bytearray(max((loc.nbytes for loc in ordered), default=0))
        for loc in ordered:
            view = memoryview(scratch)[:loc.nbytes]
            got = os.preadv(self._files[loc.path].fileno(), [view], loc.offset)
            if got != loc.nbytes:
                raise ValueError(f"{loc.path}: an expert tensor at bytes {loc.offset}..{loc.offset + loc.nbytes} "
                                 f"lies past the file's end ({self._identity[loc.path].size} bytes): the checkpoint is "
                                 "truncated or still being written")
            self._sums[(loc.path, loc.offset)] = slice_checksum(view)
        self._reported: set[str] = set()  # files whose failure was logged in full (once each)

    def read(self, loc: Span, view: memoryview, layer: str, expert: int) -> None:
        """loc's bytes into view, as they were at load, or ExpertFileError naming the file and the expert."""
        problem = self._changed(loc.path)
        if problem is None:
            try:
                got = os.preadv(self._files[loc.path].fileno(), [view], loc.offset)
            except OSError as e:
                problem = f"reading it failed ({e.strerror or type(e).__name__})"
            else:
                if got != loc.nbytes:
                    problem = f"it ended {got} bytes into the expert's {loc.nbytes} at offset {loc.offset}"
                elif (now := slice_checksum(view)) != (then := self._sums[(loc.path, loc.offset)]):
                    problem = (f"its bytes at {loc.offset}..{loc.offset + loc.nbytes} differ from those read at load "
                               f"(checksum {now:08x}, {then:08x} when loaded)")
        if problem is not None:
            error = ExpertFileError(
                f"{loc.path}: expert {expert} of {layer} cannot be read as the server loaded it: {problem}. The file "
                "no longer holds the weights being served: requests that need one of its experts not already on the "
                "device fail, the others are still served; restart the server to load the checkpoint as it is now")
            if loc.path not in self._reported:
                self._reported.add(loc.path)
                logger.error("%s", error)
            raise error

    def _changed(self, path: str) -> str | None:
        """What changed about the file the path names since load (None: nothing). The path, not the open
        descriptor: a file replaced or removed is the checkpoint changing, even though the descriptor would
        still read the old bytes."""
        try:
            now = FileIdentity.of(os.stat(path))
        except FileNotFoundError:
            return "the file was removed"
        except OSError as e:
            return f"it cannot be looked up ({e.strerror or type(e).__name__})"
        return self._identity[path].change(now)
