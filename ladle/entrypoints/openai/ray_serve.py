"""Data-parallel replicas of `ladle serve` behind one OpenAI endpoint, on Ray Serve (the `ray` extra:
`pip install -e '.[ray]'`):

    ladle serve-replicas MODEL --num-replicas 2 [--port 8000] [every `ladle serve` flag]

Each replica is a Ray actor holding what `ladle serve` holds: its own supervised engine process (a
tensor-parallel group, with --tensor-parallel-size) behind ladle's OpenAI app, which Ray Serve's proxy routes
requests to; a replica restarts its engine as `ladle serve` does, and Ray restarts a replica that dies. On CUDA
each replica asks Ray for tensor_parallel_size GPUs; on CPU each runs its engine on an equal share of the
cores (OMP_NUM_THREADS), unpinned, since replicas share the machine.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
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


class LadleReplica:
    """A Ray Serve deployment class: its ingress is replica_app, so every route is ladle's own."""


def ladle_application(argv: list[str], num_replicas: int, gpus_per_replica: int, threads_per_replica: int) -> Any:
    """The Ray Serve application of num_replicas ladle replicas, each serving `ladle serve` argv."""
    from ray import serve

    def build() -> Any:  # a plain function: Ray Serve calls builders in the replica, and takes other callables
        return replica_app(argv)  # for ASGI apps

    ingress = serve.ingress(build)(LadleReplica)
    options: dict[str, Any] = {"num_cpus": 0 if gpus_per_replica else threads_per_replica,
                               "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads_per_replica)}}}
    if gpus_per_replica:
        options["num_gpus"] = gpus_per_replica
    return serve.deployment(name="ladle", num_replicas=num_replicas, ray_actor_options=options,
                            max_ongoing_requests=1024, health_check_period_s=10)(ingress).bind()


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    from ladle.entrypoints.openai.serve_args import add_serve_arguments

    p.add_argument("--num-replicas", type=int, default=2, help="ladle servers behind the endpoint (default 2)")
    p.add_argument("--ray-address", default="local",
                   help="a Ray cluster to join, or 'local' (default) to start one on this machine")
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
        if name in ("--num-replicas", "--ray-address", "--host", "--port"):
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
        app = ladle_application(replica_argv(args.argv), args.num_replicas, tp if on_gpu else 0, threads)
        serve.run(app, name="ladle", route_prefix="/", blocking=False)
        print(f"ladle: {args.num_replicas} replicas serving on http://{args.host}:{args.port}/v1 through Ray "
              f"Serve (pid {os.getpid()})", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
