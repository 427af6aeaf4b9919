"""An engine process that outlives its API process and is adopted by the next one.

`ladle serve`'s outer process restarts a dead API process (ladle.entrypoints.openai.api_supervisor). Loading an
engine takes seconds on a tiny model and minutes on a large one, so the engine does not die with the API process:
it listens on a Unix socket in a directory only this user can enter, and when its pipe to the API process reads
EOF it aborts the dead process's requests, frees their KV, and accepts one new connection, waiting up to
ADOPT_WAIT_S for it. The new API process connects before starting an engine of its own, and the engine answers
with Ready as a fresh one would. An engine nobody adopts in time exits.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

ADOPT_WAIT_S = 120.0  # longer than the outer process's longest restart backoff (30 s) plus a slow start
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class Handoff:
    path: str  # the engine's socket
    supervisor_pid: int  # `ladle serve`'s outer process: once it is gone no API process will come


def listen(path: str) -> socket.socket:
    """The engine's socket at path (a stale one from an earlier engine is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(1)
    return sock


def accept(sock: socket.socket, handoff: Handoff, timeout_s: float) -> Connection | None:
    """The next API process's connection, or None when none came within timeout_s or the supervisor that
    would start one is gone."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and _alive(handoff.supervisor_pid):
        sock.settimeout(min(1.0, left))
        try:
            peer, _ = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            return None
        peer.settimeout(None)
        return Connection(peer.detach())
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def adopt(path: str) -> tuple[Connection, int] | None:
    """In a new API process: a connection to the engine its predecessor left, and that engine's pid; None when
    no engine listens there (none was left, or it died)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        pid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
    except OSError:
        sock.close()
        return None
    return Connection(sock.detach()), pid


class AdoptedProcess:
    """An engine process another API process started: not this process's child, so it has no exit code here and
    is watched and signalled by pid (the Process methods the supervisor uses)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, IndexError):
            return False

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
