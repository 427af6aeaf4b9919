"""A loopback-only network namespace for the calling thread, so the agent CLIs and the server they talk to can reach
nothing beyond this machine (`unshare -n`, then `ip link set lo up`, done from Python so every process and thread
the caller starts inside, and the caller's own sockets, share it). Needs root (CAP_SYS_ADMIN), as CI has; without
it the caller gets an error, never a run with the network open."""
from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH14x"  # struct ifreq: the interface's name, then its flags


@contextmanager
def loopback_only() -> Iterator[None]:
    """Inside: the calling thread in a new network namespace whose one interface, lo, is up; after: back in its own.
    Processes started inside stay in the new namespace until they exit."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}; the agent client tests run the clients "
                                "in a loopback-only network namespace, which needs root (CAP_SYS_ADMIN)")
        try:
            _loopback_up()
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"setns back to the original network namespace: {os.strerror(code)}")
    finally:
        os.close(home)


def _loopback_up() -> None:
    """`ip link set lo up`: a new namespace's loopback starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def only_loopback_reachable() -> bool:
    """Whether this thread's namespace has no interface but lo."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]

