"""Rank 0's side of tensor parallelism: the executor that starts ranks 1..N-1 (one process each), sends them
every step's plain payload, and watches them. The runners know nothing of it: each rank's runs the same forward,
whose collectives pair up, and rank 0's alone samples.

The control path is one socket pair per rank (rank 0 pickles a step once and writes the bytes to each), the
tensors go over torch.distributed. A rank that dies is noticed three ways: its socket reads EOF, rank 0's next
collective raises (gloo reports the closed connection), and a watcher thread per rank reports its exit at once,
so an idle server restarts its group without waiting for a request to fail. A rank never outlives rank 0: it
asks the kernel for SIGKILL when its parent dies (ladle.executor.tp_worker).
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ladle.config.engine_args import EngineArgs
from ladle.config.provenance import resolve_device
from ladle.distributed.parallel_state import (
    COLLECTIVE_TIMEOUT,
    SINGLE,
    check_no_process_group,
    close_tensor_parallel,
    init_tensor_parallel,
)
from ladle.executor.executor import Executor, FatalStepError
from ladle.runner.payload import ChunkSpec, NewTokens, PendingStep, SampledToken, StateUpdate, new_tokens
from ladle.startup.setup import build_runner, load_and_plan

logger = logging.getLogger("ladle")


@dataclass(frozen=True)
class RankSetup:
    """What a new rank is told first: how to load and plan, and where to meet the others."""
    args: EngineArgs
    explicit: frozenset[str]
    rank: int
    world_size: int
    store_port: int
    log_level: str


@dataclass(frozen=True)
class RunStep:
    """One step for the other ranks: the tokens rank 0 sampled in the last step (they sample none themselves),
    the StateUpdates since, then the step's chunks."""
    new_tokens: dict[str, NewTokens]
    updates: list[StateUpdate]
    specs: list[ChunkSpec]


@dataclass(frozen=True)
class StopRank:
    pass


class TensorParallelError(FatalStepError):
    """A rank died or failed mid-step: the group cannot go on."""


class WorkerGroup:
    """Ranks 1..world_size-1, started at construction; rank 0 is the caller's process."""

    def __init__(self, args: EngineArgs, explicit: frozenset[str], world_size: int, log_level: str) -> None:
        self.store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                                wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        self.failure: str | None = None  # why a rank is gone, once one is
        self.on_death: Callable[[str], None] | None = None  # called from a watcher thread when a rank dies
        self.closing = False
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "ladle.executor.tp_worker", str(theirs.fileno()),
                                     str(os.getpid())], pass_fds=[theirs.fileno()])
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(RankSetup(args, explicit, rank, world_size, self.store.port, log_level))
            self.conns.append(conn)
            self.procs.append(proc)
            threading.Thread(target=self._watch, args=(rank, proc), name=f"ladle-tp-watch-{rank}",
                             daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.closing:
            return
        self.failure = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        logger.error("%s", self.failure)
        if self.on_death is not None:
            self.on_death(self.failure)

    def send(self, message: RunStep | StopRank) -> int:
        """Pickle message once and write it to every rank; returns its size in bytes."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise TensorParallelError(f"a tensor-parallel rank is gone ({e})") from None
        return len(data)

    def close(self, timeout: float = 10.0) -> None:
        """Tell every rank to stop, wait for it, and kill any that does not."""
        self.closing = True
        try:
            self.send(StopRank())
        except TensorParallelError:
            pass
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()


def _release_group(workers: WorkerGroup) -> None:
    workers.close()
    close_tensor_parallel()


class TensorParallelExecutor(Executor):
    """Ranks 1..N-1 start at construction and load beside this process (rank 0): load_and_plan runs on every
    rank at once, and the ranks agree on one plan."""

    def __init__(self, args: EngineArgs, explicit: frozenset[str]) -> None:
        check_no_process_group()
        level = logging.getLevelName(logger.getEffectiveLevel())
        self.workers = WorkerGroup(args, explicit, args.tensor_parallel_size, level)
        # Stopped and left on shutdown(), when the executor is collected, or at interpreter exit.
        self._release = weakref.finalize(self, _release_group, self.workers)
        self.tp = SINGLE
        try:
            self.tp = init_tensor_parallel(0, args.tensor_parallel_size, self.workers.store.port,
                                           resolve_device(args.device).type, self.workers.store)
            loaded = load_and_plan(args, explicit, self.tp)
        except BaseException:
            self.shutdown()
            raise
        self._adopt(loaded, build_runner(loaded.model, loaded.config))
        self.updates: list[StateUpdate] = []  # applied here since the last step, shipped with the next
        self.new_tokens: dict[str, NewTokens] = {}  # the last step's sampled tokens, shipped with the next
        # What shipping the steps cost rank 0 (benchmarks/tensor_parallel.py reports it per step).
        self.broadcasts, self.broadcast_bytes, self.broadcast_s = 0, 0, 0.0

    def apply(self, update: StateUpdate) -> None:
        super().apply(update)
        if update:
            self.updates.append(update)

    def execute(self, specs: list[ChunkSpec]) -> dict[str, SampledToken]:
        """Ship the step (the StateUpdates since the last one, then its chunks) to the other ranks, run rank 0's
        shard of the forward beside theirs, and sample from the gathered logits; the sampled tokens join rank
        0's requests now and the other ranks' with the next step."""
        start = time.perf_counter()
        self.broadcast_bytes += self.workers.send(RunStep(self.new_tokens, self.updates, specs))
        self.broadcast_s += time.perf_counter() - start
        self.broadcasts += 1
        self.updates, self.new_tokens = [], {}
        try:
            step = self.runner.forward(specs)
        except Exception as e:  # noqa: BLE001 -- whatever it was, the ranks are left at different collectives
            why = self.workers.failure or f"{type(e).__name__}: {e}"
            raise TensorParallelError(f"the tensor-parallel forward failed on rank 0 ({why})") from e
        # Sampling has no collectives: a failure there leaves the group in step, and the step may be retried.
        sampled = self.runner.sample(specs, step)
        self.new_tokens = new_tokens(specs, sampled)
        self.runner.append(self.new_tokens)
        return sampled

    def launch(self, specs: list[ChunkSpec], input_ids: torch.Tensor | None = None) -> PendingStep | None:
        """None: async scheduling is off under tensor parallelism, so every step ships through execute()."""
        return None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        if self.workers.failure is not None:
            callback(self.workers.failure)
        self.workers.on_death = callback

    def shutdown(self) -> None:
        self._release()
        self.tp = SINGLE
