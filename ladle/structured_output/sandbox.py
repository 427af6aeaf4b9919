"""Client constraints compiled in worker processes, where a crash or a runaway compile costs one request.

llguidance is native code: a crafted schema overflows its stack (SIGSEGV) and no Python handler can catch
that, and a compile cannot be interrupted from Python. So every constraint a client sends is first compiled
by a worker process (ladle.structured_output.sandbox_worker) doing the engine's native work for it. A worker
that dies answers its request with a 400 saying the compiler crashed, and a new worker takes its place; one
that passes `timeout_s` on a compile is killed, and the request gets a 400 naming the limit. The engine then
compiles only constraints a worker compiled, with the same code, so the crash or the cost never reaches it.

Compile slots are shared fairly: each client (the server passes the peer's address) has its own queue, and a
free slot takes the first constraint of the client served longest ago, so a client sending many slow
constraints holds each other client back by at most one compile a slot.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.grammar import InvalidStructuredOutput
from ladle.structured_output.matcher import TokenizerSpec
from ladle.structured_output.sandbox_worker import read_message, write_message

logger = logging.getLogger("ladle.grammar_sandbox")

DEFAULT_WORKERS = 2
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_QUEUED = 256
_CLIENTS_REMEMBERED = 4096
TOKENIZER_TIMEOUT_S = 120.0  # a worker's one-time tokenizer build (about 2 s at a 150K vocabulary)


class SandboxBusy(RuntimeError):
    """More constraints wait for a compile slot than the sandbox queues: try again later (a 503)."""


class _Crashed(Exception):
    def __init__(self, returncode: int | None) -> None:
        super().__init__(returncode)
        self.returncode = returncode

    def describe(self) -> str:
        code = self.returncode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"


class _TimedOut(Exception):
    pass


class _TokenizerFailed(Exception):
    pass


@dataclass
class _Job:
    spec: StructuredOutputsParams
    future: cf.Future


class _Worker:
    """One worker process and what was sent to it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ladle.structured_output.sandbox_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.tokenizer: TokenizerSpec | None = None

    def call(self, message: Any, timeout_s: float) -> Any:
        """Send message, wait up to timeout_s for the answer; raises _TimedOut (the process is killed) or
        _Crashed (it died)."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            write_message(stdin, message)
        except (BrokenPipeError, OSError):
            raise _Crashed(self.proc.wait()) from None
        if not _readable(stdout, timeout_s):
            self.kill()
            raise _TimedOut
        answer = read_message(stdout)
        if answer is None:
            raise _Crashed(self.proc.wait())
        return answer

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _readable(stream: IO[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            ready, _, _ = select.select([stream], [], [], left)
        except InterruptedError:
            continue
        return bool(ready)


class GrammarSandbox:
    def __init__(self, workers: int = DEFAULT_WORKERS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        """workers: compile slots (a process each, started on first use); timeout_s: how long one compile may
        run before its worker is killed; max_queued: constraints waiting for a slot beyond which submit refuses
        (SandboxBusy)."""
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"a grammar sandbox needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.num_workers, self.timeout_s, self.max_queued = workers, timeout_s, max_queued
        self._cond = threading.Condition()
        self._queues: collections.OrderedDict[str, collections.deque[_Job]] = collections.OrderedDict()
        self._queued = 0
        # When each client was last served (a turn number): the one served longest ago goes next, so a client
        # whose compile is running waits behind every other client's first one.
        self._served: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._turns = 0
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []
        self._tokenizer: TokenizerSpec | None = None
        self._closed = False
        self.num_crashes = 0  # workers that died on a constraint
        self.num_timeouts = 0  # compiles killed at timeout_s

    def set_tokenizer(self, spec: TokenizerSpec) -> None:
        """From now on, compiles build the matcher for this tokenizer too (each worker is sent it once)."""
        with self._cond:
            self._tokenizer = spec

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    def submit(self, spec: StructuredOutputsParams, client: str = "") -> cf.Future:
        """A future of spec's grammar text; it raises InvalidStructuredOutput where the constraint does not
        compile, crashed the compiler or ran past timeout_s. Raises SandboxBusy at once when the queue is full."""
        future: cf.Future = cf.Future()
        with self._cond:
            if self._closed:
                raise SandboxBusy("the grammar sandbox is shut down")
            if self._queued >= self.max_queued:
                raise SandboxBusy(f"{self._queued} structured-output constraints are waiting to compile; "
                                  "try again shortly")
            self._queues.setdefault(client, collections.deque()).append(_Job(spec, future))
            self._queued += 1
            while len(self._threads) < self.num_workers:  # the slots start with the first constraint
                thread = threading.Thread(target=self._slot, name=f"ladle-grammar-slot-{len(self._threads)}",
                                          daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()
        return future

    def check(self, spec: StructuredOutputsParams, client: str = "") -> str:
        return self.submit(spec, client).result()

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.future.cancel()
            self._queues.clear()
            self._cond.notify_all()
            workers = list(self._workers)
        for w in workers:
            w.kill()

    def _next(self) -> _Job | None:
        """The next job: the first of the waiting client served longest ago (or never); None once shut down."""
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            client = min(self._queues, key=lambda c: self._served.get(c, -1))
            queue = self._queues[client]
            job = queue.popleft()
            self._queued -= 1
            if not queue:
                del self._queues[client]
            self._turns += 1
            self._served[client] = self._turns
            self._served.move_to_end(client)
            while len(self._served) > _CLIENTS_REMEMBERED:
                self._served.popitem(last=False)
            return job

    def _slot(self) -> None:
        worker: _Worker | None = None
        while (job := self._next()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                worker = worker if worker is not None and worker.proc.poll() is None else self._spawn()
                try:
                    grammar = self._compile(worker, job.spec)
                except _TokenizerFailed:
                    worker.kill()
                    worker = self._spawn()
                    grammar = self._compile(worker, job.spec)
                job.future.set_result(grammar)
            except _TimedOut:
                self.num_timeouts += 1
                worker = None
                job.future.set_exception(InvalidStructuredOutput(
                    _field(job.spec), f"did not compile within {self.timeout_s:g} s; this server stops compiling "
                    "a constraint after that (--grammar-compile-timeout): simplify it"))
            except _Crashed as e:
                self.num_crashes += 1
                worker = None
                logger.warning("the grammar compiler crashed (%s) on a request's %s; a new worker takes its "
                               "place", e.describe(), _field(job.spec))
                job.future.set_exception(InvalidStructuredOutput(
                    _field(job.spec), f"the grammar compiler crashed on this constraint ({e.describe()}); it "
                    "cannot be served: simplify it"))
            except Exception as e:  # noqa: BLE001 -- a broken worker fails its request, never the slot
                worker = None
                job.future.set_exception(e)
        if worker is not None:
            worker.kill()

    def _spawn(self) -> _Worker:
        worker = _Worker()
        with self._cond:
            self._workers = [w for w in self._workers if w.proc.poll() is None] + [worker]
        return worker

    def _compile(self, worker: _Worker, spec: StructuredOutputsParams) -> str:
        tokenizer = self._tokenizer
        if tokenizer is not None and worker.tokenizer is not tokenizer:
            try:
                worker.call(("tokenizer", tokenizer), TOKENIZER_TIMEOUT_S)
            except (_TimedOut, _Crashed) as e:
                # Not the client's doing: constraints are checked without the matcher build from now on, and
                # this one is tried again on a new worker (_slot), rather than failing.
                with self._cond:
                    self._tokenizer = None
                logger.warning("a grammar worker could not build the tokenizer (%s); constraints are checked "
                               "without it", type(e).__name__)
                raise _TokenizerFailed from None
            worker.tokenizer = tokenizer
        answer = worker.call(("compile", spec), self.timeout_s)
        if answer[0] == "invalid":
            raise InvalidStructuredOutput(answer[1], answer[2])
        return answer[1]


def _field(spec: StructuredOutputsParams) -> str:
    return f"structured_outputs.{spec.kind}"
