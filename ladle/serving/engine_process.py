"""The engine core in its own process: the loop the API server's supervisor starts, watches and restarts.

The API process talks to it over one duplex multiprocessing Pipe, in the frozen dataclasses of
ladle.serving.messages (AddRequest, AbortRequests, Ping, Shutdown in; Ready, StartupFailed, Added, Rejected,
Outputs, Pong, Fatal out).

A pipe, not a multiprocessing.Queue: a process killed while holding a Queue's lock can wedge the other side,
while a dead pipe peer reads as EOF, which is exactly the death signal the supervisor needs.

An input thread reads the pipe and answers pings itself, with the gauges of the last step and how long the
current one has run, so /health answers in milliseconds however long a step takes (an 8K-token CPU step runs
5 s). Torch ops and the C kernels release the GIL, and a Python-bound step yields it every switch interval.
The other messages queue for the loop, which applies them between steps.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ladle.config.engine_args import EngineArgs
from ladle.engine.core_output import EngineSnapshot
from ladle.request import RequestRejected
from ladle.serving import engine_handoff
from ladle.serving.messages import (
    AbortRequests,
    Added,
    AddRequest,
    EngineInfo,
    Fatal,
    FromEngine,
    Outputs,
    Ping,
    Pong,
    Ready,
    Rejected,
    Shutdown,
    StartupFailed,
    ToEngine,
)
from ladle.startup.cpu_lending import WINDOW_S

if TYPE_CHECKING:
    from ladle.engine.core import EngineCore
    from ladle.sampling_params import SamplingParams

logger = logging.getLogger("ladle.engine_process")

_MAX_MESSAGES_PER_STEP = 256
_MAX_DRAIN_STEPS = 16


@dataclass(frozen=True)
class _ReceiveFailed:
    """The input thread's last word, queued for the loop: EOF (the API went away) or a message it could not read."""
    error: BaseException


class EngineLoop:
    """Owns the core in the engine process: applies messages between steps, steps while there is work."""

    def __init__(self, core: EngineCore, conn: Connection, max_queue_len: int | None) -> None:
        self.core = core
        self.conn = conn
        self.max_queue_len = max_queue_len
        self._inbox: queue.SimpleQueue[ToEngine | _ReceiveFailed] = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # the loop and the input thread both send
        self._gauges = EngineSnapshot()  # as of the last step or message, for pongs
        self._step_started: float | None = None

    def send(self, msg: FromEngine) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def run(self) -> None:
        self._gauges = self.core.snapshot()
        threading.Thread(target=self._receive, name="ladle-engine-input", daemon=True).start()
        while True:
            if not self.core.has_unfinished_requests() and not self._handle(self._wait_idle()):
                return
            # Bounded, so a flood of messages cannot starve the requests already running.
            for _ in range(_MAX_MESSAGES_PER_STEP):
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if not self._handle(msg):
                    return
            if self.core.has_unfinished_requests():
                self._step_started = time.monotonic()
                try:
                    outputs = self.core.step()
                finally:
                    self._step_started = None
                self._gauges = self.core.snapshot()
                if outputs:
                    self.send(Outputs(outputs, self._gauges))
            else:
                self._gauges = self.core.snapshot()

    def _wait_idle(self) -> ToEngine | _ReceiveFailed:
        """Sleep until the API sends something (no busy spin), waking once a window to keep the lender's
        reading of the CPUs' load current."""
        while self.core.lender is not None:
            try:
                return self._inbox.get(timeout=WINDOW_S)
            except queue.Empty:
                self.core.lender.observe()
        return self._inbox.get()

    def _receive(self) -> None:
        """The input thread: pings answered here, everything else queued for the loop."""
        try:
            while True:
                msg = self.conn.recv()
                if isinstance(msg, Ping):
                    started = self._step_started
                    running = time.monotonic() - started if started is not None else 0.0
                    self.send(Pong(msg.ping_id, dataclasses.replace(self._gauges, step_running_s=running)))
                    continue
                self._inbox.put(msg)
                if isinstance(msg, Shutdown):
                    return
        except BaseException as e:  # noqa: BLE001 -- EOF (the API went away) or an undecodable message
            self._inbox.put(_ReceiveFailed(e))

    def _handle(self, msg: ToEngine | _ReceiveFailed) -> bool:
        """Apply one message; False means shut down."""
        if isinstance(msg, AddRequest):
            self._add(msg.parent_id, [list(p) for p in msg.prompts], msg.params, msg.checkpoint_marks,
                      msg.session_id)
        elif isinstance(msg, AbortRequests):
            outputs = self.core.abort_requests(list(msg.child_ids))
            if outputs:
                self.send(Outputs(outputs, self.core.snapshot()))
        elif isinstance(msg, Shutdown):
            return False
        elif isinstance(msg, _ReceiveFailed):
            raise msg.error
        else:
            logger.error("unknown message %r from the API process; ignored", type(msg).__name__)
        return True

    def _add(self, parent_id: str, prompts: list[list[int]], params: SamplingParams,
             marks: tuple[int, ...] = (), session_id: str | None = None) -> None:
        """All children of one API request are admitted together, or none is."""
        if self.max_queue_len is not None and self.core.snapshot().num_waiting >= self.max_queue_len:
            self.send(Rejected(parent_id, "queue_full",
                               f"the server's queue is full ({self.max_queue_len} requests waiting); retry later"))
            return
        try:
            requests = self.core.make_requests(parent_id, prompts, params, marks, session_id)
        except RequestRejected as e:
            self.send(Rejected(parent_id, e.code, str(e)))
            return
        except (ValueError, TypeError) as e:
            self.send(Rejected(parent_id, "invalid_request", str(e)))
            return
        except Exception as e:  # noqa: BLE001 -- a request the engine cannot make is refused, never fatal
            logger.error("could not make request %s; refusing it", parent_id, exc_info=e)
            self.send(Rejected(parent_id, "internal_error",
                               f"the engine could not take this request ({type(e).__name__}); the server log has "
                               f"the details under request id {parent_id}"))
            return
        added: list[str] = []
        try:
            for req in requests:
                self.core.add_request(req)
                added.append(req.request_id)
        except ValueError as e:
            self.core.abort_requests(added)
            self.send(Rejected(parent_id, "invalid_request", str(e)))
            return
        self.send(Added(parent_id))



