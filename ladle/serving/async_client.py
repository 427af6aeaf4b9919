"""API-side client of the supervised engine process: submits requests, routes their outputs to per-request
queues, answers pings, and ends every in-flight request at once when the engine process dies."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ladle.config.engine_args import EngineArgs
from ladle.engine.core_output import EngineCoreOutput, EngineSnapshot
from ladle.request import RequestRejected, child_request_ids
from ladle.sampling_params import SamplingParams
from ladle.serving.messages import (
    AbortRequests,
    Added,
    AddRequest,
    EngineInfo,
    FromEngine,
    Outputs,
    Ping,
    Pong,
    Ready,
    Rejected,
)
from ladle.serving.path_redactor import PathRedactor
from ladle.serving.supervisor import EngineProcess, EngineState, EngineSupervisor, SupervisorConfig

__all__ = ["AsyncEngineClient", "EngineDeadError", "EngineState", "EngineUnavailableError", "RequestHandle",
           "SupervisorConfig"]

logger = logging.getLogger("ladle.async_client")


class EngineUnavailableError(RuntimeError):
    """No engine can take the request now (starting, restarting, failed, stopping, or not answering)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine process died (or the server is stopping) while the request was in flight."""

    def __init__(self, message: str, code: str = "engine_restarting") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RequestHandle:
    request_id: str
    child_ids: list[str]
    generation: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # EngineCoreOutput | EngineDeadError
    accepted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    unfinished: set[str] = field(default_factory=set)


class AsyncEngineClient:
    def __init__(self, args: EngineArgs, explicit: frozenset[str], config: SupervisorConfig,
                 log_level: str = "WARNING",
                 on_snapshot: Callable[[int, EngineSnapshot], None] | None = None) -> None:
        self.supervisor = EngineSupervisor(args, explicit, config, log_level, self._on_message, self._on_dead,
                                           self.ping)
        self.on_snapshot = on_snapshot
        self.model_path = args.model  # as given: clients may send it as the model's name, but never see it
        # What clients see of a failure names no file of the server's (the supervisor logs the whole text).
        self._redact = PathRedactor.of({"<model>": args.model, "<tokenizer>": args.tokenizer})
        self.snapshot = EngineSnapshot()
        self._requests: dict[str, RequestHandle] = {}
        self._child_to_parent: dict[str, str] = {}
        self._pings: dict[int, asyncio.Future] = {}
        self._ping_ids = itertools.count()
        self.closed = False  # shutting down: no new request is taken

    # ---- state, for /health and /metrics ----
    @property
    def state(self) -> EngineState:
        return self.supervisor.state

    @property
    def failure_reason(self) -> str | None:
        """Why the last engine died, for clients: paths replaced by <model>, <tokenizer> or <path>."""
        reason = self.supervisor.failure_reason
        return self._redact(reason) if reason is not None else None

    @property
    def num_restarts(self) -> int:
        return self.supervisor.num_restarts

    @property
    def info(self) -> EngineInfo | None:
        proc = self.supervisor.current
        return proc.info if proc is not None else None

    @property
    def engine_pid(self) -> int | None:
        proc = self.supervisor.current
        return proc.pid if proc is not None else None

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def set_on_fatal(self, callback: Callable[[str, bool], None]) -> None:
        self.supervisor.on_fatal = callback

    # ---- lifecycle ----
    def prestart(self) -> None:
        """Start the engine process before the event loop (see EngineSupervisor.prestart)."""
        self.supervisor.prestart()

    def start(self) -> None:
        self.supervisor.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.supervisor.stopping = True
        self.fail_in_flight("the server is shutting down", "server_shutting_down")
        await self.supervisor.stop(timeout)

    # ---- requests ----
    def _ready_engine(self) -> EngineProcess:
        proc = self.supervisor.current
        if self.state is not EngineState.READY or proc is None or self.supervisor.stopping or self.closed:
            raise self.unavailable_error()
        return proc

    async def add_request(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                          checkpoint_marks: tuple[int, ...] = (), session_id: str | None = None) -> RequestHandle:
        """Submit one API request: n engine requests per prompt (all or none; ids by child_request_ids);
        returns once the engine accepted them. Raises RequestRejected (bad request, queue full),
        EngineUnavailableError or EngineDeadError."""
        proc = self._ready_engine()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        handle = RequestHandle(request_id, child_request_ids(request_id, len(prompts) * params.n), proc.number)
        handle.unfinished = set(handle.child_ids)
        self._requests[request_id] = handle
        for cid in handle.child_ids:
            self._child_to_parent[cid] = request_id
        proc.send(AddRequest(request_id, prompts, params, checkpoint_marks, session_id))
        try:
            await handle.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the client went away before the engine answered
            raise
        except BaseException:
            self._unregister(request_id)
            raise
        return handle

    def abort(self, request_id: str, child_ids: list[str] | None = None) -> None:
        """Abort a request (or some of its children), freeing their KV blocks in the engine. Idempotent."""
        handle = self._requests.get(request_id)
        if handle is None:
            return
        targets = [c for c in (child_ids if child_ids is not None else handle.child_ids) if c in handle.unfinished]
        for cid in targets:
            handle.unfinished.discard(cid)
            self._child_to_parent.pop(cid, None)
        if not handle.unfinished:
            self._unregister(request_id)
        proc = self.supervisor.current
        if targets and proc is not None and proc.number == handle.generation:
            proc.send(AbortRequests(tuple(targets)))

    async def ping(self, timeout: float) -> EngineSnapshot:
        """A round trip to the engine loop; raises EngineUnavailableError if it does not answer in time."""
        proc = self._ready_engine()
        ping_id = next(self._ping_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = fut
        proc.send(Ping(ping_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, EngineDeadError):
            raise EngineUnavailableError(f"the engine did not answer a ping within {timeout:g} s",
                                         "engine_unresponsive") from None
        finally:
            self._pings.pop(ping_id, None)

    def unavailable_error(self) -> EngineUnavailableError:
        if self.supervisor.stopping or self.closed:
            return EngineUnavailableError("the server is shutting down", "server_shutting_down")
        if self.state is EngineState.FAILED:
            at = self.supervisor.next_restart_at
            when = f"in {max(0.0, at - time.monotonic()):.0f} s" if at is not None else "now"
            limit = self.supervisor.config.max_consecutive_failures
            return EngineUnavailableError(f"the engine failed {limit} or more times in a row; the server tries "
                                          f"again {when}. Last failure: {self.failure_reason}",
                                          "engine_dead")
        if self.state is EngineState.STARTING:
            return EngineUnavailableError("the engine is starting; retry shortly", "engine_starting")
        return EngineUnavailableError("the engine is restarting; retry shortly", "engine_restarting")

    # ---- from the engine, on the event loop ----
    def _on_message(self, proc: EngineProcess, msg: FromEngine) -> None:
        if isinstance(msg, Outputs):
            self._set_snapshot(proc, msg.snapshot)
            self._dispatch(msg.outputs)
        elif isinstance(msg, Pong):
            self._set_snapshot(proc, msg.snapshot)
            fut = self._pings.get(msg.ping_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.snapshot)
        elif isinstance(msg, (Added, Rejected)):
            handle = self._requests.get(msg.parent_id)
            if handle is None or handle.accepted.done():
                return
            if isinstance(msg, Added):
                handle.accepted.set_result(None)
            else:
                handle.accepted.set_exception(RequestRejected(msg.message, code=msg.code))
        elif isinstance(msg, Ready):
            self._set_snapshot(proc, EngineSnapshot(num_kv_blocks=msg.info.num_kv_blocks))

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            parent = self._child_to_parent.get(out.request_id)
            if parent is None:
                continue  # aborted on our side already
            handle = self._requests[parent]
            if out.error is not None:  # it reaches the client: a file the engine could not read is named, not placed
                out = replace(out, error=self._redact(out.error))
            handle.queue.put_nowait(out)
            if out.finish_reason is not None:
                handle.unfinished.discard(out.request_id)
                del self._child_to_parent[out.request_id]
                if not handle.unfinished:
                    self._unregister(parent)

    def _set_snapshot(self, proc: EngineProcess, snap: EngineSnapshot) -> None:
        self.snapshot = snap
        if self.on_snapshot is not None:
            self.on_snapshot(proc.number, snap)

    def _on_dead(self, proc: EngineProcess) -> None:
        self.fail_in_flight(f"{self._redact(proc.exit_reason())}; the server is restarting it")
        self._set_snapshot(proc, EngineSnapshot())

    def fail_in_flight(self, reason: str, code: str = "engine_restarting") -> None:
        """End every request in flight with this error, and abort them in the engine (a no-op when it died)."""
        err = EngineDeadError(reason, code)
        proc = self.supervisor.current
        live = proc if proc is not None and not proc.dead.is_set() else None
        children = [c for h in self._requests.values() if live is not None and h.generation == live.number
                    for c in h.unfinished]
        if live is not None and children:
            live.send(AbortRequests(tuple(children)))
        for handle in self._requests.values():
            if not handle.accepted.done():
                handle.accepted.set_exception(err)
            handle.queue.put_nowait(err)
        self._requests.clear()
        self._child_to_parent.clear()
        for fut in self._pings.values():
            if not fut.done():
                fut.set_exception(err)

    def _unregister(self, request_id: str) -> None:
        handle = self._requests.pop(request_id, None)
        if handle is not None:
            for cid in handle.child_ids:
                self._child_to_parent.pop(cid, None)
