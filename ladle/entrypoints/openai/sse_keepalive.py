"""An event stream that is never silent for long: an SSE comment line goes out whenever no event has for a while.

A client that sees no byte for some minutes takes the stream for dead: Claude Code aborts a stream silent for
5 minutes (CLAUDE_STREAM_IDLE_TIMEOUT_MS, 300 s at least) and sends the request again, which starts the same work
over. ladle is silent until the first token (message_start reports the prefix cache's share, known only then), so a
long prefill on a CPU was retried forever; and a tool call's input goes out whole when the call closes, so a long
call was silent as long as it took to write. Every SSE parser skips comment lines (the OpenAI and Anthropic SDKs,
Codex's and OpenCode's), so they change nothing a client reads."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

KEEPALIVE = ": keepalive\n\n"
KEEPALIVE_S = 15.0  # well inside any client's idle limit, and rare enough to cost nothing


async def with_keepalive(events: AsyncIterator[str], interval: float = KEEPALIVE_S) -> AsyncIterator[str]:
    """events as they come, and KEEPALIVE after each interval seconds without one. Closing this closes events
    (their cleanup runs: a client that hung up frees its request)."""
    it = events.__aiter__()
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # closed while an event was awaited: its generator's cleanup runs on cancel
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