def run_engine_process(args: EngineArgs, explicit: frozenset[str], conn: Connection,
                       max_queue_len: int | None, log_level: str,
                       handoff: engine_handoff.Handoff | None = None) -> None:
    """Entry point of the spawned engine process. handoff: where it waits for the next API process when this
    one goes away (ladle.serving.engine_handoff); without it, the engine exits with its API process."""
    # Ctrl-C, or a closed terminal's SIGHUP, signals the whole process group; the API process owns shutdown
    # (it drains), so the engine ignores them and stops when told (or when the pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s[engine]: %(message)s")
    listener = None
    if handoff is not None:
        os.setsid()  # out of the API process's group, which its supervisor kills when the API process dies
        listener = engine_handoff.listen(handoff.path)
    try:
        from ladle.engine.core import EngineCore
        from ladle.startup.allocator import tune_malloc

        if not tune_malloc():
            logger.info("malloc left at its defaults (no glibc mallopt here)")
        core = EngineCore(args, explicit)
    except BaseException as e:  # noqa: BLE001 -- any load failure is reported to the supervisor, then exit
        # The API process prints the one-line reason; the traceback is for --log-level DEBUG.
        logger.debug("engine startup failed:\n%s", traceback.format_exc())
        user_error = isinstance(e, (ValueError, TypeError, FileNotFoundError))
        _send_quietly(conn, StartupFailed(str(e) if user_error else f"{type(e).__name__}: {e}", user_error))
        os._exit(1)
    core.model_executor.on_failure(_exit_on_rank_death)
    cfg = core.config
    info = EngineInfo(os.getpid(), cfg.max_model_len, cfg.num_kv_blocks, cfg.block_size, core.hf_config.vocab_size,
                      cfg.table(), core.kv.checkpointing, tuple(sorted(core.eos_token_ids)))
    while True:
        try:
            conn.send(Ready(info))  # again to each API process that adopts it
            EngineLoop(core, conn, max_queue_len).run()
            core.shutdown()
            return
        except (EOFError, BrokenPipeError, ConnectionResetError):
            if listener is None or handoff is None:  # both None or neither
                logger.warning("the API process went away; the engine process exits")
                return
        except BaseException as e:  # noqa: BLE001 -- the supervisor restarts us; tell it why first
            logger.error("engine loop failed:\n%s", traceback.format_exc())
            _send_quietly(conn, Fatal(f"{type(e).__name__}: {e}"))
            os._exit(1)
        conn.close()
        num_aborted = _abort_everything(core)
        logger.warning("the API process went away; its %d requests aborted; waiting up to %g s for the next one",
                       num_aborted, engine_handoff.ADOPT_WAIT_S)
        adopted = engine_handoff.accept(listener, handoff, engine_handoff.ADOPT_WAIT_S)
        if adopted is None:
            logger.warning("no API process came for this engine within %g s; the engine process exits",
                           engine_handoff.ADOPT_WAIT_S)
            core.shutdown()
            return
        conn = adopted
        logger.info("a new API process adopted this engine")


def _abort_everything(core: EngineCore) -> int:
    """The dead API process's requests, ended and their KV freed (a step launched ahead is run out first, as
    after any abort); how many there were."""
    ids = list(core.scheduler.requests)
    core.abort_requests(ids)
    for _ in range(_MAX_DRAIN_STEPS):
        if not core.has_unfinished_requests():
            break
        core.step()
    return len(ids)


def _exit_on_rank_death(reason: str) -> None:
    """A tensor-parallel rank died: this process exits too (its other ranks die with it), and the supervisor
    ends the requests in flight with an error and starts a new group, as for any engine death."""
    logger.error("%s; the engine process exits so the supervisor restarts the whole group", reason)
    os._exit(1)


def _send_quietly(conn: Connection, msg: FromEngine) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass
