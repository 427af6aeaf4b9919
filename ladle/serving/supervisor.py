"""Starts the engine process, notices when it dies, and starts a new one, with backoff and a give-up point.

One engine process at a time (a "generation"). Two threads per generation move messages over its pipe so the
event loop never blocks on it: the reader hands each message to the loop, the writer sends in order. The
reader's EOF is the death signal, whatever the cause (SIGKILL, the OOM killer, an error in a step).
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ladle.config.engine_args import EngineArgs
from ladle.serving.engine_handoff import AdoptedProcess, Handoff, adopt
from ladle.serving.engine_process import run_engine_process
from ladle.serving.messages import EngineInfo, Fatal, FromEngine, Ready, Shutdown, StartupFailed, ToEngine

logger = logging.getLogger("ladle.supervisor")


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"  # too many failures in a row: retried every max_backoff_s until one starts
    STOPPED = "stopped"


@dataclass
class SupervisorConfig:
    max_consecutive_failures: int = 5
    restart_backoff_s: float = 1.0  # the first restart is at once; later ones in a row wait 1, 2, 4, ... s
    max_backoff_s: float = 30.0
    startup_timeout_s: float = 600.0
    stable_uptime_s: float = 30.0  # a death after this much uptime starts a new failure streak
    hang_timeout_s: float = 300.0  # an engine silent this long to pings is killed (no step is this long)
    watchdog_interval_s: float = 5.0
    max_queue_len: int | None = None
    # Where an engine waits to be adopted when this API process dies, and where this one looks for such an
    # engine before starting its own (ladle.serving.engine_handoff); None: the engine dies with this process.
    engine_handoff: Handoff | None = None


AnyProcess = BaseProcess | AdoptedProcess  # an engine process spawned by this API process, or one it adopted


class EngineProcess:
    """One generation: the process, its pipe, and the two threads that talk over it."""

    def __init__(self, number: int, process: AnyProcess, conn: Connection) -> None:
        self.number, self.process, self.conn = number, process, conn
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.dead = asyncio.Event()
        self.info: EngineInfo | None = None
        self.ready_at: float | None = None
        self.error: str | None = None  # what the engine said before dying, if anything
        self.user_error = False  # it failed to start because of a bad setting or checkpoint

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # the process is started before it is wrapped
        return pid

    def send(self, msg: ToEngine | None) -> None:  # None: the writer's stop
        self.outbox.put(msg)

    def writer(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return

    def reader(self, loop: asyncio.AbstractEventLoop, on_message: Callable, on_dead: Callable) -> None:
        try:
            while True:
                loop.call_soon_threadsafe(on_message, self, self.conn.recv())
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 -- an undecodable message: treat the engine as gone
            logger.exception("bad message from engine process %d; killing it", self.pid)
            self.process.kill()
        try:
            loop.call_soon_threadsafe(on_dead, self)
        except RuntimeError:
            pass  # the loop is closed: the server is gone

    async def close(self, timeout: float) -> None:
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            logger.warning("engine process %d did not stop within %g s; killing it", self.pid, timeout)
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5)
        self.send(None)
        self.conn.close()

    def exit_reason(self) -> str:
        code = self.process.exitcode
        if code is None:
            how = "closed its pipe"  # dead, but not reaped yet
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"engine process {self.pid} {how}" + (f": {self.error}" if self.error else "")


class EngineSupervisor:
    def __init__(self, args: EngineArgs, explicit: frozenset[str], config: SupervisorConfig, log_level: str,
                 on_message: Callable[[EngineProcess, FromEngine], None], on_dead: Callable[[EngineProcess], None],
                 ping: Callable[[float], Awaitable[Any]]) -> None:
        self.args, self.explicit, self.config, self.log_level = args, explicit, config, log_level
        self._on_engine_message, self._on_engine_dead, self._ping = on_message, on_dead, ping
        # The first engine cannot start: (reason, whether the user's input is at fault).
        self.on_fatal: Callable[[str, bool], None] | None = None
        self.state = EngineState.STARTING
        self.current: EngineProcess | None = None
        self.failure_reason: str | None = None  # why the last engine died (kept for /health)
        self.num_restarts = 0
        self.next_restart_at: float | None = None  # monotonic time of the next try, while waiting for it
        self.stopping = False
        self._task: asyncio.Task | None = None
        self._numbers = itertools.count(1)
        self._early: tuple[AnyProcess, Connection] | None = None  # a process started before the event loop
        # (prestart)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ladle-engine-supervisor")

    async def stop(self, timeout: float) -> None:
        self.stopping = True
        self.state = EngineState.STOPPED
        if self._task is not None:
            self._task.cancel()
        proc = self.current
        if proc is not None:
            proc.send(Shutdown())
            await proc.close(timeout)

    async def _run(self) -> None:
        streak = 0
        while not self.stopping:
            ready = False
            try:
                proc = await self._spawn()
            except Exception as e:  # noqa: BLE001 -- e.g. out of processes: a failure like any other
                logger.exception("could not start the engine process")
                self.failure_reason = f"could not start the engine process: {e}"
            else:
                ready = await self._wait_ready(proc)
                if ready:
                    self.state = EngineState.READY
                    logger.info("engine process %d is ready (generation %d)", proc.pid, proc.number)
                    watchdog = asyncio.create_task(self._watchdog(proc))
                    await proc.dead.wait()
                    watchdog.cancel()
                await proc.close(5)
                if self.stopping:
                    return
                self.failure_reason = proc.exit_reason()
                if proc.number == 1 and not ready:
                    # The first start failing is a configuration error (or a broken checkpoint): retrying
                    # cannot fix it, so the server ends with the reason instead of restarting.
                    self.state = EngineState.FAILED
                    logger.error("the engine cannot start: %s", proc.error or self.failure_reason)
                    if self.on_fatal is not None:
                        self.on_fatal(proc.error or self.failure_reason, proc.user_error)
                    return
                uptime = time.monotonic() - proc.ready_at if proc.ready_at is not None else 0.0
                if ready and uptime >= self.config.stable_uptime_s:
                    streak = 0
            streak += 1
            failed = streak >= self.config.max_consecutive_failures
            delay = self.config.max_backoff_s if failed else self._backoff(streak)
            if failed:
                # The cause may go away (open files exhausted by clients, memory taken by another process), so
                # the supervisor keeps trying, slowly; /health says failed, why, and when it tries next.
                self.state = EngineState.FAILED
                logger.error("%s; %d engine failures in a row: giving up on quick restarts, retrying every %g s. "
                             "The server stays up and reports unhealthy meanwhile.", self.failure_reason, streak,
                             delay)
            else:
                self.state = EngineState.RESTARTING
                logger.error("%s; restarting it in %.1f s (failure %d of %d in a row)", self.failure_reason,
                             delay, streak, self.config.max_consecutive_failures)
            self.num_restarts += 1
            self.next_restart_at = time.monotonic() + delay
            await asyncio.sleep(delay)
            self.next_restart_at = None

    def _backoff(self, streak: int) -> float:
        if streak <= 1:
            return 0.0
        return min(self.config.restart_backoff_s * 2 ** (streak - 2), self.config.max_backoff_s)

    def prestart(self) -> None:
        """Start the first engine process now, before the event loop runs, so it imports and loads while the
        API process is still importing; the supervisor takes it as its first generation. Where a dead API
        process left an engine waiting (config.engine_handoff), that engine is the first generation instead."""
        self._early = self._adopt() or self._start_process()

    def _adopt(self) -> tuple[AnyProcess, Connection] | None:
        handoff = self.config.engine_handoff
        found = adopt(handoff.path) if handoff is not None else None
        if found is None:
            return None
        conn, pid = found
        logger.warning("adopting engine process %d, left by the API process before this one", pid)
        return AdoptedProcess(pid), conn

    def _start_process(self) -> tuple[AnyProcess, Connection]:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited locks, CUDA-safe
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(target=run_engine_process, name="ladle-engine", daemon=True,
                              args=(self.args, self.explicit, child_conn, self.config.max_queue_len,
                                    self.log_level, self.config.engine_handoff))
        process.start()
        child_conn.close()  # else our copy keeps the pipe open and the child's death never reads as EOF
        return process, parent_conn

    async def _spawn(self) -> EngineProcess:
        early, self._early = self._early, None
        process, parent_conn = early if early is not None else await asyncio.to_thread(self._start_process)
        proc = EngineProcess(next(self._numbers), process, parent_conn)
        self.current = proc
        loop = asyncio.get_running_loop()
        threading.Thread(target=proc.reader, args=(loop, self._on_message, self._on_dead),
                         name=f"ladle-engine-reader-{proc.number}", daemon=True).start()
        threading.Thread(target=proc.writer, name=f"ladle-engine-writer-{proc.number}", daemon=True).start()
        return proc

    async def _wait_ready(self, proc: EngineProcess) -> bool:
        dead = asyncio.create_task(proc.dead.wait())
        try:
            await asyncio.wait({proc.ready, dead}, timeout=self.config.startup_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if proc.ready.done() and not proc.dead.is_set():
            return True
        if not proc.dead.is_set():
            proc.error = f"not ready within the startup timeout of {self.config.startup_timeout_s:g} s"
            proc.process.kill()
            await proc.dead.wait()
        return False

    async def _watchdog(self, proc: EngineProcess) -> None:
        """Pings are answered by the engine's input thread even while a step runs, so a hang is either no
        answer at all (the process is frozen) or one step running past the hang timeout."""
        timeout = self.config.hang_timeout_s
        while not proc.dead.is_set():
            await asyncio.sleep(self.config.watchdog_interval_s)
            try:
                snap = await self._ping(timeout)
            except Exception:  # noqa: BLE001 -- no answer, whatever the error
                hung = f"no answer to a ping in {timeout:g} s (hung); killed"
            else:
                if snap.step_running_s <= timeout:
                    continue
                hung = f"one step ran for {snap.step_running_s:.0f} s, past --engine-hang-timeout; killed"
            if self.current is proc and not proc.dead.is_set() and not self.stopping:
                proc.error = hung
                logger.error("engine process %d is hung (%s)", proc.pid, hung)
                proc.process.kill()
            return

    # ---- on the event loop, from the reader thread ----
    def _on_message(self, proc: EngineProcess, msg: FromEngine) -> None:
        if proc is not self.current or proc.dead.is_set():
            return  # a late message from an old generation
        if isinstance(msg, Ready):
            proc.info, proc.ready_at = msg.info, time.monotonic()
            proc.ready.set_result(None)
        elif isinstance(msg, (StartupFailed, Fatal)):
            proc.error = msg.reason
            proc.user_error = isinstance(msg, StartupFailed) and msg.user_error
        self._on_engine_message(proc, msg)

    def _on_dead(self, proc: EngineProcess) -> None:
        if proc.dead.is_set():
            return
        # The pipe closes a moment before the process can be reaped; wait that moment (bounded) so the
        # error every in-flight request gets can say how it died (e.g. "killed by SIGKILL").
        proc.process.join(0.1)
        proc.dead.set()
        if proc is not self.current:
            return
        if not self.stopping and self.state is not EngineState.FAILED:
            self.state = EngineState.RESTARTING
        self._on_engine_dead(proc)
