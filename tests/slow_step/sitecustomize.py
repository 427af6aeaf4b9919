"""Put on PYTHONPATH by tests that need an engine step of seconds on a tiny model: in the engine process only,
EngineCore.step first spins in Python, holding the GIL (the worst case for the engine's input thread), for
LADLE_TEST_SLOW_STEP_S seconds whenever the step's waiting or running requests hold a prompt of at least
LADLE_TEST_SLOW_STEP_TOKENS tokens."""
import os
import sys
import time

if os.environ.get("LADLE_TEST_SLOW_STEP_S") and "multiprocessing" in " ".join(sys.argv):
    from ladle.engine.core import EngineCore

    _seconds = float(os.environ["LADLE_TEST_SLOW_STEP_S"])
    _tokens = int(os.environ.get("LADLE_TEST_SLOW_STEP_TOKENS", "1000"))
    _step = EngineCore.step

    def _slow_step(self):  # type: ignore[no-untyped-def]
        sched = self.scheduler
        if any(len(r.prompt_token_ids) >= _tokens and r.num_computed_tokens < len(r.prompt_token_ids)
               for r in [*sched.waiting, *sched.running]):
            end = time.monotonic() + _seconds
            while time.monotonic() < end:
                sum(range(1000))
        return _step(self)

    EngineCore.step = _slow_step
