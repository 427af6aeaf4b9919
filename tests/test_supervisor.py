"""The supervisor with fake engine processes: a cause of failure that goes away (the open-file limit exhausted by
clients, say) never leaves the server failed for good, and a step past the hang timeout is killed although the
engine's input thread still answers pings."""
from __future__ import annotations

import asyncio
import multiprocessing
from typing import Any

from ladle.engine.core_output import EngineSnapshot
from ladle.serving.messages import EngineInfo, Ready
from ladle.serving.supervisor import EngineState, EngineSupervisor, SupervisorConfig


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode, self.killed = pid, None, False

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed, self.exitcode = True, -9


class FakeEngines:
    """_start_process for the supervisor: each start fails with `failures[i]` or gives a live fake engine."""

    def __init__(self, failures: list[BaseException | None]) -> None:
        self.failures = failures
        self.live: list[tuple[FakeProcess, Any]] = []  # (process, the engine's end of the pipe)

    def __call__(self) -> tuple[FakeProcess, Any]:
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        parent, child = multiprocessing.Pipe(duplex=True)
        proc = FakeProcess(1000 + len(self.live))
        child.send(Ready(EngineInfo(proc.pid, 64, 8, 16, 512, "")))
        self.live.append((proc, child))
        return proc, parent

    def die(self, index: int) -> None:
        proc, child = self.live[index]
        proc.exitcode = 1
        child.close()


async def wait_for_state(sup: EngineSupervisor, state: EngineState, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while sup.state is not state:
        assert asyncio.get_running_loop().time() < deadline, f"still {sup.state}, not {state}"
        await asyncio.sleep(0.01)


def make_supervisor(engines: FakeEngines, ping: Any = None, **config: Any) -> EngineSupervisor:
    async def no_ping(timeout: float) -> EngineSnapshot:
        return EngineSnapshot()

    sup = EngineSupervisor(None, frozenset(), SupervisorConfig(**config), "WARNING", lambda *a: None,
                           lambda *a: None, ping or no_ping)
    sup._start_process = engines  # type: ignore[method-assign]
    return sup


def test_failed_is_retried_until_the_cause_goes_away() -> None:
    # Engine 1 starts, then dies; three starts in a row fail as with exhausted file descriptors; the fourth
    # works. With two failures allowed, the supervisor is "failed" in between, and then serves again.
    emfile = OSError(24, "Too many open files")
    engines = FakeEngines([None, emfile, emfile, emfile])

    async def run() -> list[EngineState]:
        sup = make_supervisor(engines, max_consecutive_failures=2, restart_backoff_s=0.01, max_backoff_s=0.2)
        sup.start()
        await wait_for_state(sup, EngineState.READY)
        seen = []
        engines.die(0)
        await wait_for_state(sup, EngineState.FAILED)
        seen.append(sup.state)
        assert "Too many open files" in (sup.failure_reason or "")
        assert sup.next_restart_at is not None  # /health can say when the next try is
        await wait_for_state(sup, EngineState.READY)
        seen.append(sup.state)
        assert sup.current is not None and sup.current.pid == 1001
        await sup.stop(1)
        return seen

    assert asyncio.run(asyncio.wait_for(run(), 30)) == [EngineState.FAILED, EngineState.READY]
    assert len(engines.live) == 2 and not engines.failures


def test_a_step_past_the_hang_timeout_is_killed_though_pings_are_answered() -> None:
    engines = FakeEngines([None])
    running = [0.0]

    async def ping(timeout: float) -> EngineSnapshot:
        return EngineSnapshot(step_running_s=running[0])

    async def run() -> str:
        sup = make_supervisor(engines, ping, hang_timeout_s=2.0, watchdog_interval_s=0.02)
        sup.start()
        await wait_for_state(sup, EngineState.READY)
        running[0] = 1.5  # a long step, within the timeout: left alone
        await asyncio.sleep(0.2)
        proc = engines.live[0][0]
        assert not proc.killed
        running[0] = 2.5
        while not proc.killed:
            await asyncio.sleep(0.01)
        error = sup.current.error if sup.current is not None else ""
        await sup.stop(1)
        return error or ""

    error = asyncio.run(asyncio.wait_for(run(), 30))
    assert "one step ran for 2 s" in error or "one step ran for 3 s" in error, error
