"""`ladle serve`: the OpenAI-compatible server, its flags, and a uvicorn server with a graceful SIGTERM.

    python -m ladle.entrypoints.server --model DIR [engine flags] [--host 127.0.0.1] [--port 8000]

Heavy imports (torch, transformers, FastAPI) happen in cmd_serve, so registering the subcommand costs `ladle`
next to nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

import uvicorn

if TYPE_CHECKING:
    from ladle.entrypoints.openai_app import ServerState

logger = logging.getLogger("ladle.server")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from ladle.entrypoints.cli import add_engine_flags

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint dir, as in `vllm serve MODEL` (or --model)")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the demo model, built on first use)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model dir)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model argument as given, as vLLM names it)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 when this many requests are already waiting (default: unbounded)")
    p.add_argument("--engine-max-failures", type=int, default=5,
                   help="engine deaths in a row before the supervisor gives up (default 5)")
    p.add_argument("--engine-restart-backoff", type=float, default=1.0,
                   help="seconds before the second restart in a row; doubles after (default 1; the first is at once)")
    p.add_argument("--engine-startup-timeout", type=float, default=600.0,
                   help="seconds an engine may take to load and plan (default 600)")
    p.add_argument("--engine-hang-timeout", type=float, default=300.0,
                   help="an engine that answers no ping for this long is killed and restarted (default 300)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish; the rest then end with a 503 "
                        "(default 30)")
    p.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: $LADLE_API_KEY, "
                        "else none); /health and /metrics stay open")
    p.add_argument("--max-request-body-bytes", type=int, default=4 * 2**20,
                   help="answer 413 to a larger request body, before reading it (default 4 MiB)")
    p.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="prompts one /v1/completions request may batch (default 256)")
    p.add_argument("--max-choices-per-request", type=int, default=512,
                   help="prompts x n one request may ask for (default 512)")
    add_engine_flags(p)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `ladle` command's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)
    return p


def _positive(name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def server_state(args: argparse.Namespace, reserved_cpus: int, before_imports: Any = None) -> ServerState:
    """From `ladle serve`'s flags: the engine client, its engine process already starting, and everything the
    app serves with. reserved_cpus: CPUs the engine leaves to this process (and pins itself beside; 0 pins
    nothing). before_imports: called once the engine process is starting, before the heavy imports."""
    from ladle.engine.async_client import AsyncEngineClient, SupervisorConfig
    from ladle.entrypoints.cli import engine_args_from_flags
    from ladle.entrypoints.metrics import ServerMetrics

    _check_serve_flags(args)
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
    engine_args, explicit = engine_args_from_flags(args, args.model_tag or args.model)
    engine_args = dataclasses.replace(engine_args, reserved_cpus=reserved_cpus)
    model = engine_args.model
    # As vLLM names it: the model argument as given, so a client sending --model's value finds it.
    name = args.served_model_name or args.model_tag or args.model or os.path.basename(os.path.normpath(model))
    if before_imports is not None:
        before_imports()
    metrics = ServerMetrics(name)
    supervision = SupervisorConfig(
        max_consecutive_failures=args.engine_max_failures, restart_backoff_s=args.engine_restart_backoff,
        startup_timeout_s=args.engine_startup_timeout, hang_timeout_s=args.engine_hang_timeout,
        max_queue_len=args.max_queue_len,
    )
    client = AsyncEngineClient(engine_args, explicit, supervision, args.log_level, on_snapshot=metrics.on_snapshot)
    client.prestart()  # the engine imports and loads while this process imports the server's libraries

    from transformers import AutoTokenizer

    from ladle.entrypoints.edge import EdgeLimits
    from ladle.entrypoints.openai_app import ServerState
    from ladle.entrypoints.serving_engine import ServingContext, ServingLimits
    from ladle.entrypoints.tokenizer_pool import TokenizerPool

    tokenizer = AutoTokenizer.from_pretrained(engine_args.tokenizer or model)
    limits = ServingLimits(args.max_prompts_per_request, args.max_choices_per_request)
    ctx = ServingContext(client, tokenizer, TokenizerPool(tokenizer), metrics, name, limits)
    return ServerState(ctx, model, EdgeLimits(args.api_key, args.max_request_body_bytes))


def cmd_serve(args: argparse.Namespace) -> int:
    from ladle.entrypoints.openai_app import build_app

    socks: list[socket.socket] = []
    # One CPU for this process (HTTP, tokenizing, detokenizing, streaming), unless the threads are set; a port
    # in use fails before anything loads.
    state = server_state(args, 1, lambda: socks.append(_listen(args.host, args.port)))
    sock, client, name = socks[0], state.client, state.ctx.model_name
    verbose = args.access_log or args.log_level == "DEBUG"
    config = uvicorn.Config(build_app(state), log_level="info" if verbose else "warning",
                            access_log=args.access_log, timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(config, state, args.shutdown_timeout)
    client.set_on_fatal(server.fail)
    host, port = sock.getsockname()[:2]
    print(f"ladle: serving {name!r} on http://{args.host}:{port}/v1 (pid {os.getpid()}); "
          f"GET /health turns 200 once the engine has loaded", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if server.error is not None:
        raise server.error
    return 0


def _check_serve_flags(args: argparse.Namespace) -> None:
    _positive("--max-queue-len", args.max_queue_len, allow_none=True)
    _positive("--engine-max-failures", args.engine_max_failures)
    _positive("--engine-startup-timeout", args.engine_startup_timeout)
    _positive("--engine-hang-timeout", args.engine_hang_timeout)
    _positive("--shutdown-timeout", args.shutdown_timeout)
    _positive("--max-request-body-bytes", args.max_request_body_bytes)
    _positive("--max-prompts-per-request", args.max_prompts_per_request)
    _positive("--max-choices-per-request", args.max_choices_per_request)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key (or LADLE_API_KEY) is empty; give a key or leave it unset")
    if args.engine_restart_backoff < 0:
        raise ValueError(f"--engine-restart-backoff must be >= 0, got {args.engine_restart_backoff}")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port (0 picks a free "
                      "one)") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM drains: new requests get 503 while in-flight ones finish (up to a
    timeout), then it stops and the process exits 0. A second signal, or SIGINT, stops at once."""

    def __init__(self, config: Any, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.error: Exception | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Unlike uvicorn's, this does not re-raise the signal after shutdown: a drained stop exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None and self.started:
            self.state.edge.draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self.should_exit:
            self.force_exit = True
        else:
            self.should_exit = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        edge, client = self.state.edge, self.state.client
        logger.warning("SIGTERM: answering 503 to new requests; finishing %d in flight (up to %g s)",
                       edge.in_flight, self.drain_timeout_s)
        deadline = time.monotonic() + self.drain_timeout_s
        while edge.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if edge.in_flight:
            logger.warning("%d requests still in flight after %g s; ending them with 503", edge.in_flight,
                           self.drain_timeout_s)
            client.closed = True
            client.fail_in_flight(f"the server is shutting down and this request did not finish within "
                                  f"--shutdown-timeout ({self.drain_timeout_s:g} s)", "server_shutting_down")
            # Let their responses (a 503 envelope, or an error event and [DONE]) be written before stopping.
            flush_deadline = time.monotonic() + 5
            while edge.in_flight and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.02)
        self.should_exit = True

    def fail(self, reason: str, user_error: bool) -> None:
        """The first engine could not start: stop the server; cmd_serve raises the reason (exit 2 for a bad
        setting or checkpoint path, 1 for anything else)."""
        self.error = ValueError(reason) if user_error else RuntimeError(reason)
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    from ladle.entrypoints.cli import add_log_level, report_error

    parser = argparse.ArgumentParser(prog="python -m ladle.entrypoints.server",
                                     description="OpenAI-compatible server over the ladle engine")
    add_log_level(parser, "INFO")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return cmd_serve(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 -- one line and an exit code, as `ladle serve`
        return report_error(e, args.log_level == "DEBUG")


if __name__ == "__main__":
    sys.exit(main())
