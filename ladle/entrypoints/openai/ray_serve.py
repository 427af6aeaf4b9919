"""Data-parallel replicas of `ladle serve` behind one OpenAI endpoint, on Ray Serve (the `ray` extra:
`pip install -e '.[ray]'`):

    ladle serve-replicas MODEL --num-replicas 2 [--port 8000] [every `ladle serve` flag]

Each replica is a Ray actor holding what `ladle serve` holds: its own supervised engine process (a
tensor-parallel group, with --tensor-parallel-size) behind ladle's OpenAI app; a replica restarts its engine as
`ladle serve` does, and Ray restarts a replica that dies. Requests reach the replicas through one router replica
(LadleRouter) whose handle routes by session (ray_router, session_routing: a session's turns land where its
prefix is cached), or with --routing ray straight from Ray Serve's proxy (power of two choices). On CUDA
each replica asks Ray for tensor_parallel_size GPUs; on CPU each runs its engine on an equal share of the
cores (OMP_NUM_THREADS), unpinned, since replicas share the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ladle.startup.threads import usable_cpus


def replica_app(argv: list[str]) -> Any:
    """The ASGI app of one replica, built inside the replica's actor: `ladle serve`'s, over its own engine."""
    import logging

    from ladle.entrypoints.openai.api_server import server_state
    from ladle.entrypoints.openai.app import build_app
    from ladle.entrypoints.openai.serve_args import add_serve_arguments, check_serve_flags

    parser = argparse.ArgumentParser(prog="ladle serve-replicas (replica)")
    parser.add_argument("--log-level", type=str.upper, default="WARNING")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s[replica]: %(message)s")
    check_serve_flags(args)
    return build_app(server_state(args, reserved_cpus=0))


def tagged(app: Any) -> Any:
    """app, its HTTP answers naming the replica that served them (REPLICA_HEADER). A plain coroutine function, so
    that uvicorn's lifespan runner, which Ray Serve uses, takes it for ASGI 3."""

    async def tagged_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        from ray import serve

        tag = (REPLICA_HEADER.encode(), serve.get_replica_context().replica_id.unique_id.encode())

        async def send_tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), tag]}
            await send(message)

        await app(scope, receive, send_tagged)

    return tagged_app


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request the router deployment hands to an engine replica: its routing hint travels beside it (the
    session key as the call's Serve session_id, the prefix chain here) for the request router to read."""
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    prefix_chain: tuple[int, ...] = ()


REPLICA_HEADER = "x-ladle-replica"  # on every answer: which replica served it


class LadleReplica:
    """A Ray Serve deployment class whose ASGI app is `ladle serve`'s (every route ladle's own): Ray runs its
    lifespan (the engine's start and stop) and, with --routing ray, its proxy routes HTTP to it directly; with
    session routing the router deployment calls forward()."""

    def __init__(self, argv: list[str]) -> None:
        self._argv = argv
        self._app: Any = None

    def __serve_build_asgi_app__(self) -> Any:  # Ray Serve's late-bound ingress: called once, in the replica
        self._app = tagged(replica_app(self._argv))
        return self._app

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        """Serve request through ladle's app: yields (status, headers) and then the body's parts as the app sends
        them, so a server-sent event stream still streams. Closing the generator (the client left, and Ray cancels
        the call) is an http.disconnect to the app, which aborts the engine's request as a plain disconnect does."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
                 "headers": request.headers, "client": request.client, "server": None}
        sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await sent.put(message)

        async def run() -> None:
            try:
                await self._app(scope, receive, send)
            finally:
                await sent.put({"type": "ladle.done"})

        task = asyncio.create_task(run())
        try:
            while (message := await sent.get())["type"] != "ladle.done":
                if message["type"] == "http.response.start":
                    yield message["status"], message.get("headers", [])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            await task  # an exception the app raised before answering is the call's error
        finally:
            gone.set()
            if not task.done():
                await asyncio.wait({task}, timeout=5)  # the app answers the disconnect and aborts its request
                task.cancel()


class LadleRouter:
    """The router deployment: reads each request's session key and prefix (session_routing.routing_hint) and
    hands it to the engine deployment, whose request router (ray_router.SessionAffinityRouter) picks the replica;
    the answer streams back as the replica sends it. One replica of it holds the session map."""

    def __init__(self, engine: Any, max_body_bytes: int) -> None:
        self._engine = engine.options(stream=True, method_name="forward")
        self._max_body = max_body_bytes

    async def __call__(self, request: Any) -> Any:  # a Starlette Request (a plain HTTP deployment's argument)
        from starlette.responses import StreamingResponse

        from ladle.entrypoints.openai.session_routing import routing_hint

        parts, size = [], 0
        async for part in request.stream():
            parts.append(part)
            size += len(part)
            if size > self._max_body:  # past the limit the replica's edge answers 413 on what came
                break
        body = b"".join(parts)
        scope = request.scope
        headers = [(bytes(k), bytes(v)) for k, v in scope["headers"]]
        key, chain = routing_hint(scope["path"], {k.decode("latin-1"): v.decode("latin-1") for k, v in headers},
                                  body)
        client = scope.get("client")
        forwarded = ForwardedRequest(scope["method"], scope["path"], scope.get("query_string", b""), headers, body,
                                     tuple(client) if client else None, chain)
        engine = self._engine.options(session_id=key) if key else self._engine
        stream = engine.remote(forwarded)
        try:
            status, response_headers = await stream.__anext__()
        except BaseException:
            stream.cancel()
            raise

        async def answer() -> AsyncIterator[bytes]:
            try:
                async for part in stream:
                    yield part
            finally:
                stream.cancel()  # a no-op once the stream ended; else the client left: the replica's call stops

        response = StreamingResponse(answer(), status_code=status)
        response.raw_headers = list(response_headers)
        return response


def ladle_application(argv: list[str], num_replicas: int, gpus_per_replica: int, threads_per_replica: int,
                      routing: str = "session", max_body_bytes: int = 4 * 2**20) -> Any:
    """The Ray Serve application of num_replicas ladle replicas, each serving `ladle serve` argv; with routing
    "session", behind one router replica that sends a session's requests to one replica (ray_router), with "ray"
    reached straight from Ray's proxy (its default power-of-two-choices routing)."""
    from ray import serve

    from ladle.entrypoints.openai.ray_router import ROUTER_PATH

    options: dict[str, Any] = {"num_cpus": 0 if gpus_per_replica else threads_per_replica,
                               "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads_per_replica)}}}
    if gpus_per_replica:
        options["num_gpus"] = gpus_per_replica
    config: dict[str, Any] = dict(name="ladle", num_replicas=num_replicas, ray_actor_options=options,
                                  max_ongoing_requests=1024, health_check_period_s=10)
    if routing == "ray":
        return serve.deployment(**config)(serve.ingress()(LadleReplica)).bind(argv)
    engine = serve.deployment(**config, request_router_config={"request_router_class": ROUTER_PATH})(
        serve.ingress()(LadleReplica)).bind(argv)
    router = serve.deployment(name="ladle-router", num_replicas=1, max_ongoing_requests=100_000,
                              ray_actor_options={"num_cpus": 0})(LadleRouter)
    return router.bind(engine, max_body_bytes)


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    from ladle.entrypoints.openai.serve_args import add_serve_arguments

    p.add_argument("--num-replicas", type=int, default=2, help="ladle servers behind the endpoint (default 2)")
    p.add_argument("--ray-address", default="local",
                   help="a Ray cluster to join, or 'local' (default) to start one on this machine")
    p.add_argument("--routing", choices=("session", "ray"), default="session",
                   help="session (default): a session's requests go to the replica that served it (prompt_cache_key, "
                        "metadata.user_id, session headers; else the longest routed prefix), through one router "
                        "replica; ray: Ray Serve's proxy routes straight to the replicas (power of two choices)")
    add_serve_arguments(p)


def replica_argv(argv: list[str]) -> list[str]:
    """The flags each replica's `ladle serve` gets: everything typed after the subcommand, less what only the
    launcher reads."""
    out, skip = [], False
    for token in argv[argv.index("serve-replicas") + 1:]:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in ("--num-replicas", "--ray-address", "--routing", "--host", "--port"):
            skip = "=" not in token
            continue
        out.append(token)
    return out


def cmd_serve_replicas(args: argparse.Namespace) -> int:
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("serve-replicas needs Ray Serve: pip install -e '.[ray]'") from None
    tp = getattr(args, "tensor_parallel_size", 1)
    on_gpu = str(getattr(args, "device", "auto")).startswith("cuda")
    threads = max(1, len(usable_cpus()) // (args.num_replicas * tp))
    local = args.ray_address == "local"
    # A local instance stays on loopback and on this machine's CPUs; a cluster is the user's to configure.
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True,
             _node_ip_address="127.0.0.1" if local else None,  # None, as num_cpus's: ray.init's defaults
             num_cpus=len(usable_cpus()) if local else None)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = ladle_application(replica_argv(args.argv), args.num_replicas, tp if on_gpu else 0, threads,
                                args.routing, args.max_request_body_bytes)
        serve.run(app, name="ladle", route_prefix="/", blocking=False)
        print(f"ladle: {args.num_replicas} replicas serving on http://{args.host}:{args.port}/v1 through Ray "
              f"Serve, {args.routing} routing (pid {os.getpid()})", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
