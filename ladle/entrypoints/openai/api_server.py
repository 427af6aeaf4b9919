"""`ladle serve`: the OpenAI-compatible server, a uvicorn server that drains on SIGTERM or SIGHUP.

    python -m ladle.entrypoints.openai.api_server --model DIR [engine flags] [--host 127.0.0.1] [--port 8000]

Heavy imports (torch, transformers, FastAPI) happen in cmd_serve, so registering the subcommand costs `ladle`
next to nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from ladle.entrypoints.openai.api_supervisor import ApiSupervisor, engine_handoff, inherited_socket

if TYPE_CHECKING:
    from ladle.entrypoints.openai.app import ServerState

logger = logging.getLogger("ladle.server")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `ladle` command's subparsers."""
    from ladle.entrypoints.openai.serve_args import add_http_arguments, add_serve_arguments

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(p)
    add_http_arguments(p)
    p.set_defaults(func=cmd_serve)
    return p


def server_state(args: argparse.Namespace, reserved_cpus: int) -> ServerState:
    """From `ladle serve`'s flags (checked with check_serve_flags): the engine client, its engine process
    already starting, and everything the app serves with. reserved_cpus: CPUs the engine leaves to this
    process (and pins itself beside; 0 pins nothing)."""
    from ladle.entrypoints.cli_args import engine_args_from_flags
    from ladle.entrypoints.openai.metrics import ServerMetrics
    from ladle.serving.async_client import AsyncEngineClient, SupervisorConfig

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
    engine_args, explicit = engine_args_from_flags(args, args.model_tag or args.model)
    engine_args = dataclasses.replace(engine_args, reserved_cpus=reserved_cpus)
    model = engine_args.model
    # The directory's name, not its path: clients see it (/v1/models, 404s, /metrics' labels) and need no view of
    # the server's disk. A client sending the path as given, as vLLM's do, is still served (app.check_model).
    name = args.served_model_name or os.path.basename(os.path.abspath(model))
    metrics = ServerMetrics(name)
    supervision = SupervisorConfig(
        max_consecutive_failures=args.engine_max_failures, restart_backoff_s=args.engine_restart_backoff,
        max_backoff_s=args.engine_max_backoff, startup_timeout_s=args.engine_startup_timeout,
        hang_timeout_s=args.engine_hang_timeout, max_queue_len=args.max_queue_len, engine_handoff=engine_handoff(),
    )
    client = AsyncEngineClient(engine_args, explicit, supervision, args.log_level, on_snapshot=metrics.on_snapshot)
    client.prestart()  # the engine imports and loads while this process imports the server's libraries

    from ladle.entrypoints.openai.app import ServerState
    from ladle.entrypoints.openai.chat.serving import chat_template_problem
    from ladle.entrypoints.openai.chat.settings import architecture, resolve_chat_settings
    from ladle.entrypoints.openai.edge import EdgeLimits
    from ladle.entrypoints.openai.serving_engine import ServingContext, ServingLimits
    from ladle.entrypoints.openai.tokenizer_pool import TokenizerPool
    from ladle.structured_output.checker import GrammarChecker
    from ladle.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine_args.tokenizer or model)
    if (problem := chat_template_problem(tokenizer)) is not None:
        logger.warning("the chat template does not parse (%s): /v1/chat/completions answers 500 until it is fixed",
                       problem)
    limits = ServingLimits(args.max_prompts_per_request, args.max_choices_per_request, args.max_stop_strings,
                           args.max_stop_chars, args.max_logprobs_per_request)
    chat = resolve_chat_settings(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice,
                                 args.chat_template, architecture(model),
                                 args.structured_outputs_enable_in_reasoning)
    logger.info("chat settings:\n%s", chat.report())
    ctx = ServingContext(client, tokenizer, TokenizerPool(tokenizer), metrics, name, limits, chat,
                         grammars=GrammarChecker(workers=args.grammar_workers, timeout_s=args.grammar_compile_timeout))
    return ServerState(ctx, EdgeLimits(args.api_key, args.max_request_body_bytes, args.timeout_request_body))


def cmd_serve(args: argparse.Namespace) -> int:
    from ladle.entrypoints.openai.http_protocol import GuardedConfig, http_guard
    from ladle.entrypoints.openai.serve_args import check_serve_flags

    check_serve_flags(args)
    guard, connections = http_guard(args)
    sock = inherited_socket()
    if sock is None:
        # Bound and listening before anything loads (FastAPI alone takes 0.8 s to import): a second server on
        # the same port fails here, at once. This process keeps it and runs the API process beneath.
        return ApiSupervisor(_listen(args.host, args.port), sys.orig_argv).run()
    faulthandler.enable()  # a native crash leaves its Python stack in the log before the supervisor restarts us
    from ladle.entrypoints.openai.app import build_app

    # One CPU for this process (HTTP, tokenizing, detokenizing, streaming), unless the threads are set.
    state = server_state(args, 1)
    client, name, metrics = state.client, state.ctx.model_name, state.ctx.metrics
    guard.on_refused, guard.on_head_timeout = metrics.connections_refused.inc, metrics.head_timeouts.inc
    guard.on_stall = metrics.stalled_responses.inc
    verbose = args.access_log or args.log_level == "DEBUG"
    config = GuardedConfig(build_app(state), guard, log_level="info" if verbose else "warning",
                           access_log=args.access_log, timeout_graceful_shutdown=5, lifespan="on",
                           timeout_keep_alive=args.timeout_keep_alive)
    server = DrainingServer(config, state, args.shutdown_timeout)
    client.set_on_fatal(server.fail)
    _host, port = sock.getsockname()[:2]
    logger.info("connections: %s; request heads within %g s, keep-alive %g s, stalled responses aborted after "
                "%g s", connections, args.timeout_request_head, args.timeout_keep_alive, args.stream_stall_timeout)
    print(f"ladle: serving {name!r} on http://{args.host}:{port}/v1 (pid {os.getpid()}); "
          f"GET /health turns 200 once the engine has loaded", file=sys.stderr, flush=True)
    # As vLLM does: what startup allocated (torch, transformers, the tokenizer) is moved out of the collector's
    # sight, so a full collection while big answers are being built walks their objects only (it stalled the
    # event loop for 300-400 ms under a logprobs request).
    gc.freeze()
    server.run(sockets=[sock])
    if server.error is not None:
        raise server.error
    return 0


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # Listening at once: two sockets merely bound to one port (SO_REUSEADDR) both succeed, so without it a
        # second server would load a whole engine before failing.
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port (0 picks a free "
                      "one)") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM and SIGHUP drain: new requests get 503 while in-flight ones finish (up to
    a timeout), then it stops and the process exits 0. A second signal, or SIGINT, stops at once."""

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
        originals = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM,
                                                                          signal.SIGHUP)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        # SIGHUP (the terminal went away, or a process manager's reload) drains like SIGTERM rather than
        # cutting every stream at once, as its default action would.
        if sig in (signal.SIGTERM, signal.SIGHUP) and not self.state.draining and self._loop is not None \
                and self.started:
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
        logger.warning("draining: answering 503 to new requests; finishing %d in flight (up to %g s)",
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
    from ladle.entrypoints.cli_args import add_log_level, report_error

    parser = argparse.ArgumentParser(prog="python -m ladle.entrypoints.openai.api_server",
                                     description="OpenAI-compatible server over the ladle engine")
    from ladle.entrypoints.openai.serve_args import add_http_arguments, add_serve_arguments

    add_log_level(parser, "INFO")
    add_serve_arguments(parser)
    add_http_arguments(parser)
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
