"""Serving latency beside vLLM: `ladle serve` and `vllm serve` on the same checkpoint and dtype, both up on this
machine and taking turns (never loaded at once), each measured at the same Poisson rates by two clients in turn: vLLM's own
`vllm bench serve` (random dataset, text prompts) and `ladle bench serve`'s client (random token-id prompts),
both streaming /v1/completions with greedy sampling and ignore_eos. Each server runs with its defaults apart
from the shared dtype, max_model_len and seed; its startup (launch to a healthy /health) is reported too.

vLLM lives in its own virtual environment (benchmarks/setup_vllm.sh); its CLI runs through
benchmarks/vllm_cli.py. Then:

    python benchmarks/vllm_serve_side_by_side.py --rates 0.5 1 --seconds 60
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402
from serve_sweep import free_port, wait_healthy  # noqa: E402

from ladle.entrypoints.bench import random_workload, run_serve  # noqa: E402

HERE = Path(__file__).resolve().parent
METRICS = ("ttft", "itl", "tpot", "e2el")


def server_command(engine: str, python: str, model: str, port: int, dtype: str, max_model_len: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
              "--seed", "0"]
    if engine == "ladle":
        return [python, "-m", "ladle.entrypoints.cli", "serve", model, *common]
    return [python, str(HERE / "vllm_cli.py"), "serve", model, *common]


def vllm_client(python: str, port: int, model: str, rate: float, num_prompts: int, input_len: tuple[int, int],
                output_len: tuple[int, int], seed: int, result_dir: Path) -> dict[str, Any]:
    """`vllm bench serve` against 127.0.0.1:port; its saved JSON, in the units ladle's client reports."""
    (lo, hi), (olo, ohi) = input_len, output_len
    mid, omid = (lo + hi) / 2, (olo + ohi) / 2
    ratio = (hi - lo) / (hi + lo)  # vLLM draws from [len*(1-r), len*(1+r)], one r for inputs and outputs
    if abs(ratio - (ohi - olo) / (ohi + olo)) > 1e-6:
        raise ValueError("vllm bench serve takes one range ratio: give input and output ranges of equal ratio")
    name = f"vllm_client_{port}_{rate}.json"
    cmd = [python, str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--dataset-name", "random",
           "--random-input-len", str(round(mid)), "--random-output-len", str(round(omid)),
           "--random-range-ratio", f"{ratio:.6f}", "--num-prompts", str(num_prompts), "--request-rate", str(rate),
           "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n"
                           f"{out.stderr[-2000:]}")
    raw = json.loads((result_dir / name).read_text())
    ours = {"ttft": "ttft_ms", "itl": "itl_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
    return {"completed": raw["completed"], "failed": raw["failed"], "duration_s": raw["duration"],
            "requests_per_s": raw["request_throughput"], "output_tok_per_s": raw["output_throughput"],
            "total_tok_per_s": raw["total_token_throughput"], "prompt_tokens": raw["total_input_tokens"],
            "output_tokens": raw["total_output_tokens"],
            **{ours[m]: {"mean": raw[f"mean_{m}_ms"], "median": raw[f"p50_{m}_ms"], "p99": raw[f"p99_{m}_ms"]}
               for m in METRICS}}


def ladle_client(port: int, model: str, rate: float, num_prompts: int, input_len: tuple[int, int],
                 output_len: tuple[int, int], vocab: int, seed: int) -> dict[str, Any]:
    work = random_workload(num_prompts, input_len, output_len, vocab, seed=seed)
    return asyncio.run(run_serve(f"http://127.0.0.1:{port}/v1", model, work, rate, None, seed=seed))


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine core is a child), then SIGKILL after a minute."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Server:
    """One server process under test: its command, port, log and launch-to-healthy time."""

    def __init__(self, engine: str, args: argparse.Namespace, model: str, tmp: Path) -> None:
        self.engine, self.port = engine, free_port()
        python = sys.executable if engine == "ladle" else args.vllm_python
        self.command = server_command(engine, python, model, self.port, args.dtype, args.max_model_len)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))
        self.log = tmp / f"{engine}_server.log"
        print("starting:", " ".join(self.command), flush=True)
        self.proc = subprocess.Popen(self.command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.startup_s = wait_healthy(self.port, self.proc, timeout_s=900)
        print(f"{engine} healthy after {self.startup_s:.1f} s", flush=True)

    def read_lending(self) -> None:
        """ladle's engine steps, and how many ran with the API process's CPU lent (from /metrics)."""
        self.lending: dict[str, float] = {}
        if self.engine != "ladle":
            return
        import httpx

        for line in httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=30).text.splitlines():
            for name in ("engine_steps_total", "engine_steps_with_lent_cpus_total"):
                if line.startswith(f"ladle:{name}{{"):
                    self.lending[name] = float(line.split()[-1])

    def summary(self) -> dict[str, Any]:
        keys = ("num_threads", "lent_cpus", "cpu_binding", "core ids", "reserved_cpus", "OMP_THREADS_BIND")
        threads = [line.strip() for line in self.log.read_text().splitlines() if any(k in line for k in keys)]
        return {"engine": self.engine, "command": " ".join(self.command), "startup_s": self.startup_s,
                "thread_settings": threads, "lending": self.lending}


