"""`ladle serve`'s outer process: it holds the listening socket and runs the API process as its child, starting a
new one when that child dies by a signal, as gunicorn's arbiter and uvicorn's multiprocess supervisor do.

The API process runs native code on client input (tokenizers, llguidance, jinja templates); whatever the
sandboxes miss, a SIGSEGV or the OOM killer there must not end the service. The socket stays bound and
listening here, so connections that arrive while a new API process starts wait in its backlog instead of
being refused. The engine outlives the API process (ladle.serving.engine_handoff): it aborts the dead process's
requests and waits, on a socket in a directory of this process's, for the new API process to adopt it, so a
restart costs the API process's own start (seconds), not the model's load. Requests in flight in the dead
process fail with it; anything else of its process group (grammar workers) is killed. This process is the
orphaned engine's subreaper, and kills whatever of it is left when it exits.

A child that exits by itself (0 after a drain, 1 or 2 for a failed startup) ends the server with its exit code:
only a death by a signal this process did not send is a crash. Restarts in a row back off (0, 1, 2, 4 ... up
to 30 s) unless the child lived 30 s; the server never gives up while it is not told to stop.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from ladle.serving.engine_handoff import Handoff

# The child finds its socket here (a file descriptor it inherited), and how many times it was restarted.
LISTEN_FD_ENV = "LADLE_LISTEN_FD"
RESTARTS_ENV = "LADLE_API_RESTARTS"
HANDOFF_ENV = "LADLE_ENGINE_HANDOFF"
_STABLE_S = 30.0
_MAX_BACKOFF_S = 30.0
_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def inherited_socket() -> socket.socket | None:
    """In the API process: the listening socket its supervisor passed down; None in the supervisor itself."""
    fd = os.environ.get(LISTEN_FD_ENV)
    return None if fd is None else socket.socket(fileno=int(fd))


def api_restarts() -> int:
    """In the API process: how many API processes died before this one."""
    return int(os.environ.get(RESTARTS_ENV, "0"))


def engine_handoff() -> Handoff | None:
    """In the API process: where its engine waits to be adopted if this process dies (None without a
    supervisor)."""
    path = os.environ.get(HANDOFF_ENV)
    return None if path is None else Handoff(path, os.getppid())


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (even by SIGKILL), so no API process is left
    serving on a socket nobody supervises; and a session of its own, so its process group is its alone."""
    import ctypes

    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the child then outlives a killed supervisor, as it did before this process existed


class ApiSupervisor:
    def __init__(self, sock: socket.socket, argv: list[str]) -> None:
        """sock: bound and listening; argv: the command that starts this server (sys.orig_argv), run again
        for each API process."""
        self.sock, self.argv = sock, argv
        self.handoff_dir = tempfile.mkdtemp(prefix="ladle-")  # 0700: no other user reaches the engine's socket
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self.restarts = 0

    def run(self) -> int:
        """Serve until the API process exits by itself or this process is told to stop; its exit code."""
        originals = {sig: signal.signal(sig, self._forward) for sig in _FORWARDED}
        _set_subreaper()
        try:
            return self._serve()
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
            _kill_children()
            shutil.rmtree(self.handoff_dir, ignore_errors=True)

    def _serve(self) -> int:
        failures_in_a_row = 0
        while True:
            started = time.monotonic()
            code = self._run_child()
            if code >= 0 or self.stopping:
                return code if code >= 0 else 128 - code
            lived = time.monotonic() - started
            failures_in_a_row = 1 if lived >= _STABLE_S else failures_in_a_row + 1
            backoff = 0.0 if failures_in_a_row == 1 else min(_MAX_BACKOFF_S, 2.0 ** (failures_in_a_row - 2))
            self.restarts += 1
            print(f"ladle: the API process died ({_signal_name(-code)}) after {lived:.1f} s; its requests in flight "
                  f"failed; starting a new one{f' in {backoff:g} s' if backoff else ''} (restart {self.restarts})",
                  file=sys.stderr, flush=True)
            deadline = time.monotonic() + backoff
            while not self.stopping and time.monotonic() < deadline:
                _reap()
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            if self.stopping:
                return 0

    def _run_child(self) -> int:
        env = {**os.environ, LISTEN_FD_ENV: str(self.sock.fileno()), RESTARTS_ENV: str(self.restarts),
               HANDOFF_ENV: os.path.join(self.handoff_dir, "engine.sock")}
        child = self.child = subprocess.Popen([sys.executable, *self.argv[1:]], env=env,
                                              pass_fds=(self.sock.fileno(),), preexec_fn=_die_with_parent)
        while True:  # as subreaper this process also reaps orphaned engines that exit
            try:
                pid, status = os.waitpid(-1, 0)
            except InterruptedError:
                continue
            except ChildProcessError:
                return child.returncode if child.returncode is not None else 1
            if pid == child.pid:
                child.returncode = os.waitstatus_to_exitcode(status)
                break
        # The grammar workers were the dead process's children: none outlives it (the engine has a session of
        # its own and waits to be adopted).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        return child.returncode

    def _forward(self, sig: int, frame: Any) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(sig)


def _set_subreaper() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _reap() -> None:
    """Collect exited orphans (engines nobody adopted), so none stays a zombie."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_children() -> None:
    """Kill whatever is left under this process (an engine still waiting to be adopted), then reap it."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
    time.sleep(0.05)
    _reap()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
