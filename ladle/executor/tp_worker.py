"""A tensor-parallel rank other than 0: `python -m ladle.executor.tp_worker FD PARENT_PID`, started by rank 0
(ladle.executor.tensor_parallel.WorkerGroup) with one end of a socket pair as FD.

It loads its shard and plans with the other ranks (ladle.startup.setup.load_and_plan, the same path as rank 0),
then runs each step rank 0 sends: append the tokens rank 0 sampled last step, apply the StateUpdates, run its
shard of the forward. Whatever goes wrong, it exits, which rank 0 notices; it never outlives rank 0.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from ladle.config.provenance import resolve_device
from ladle.distributed.parallel_state import close_tensor_parallel, init_tensor_parallel
from ladle.executor.tensor_parallel import RankSetup, StopRank
from ladle.runner.model_runner import ModelRunner
from ladle.startup.allocator import tune_malloc
from ladle.startup.setup import build_runner, load_and_plan

logger = logging.getLogger("ladle")

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits, however it exits (kill -9 included)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def serve_steps(conn: Connection, runner: ModelRunner) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if isinstance(message, StopRank):
            return
        runner.append(message.new_tokens)  # before the updates, which may remove or resend their requests
        for update in message.updates:
            runner.apply(update)
        runner.forward(message.specs)  # rank 0 samples from the logits this rank's collectives gather


def main(fd: int, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns shutdown
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    conn = Connection(fd)
    setup: RankSetup = conn.recv()
    rank = setup.rank
    logging.basicConfig(level=setup.log_level, format=f"%(levelname)s %(name)s[rank {rank}]: %(message)s")
    try:
        tune_malloc()
        tp = init_tensor_parallel(rank, setup.world_size, setup.store_port, resolve_device(setup.args.device).type)
        loaded = load_and_plan(setup.args, setup.explicit, tp)
        runner = build_runner(loaded.model, loaded.config)
        serve_steps(conn, runner)
        close_tensor_parallel()
    except BaseException:  # noqa: BLE001 -- rank 0 sees the exit; the log says why
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
