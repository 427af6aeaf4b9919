"""Which executor an engine runs its steps on: its own process, or a tensor-parallel group."""
from __future__ import annotations

from ladle.config.engine_args import EngineArgs
from ladle.executor.executor import Executor
from ladle.executor.tensor_parallel import TensorParallelExecutor


def create_executor(args: EngineArgs, explicit: frozenset[str]) -> Executor:
    return (TensorParallelExecutor if args.tensor_parallel_size > 1 else Executor)(args, explicit)