def measure(servers: list[Server], args: argparse.Namespace, model: str, vocab: int, tmp: Path) -> list[dict]:
    """Every (rate, client) cell on every server back to back, the server order flipping from cell to cell, so
    the machine's drift over the run falls on both servers alike; the whole set args.repeats times, each
    repeat with prompts of its own (the servers' prefix caches would serve a repeated one). Before each cell a pause lets the other server go quiet: vLLM's
    CPU worker spins for about a second after its last step, and its idle loop polls (2-4% of a CPU)."""
    for server in servers:
        ladle_client(server.port, model, float("inf"), 2, (32, 64), (4, 4), vocab, seed=-1)  # warm-up
    points: list[dict[str, Any]] = []
    lens = (tuple(args.input_len), tuple(args.output_len))
    cell = 0
    for repeat, (i, rate) in ((k, x) for k in range(args.repeats) for x in enumerate(args.rates)):
        n = max(args.min_prompts, round(rate * args.seconds))
        for client in ("vllm", "ladle") if i % 2 == 0 else ("ladle", "vllm"):
            for server in servers if cell % 2 == 0 else servers[::-1]:
                time.sleep(args.settle_s)
                # Fresh prompts for each repeat: both servers cache prefixes, and a prompt seen before would
                # measure the cache instead of the prefill.
                seed = 100 + i + 1000 * repeat
                if client == "vllm":
                    r = vllm_client(args.vllm_python, server.port, model, rate, n, *lens, seed=seed, result_dir=tmp)
                else:
                    r = ladle_client(server.port, model, rate, n, *lens, vocab, seed=seed)
                r.update(server=server.engine, client=client, rate=rate, num_prompts=n, repeat=repeat)
                points.append(r)
                print({k: r[k] for k in ("repeat", "server", "client", "rate", "completed", "failed", "ttft_ms",
                                         "itl_ms")},
                      flush=True)
            cell += 1
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-512")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (vLLM's CPU KV cache)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--seconds", type=float, default=60.0, help="arrival window per rate")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, nargs=2, default=[60, 540])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 144])
    ap.add_argument("--repeats", type=int, default=1, help="the report takes each cell's median over repeats")
    ap.add_argument("--settle-s", type=float, default=3.0, help="pause before each cell")
    ap.add_argument("--engines", nargs="+", default=["vllm", "ladle"], help="started in this order")
    ap.add_argument("--out", default="vllm_serve_side_by_side")
    args = ap.parse_args()
    model = build_model(args.model_name)
    vocab = model_facts(model)["vocab_size"]
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for engine in args.engines:  # all up at once, taking turns (see measure for what an idle one costs)
                servers.append(Server(engine, args, model, Path(tmp)))
            points = measure(servers, args, model, vocab, Path(tmp))
            for server in servers:
                server.read_lending()
        finally:
            for server in servers:
                stop(server.proc)
        summaries = [s.summary() for s in servers]
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    save(args.out, {"benchmark": "vllm_serve_side_by_side", "model": args.model_name, "vllm_version": version,
                    "model_config": model_facts(model), "dtype": args.dtype, "max_model_len": args.max_model_len,
                    "input_len": args.input_len, "output_len": args.output_len, "seconds": args.seconds,
                    "repeats": args.repeats, "settle_s": args.settle_s, "out": args.out,
                    "servers": summaries, "points": points})


if __name__ == "__main__":
    main()
