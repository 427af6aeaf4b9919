"""CPU threads as a setting with provenance: how many threads torch runs the model with, and why.

torch's thread team meets at a barrier after every parallel op, so a team spanning every core waits for its
slowest thread each time another process (the API server's, a neighbour's) takes one of those cores. Measured
here (BENCHMARKS.md, "CPU threads under load"): 2 threads are 1.4x faster than 1 on a quiet 2-core machine,
but 3.9x slower than themselves beside one busy process (2.4x with each thread bound to a core, as vLLM binds),
while 1 thread does not slow down. The default is every CPU this process may use, less those reserved for
ladle's other processes: `ladle serve` reserves one for its API process and pins its engine to the rest. On a
shared machine, set num_threads below the free cores.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ladle.config import EngineArgs, Provenance


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset also narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def resolve_threads(args: EngineArgs, prov: Provenance) -> int:
    cpus = usable_cpus()
    if args.num_threads is not None:
        if args.num_threads > len(cpus):
            raise ValueError(f"num_threads={args.num_threads} exceeds the {len(cpus)} CPUs this process may use; "
                             f"set num_threads <= {len(cpus)}")
        return prov.put("num_threads", args.num_threads)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:  # the user's environment, as given (OpenMP binding may narrow our mask)
        return prov.put("num_threads", int(env), "OMP_NUM_THREADS")
    reserved = min(args.reserved_cpus, len(cpus) - 1)
    reason = f"the {len(cpus)} CPUs this process may use" + (
        f", less {reserved} for the API process" if reserved else "")
    return prov.put("num_threads", len(cpus) - reserved, reason)


def apply_threads(num_threads: int, device: torch.device, pin: bool) -> None:
    """Run torch with num_threads threads; with pin, also keep this process on its first num_threads CPUs,
    so the OS moves other work (the API process) to the reserved ones instead of preempting a thread the
    rest of the team waits for. Only a process ladle owns is pinned (the server's engine process): an
    offline LLM runs in its caller's process, whose affinity is the caller's business."""
    import torch

    if device.type != "cpu":
        return
    torch.set_num_threads(num_threads)
    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, usable_cpus()[:num_threads])
