"""CPU threads as a setting with provenance: how many threads torch runs the model with, and why.

torch's thread team meets at a barrier after every parallel op, so a team spanning every core waits for its
slowest thread each time another process (the API server's, a neighbour's) takes one of those cores. Measured
here (BENCHMARKS.md, "CPU threads under load"): 2 threads are 1.4x faster than 1 on a quiet 2-core machine,
but 3.9x slower than themselves beside one busy process (2.4x with each thread bound to a core, as vLLM binds),
while 1 thread does not slow down. The default is every CPU this process may use, less those reserved for
ladle's other processes: `ladle serve` reserves one for its API process and binds each of its engine's threads
to one of the rest, as vLLM's CPU backend binds them, and lends the reserved one back to the engine's steps
while nothing else uses it (cpu_lending.py). On a shared machine, set num_threads below the free cores.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ladle.startup.cpu_lending import CpuLending, lending_reason

if TYPE_CHECKING:
    import torch

    from ladle.config.engine_args import EngineArgs
    from ladle.config.provenance import Provenance


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset also narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def resolve_threads(args: EngineArgs, prov: Provenance, ranks: int = 1) -> int:
    """ranks: tensor-parallel processes sharing this machine's CPUs; by default each gets an equal share."""
    cpus = usable_cpus()
    if args.num_threads is not None:
        if args.num_threads > len(cpus):
            raise ValueError(f"num_threads={args.num_threads} exceeds the {len(cpus)} CPUs this process may use; "
                             f"set num_threads <= {len(cpus)}")
        return prov.put("num_threads", args.num_threads)
    env = _env_threads()
    if env:  # the user's environment, as given (OpenMP binding may narrow our mask)
        return prov.put("num_threads", env, "OMP_NUM_THREADS")
    reserved = min(args.reserved_cpus, len(cpus) - 1)
    reason = f"the {len(cpus)} CPUs this process may use" + (
        f", less {reserved} for the API process" if reserved else "")
    if ranks > 1:
        reason += f", shared by {ranks} tensor-parallel ranks"
    return prov.put("num_threads", max(1, (len(cpus) - reserved) // ranks), reason)


def _env_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() else 0


def resolve_lending(args: EngineArgs, prov: Provenance, num_threads: int, pin: bool, ranks: int) -> CpuLending | None:
    """The reserved CPUs the engine may borrow (cpu_lending.py): only where ladle chose the thread count (an
    explicit one, or OMP_NUM_THREADS, is run exactly) and pinned the engine beside them."""
    lent = usable_cpus()[num_threads:]
    why = ("num_threads is explicit" if args.num_threads is not None else
           "OMP_NUM_THREADS is set" if _env_threads() else
           "tensor-parallel ranks share the CPUs" if ranks > 1 else
           "no CPU is reserved beside a pinned engine" if not pin or not lent else "")
    if why:
        prov.put("lent_cpus", "none", why)
        return None
    prov.put("lent_cpus", " ".join(map(str, lent)), lending_reason(lent))
    return CpuLending(num_threads, tuple(usable_cpus()[:num_threads] + lent))


def keep_lending(lending: CpuLending | None, model: torch.nn.Module, prov: Provenance) -> CpuLending | None:
    """Lending changes a step's thread count with the machine's load, so it is kept only for a model whose
    every kernel gives the same bits at any thread count. Mixture-of-experts layers add their experts' results
    with index_add_, whose float sums depend on the thread count (measured: qwen3-moe-512 and dsv4-512 float32
    logprobs differ between 1 and 2 threads; dense Qwen3 and Qwen3.5 do not)."""
    from ladle.models.layers.moe import FusedMoE

    if lending is None or not any(isinstance(m, FusedMoE) for m in model.modules()):
        return lending
    prov.put("lent_cpus", "none", "the model's mixture-of-experts sums differ by thread count; lending would let "
                                  "the machine's load change outputs")
    return None


def apply_threads(num_threads: int, device: torch.device, pin: bool, first: int = 0,
                  lending: CpuLending | None = None) -> list[int] | None:
    """Run torch with num_threads threads; with pin, also bind thread i of torch's OpenMP team to the i-th CPU
    this process may use (the API process gets the rest), so the OS moves other work to the reserved CPUs
    instead of preempting a thread the rest of the team waits for. Returns the CPU each thread is bound to
    (None when nothing was bound). Only a process ladle owns is pinned (the server's engine process): an
    offline LLM runs in its caller's process, whose affinity is the caller's business. first: the index of
    this process's first CPU (a tensor-parallel rank takes the rank-th share). With lending, the team holds a
    thread for each lent CPU too, bound now and run only when the lender says so."""
    import torch

    if device.type != "cpu":
        return None
    torch.set_num_threads(num_threads)
    if not pin or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = usable_cpus()[first:first + num_threads]
    os.sched_setaffinity(0, cpus)  # threads created from here on (the team's included) start inside the set
    if lending is None:
        return bind_openmp_threads(cpus)
    torch.set_num_threads(len(lending.cpus))
    bound = bind_openmp_threads(list(lending.cpus))
    torch.set_num_threads(num_threads)
    return bound


def bind_openmp_threads(cpus: list[int]) -> list[int] | None:
    """Bind OpenMP thread i of torch's team to cpus[i]: each team thread runs a ctypes callback through
    libgomp's own entry point for a parallel region, which sets that thread's affinity (pid 0 is the calling
    thread), as vLLM's init_cpu_threads_env does in C++. Returns the CPU of each thread's mask afterwards, or
    None when torch's OpenMP runtime is not libgomp (then the process-wide set above is all the binding)."""
    lib = _libgomp()
    if lib is None:
        return None
    bound = [-1] * len(cpus)

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def bind(_: int | None) -> None:
        i = lib.omp_get_thread_num()
        os.sched_setaffinity(0, [cpus[i]])
        bound[i] = min(os.sched_getaffinity(0))  # this thread's own mask, as the kernel now has it

    lib.GOMP_parallel(bind, None, len(cpus), 0)
    return bound


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already runs (torch's own copy), found in its memory map."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    if len(paths) != 1:
        return None
    lib = ctypes.CDLL(paths.pop())
    lib.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    lib.GOMP_parallel.restype = None
    return lib
