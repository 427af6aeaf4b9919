"""Serving: TTFT / TPOT / ITL / e2e against request rate, for `ladle serve` started as a subprocess.

The server runs on 127.0.0.1 at a free port; each rate sends Poisson arrivals of random prompts (greedy,
ignore_eos, streaming /v1/completions, one fresh seed per rate) through ladle.entrypoints.bench.run_serve,
the client `ladle bench serve` uses. Each rate sends about rate x --seconds requests (at least --min-prompts),
so every point takes a bounded time. The server is stopped with SIGTERM at the end (it drains, then exits).

    python benchmarks/serve_sweep.py --rates 0.5 1 2 4 --seconds 40
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

from ladle.entrypoints.bench import format_summary, random_workload, run_serve  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int, flags: list[str], threads: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "serve", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    print("starting:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float, poll_s: float = 1.0) -> float:
    """Seconds until /health answers 200 (polled every poll_s)."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"the server was not healthy within {timeout_s} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-512")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=40.0, help="arrival window per rate")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    ap.add_argument("--server-flags", default="--max-num-batched-tokens 512 --max-model-len 2048",
                    help="engine flags for ladle serve")
    ap.add_argument("--out", default="serve_sweep")
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    vocab = model_facts(model_dir)["vocab_size"]
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"ladle-serve-{port}.log"
    proc = start_server(model_dir, port, args.server_flags.split(), args.threads, log)
    points: list[dict[str, Any]] = []
    try:
        startup = wait_healthy(port, proc, timeout_s=600)
        print(f"server healthy after {startup:.1f} s (log {log})", flush=True)
        base = f"http://127.0.0.1:{port}/v1"
        warm = random_workload(2, (32, 64), (4, 4), vocab, seed=-1)
        asyncio.run(run_serve(base, model_dir, warm, float("inf"), None, seed=-1))
        for i, rate in enumerate(args.rates):
            n = max(args.min_prompts, round(rate * args.seconds))
            workload = random_workload(n, tuple(args.input_len), tuple(args.output_len), vocab, seed=100 + i)
            result = asyncio.run(run_serve(base, model_dir, workload, rate, args.max_concurrency, seed=100 + i))
            result["num_prompts"] = n
            points.append(result)
            print(format_summary(f"rate {rate}/s, {n} requests", result), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    save(args.out, {"benchmark": "serve_sweep", "model": args.model_name, "model_config": model_facts(model_dir),
                    "server_flags": args.server_flags, "server_threads": args.threads,
                    "input_len": args.input_len, "output_len": args.output_len, "seconds": args.seconds,
                    "max_concurrency": args.max_concurrency, "server_startup_s": startup, "points": points})


if __name__ == "__main__":
    main()
