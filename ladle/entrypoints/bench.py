"""`ladle bench offline | serve`: what vLLM's `bench throughput` and `bench serve` report.

offline: random prompts through one in-process engine, stepped as LLM.generate steps it, every token timed.
serve:   the same random prompts against a running `ladle serve` (streaming /v1/completions), sent with
         Poisson arrivals at --request-rate and/or at most --max-concurrency in flight.
Both print requests/s, output and total tok/s, TTFT, TPOT, ITL and e2e latency (mean / median / p99, ms) and
write them as JSON with --json. Prompts are random token ids from --dataset-seed; greedy, ignore_eos, so every
request produces exactly its output length.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int) -> Workload:
    """Lengths uniform in the closed ranges, token ids uniform in [0, vocab_size); deterministic in seed."""
    rng = random.Random(seed)
    in_lens = [rng.randint(*input_len) for _ in range(num_prompts)]
    out_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload([[rng.randrange(vocab_size) for _ in range(n)] for n in in_lens], out_lens)


@dataclass
class RequestTiming:
    """Seconds on one clock: when the request was sent, and when each output chunk arrived."""
    sent: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1), as vLLM defines it; None for a one-token output."""
        n = self.num_output_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency(values: Sequence[float]) -> dict[str, float]:
    """mean / median / p99 / max of seconds, in milliseconds."""
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan"), "max": float("nan")}
    ms = [v * 1000 for v in values]
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p99": percentile(ms, 99), "max": max(ms)}


def summarize(timings: Sequence[RequestTiming], duration: float) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None and t.token_times]
    n_in = sum(t.prompt_len for t in ok)
    n_out = sum(t.num_output_tokens for t in ok)
    return {
        "completed": len(ok), "failed": len(timings) - len(ok), "duration_s": duration,
        "prompt_tokens": n_in, "output_tokens": n_out,
        "requests_per_s": len(ok) / duration, "output_tok_per_s": n_out / duration,
        "total_tok_per_s": (n_in + n_out) / duration,
        "ttft_ms": latency([t.ttft for t in ok]),
        "tpot_ms": latency([x for t in ok if (x := t.tpot) is not None]),
        "itl_ms": latency([x for t in ok for x in t.itls]),
        "e2e_ms": latency([t.e2e for t in ok]),
        "errors": sorted({t.error for t in timings if t.error})[:5],
    }


def run_ladle_offline(engine: Any, workload: Workload) -> dict[str, Any]:
    """Submit every prompt at once to a ladle LLMEngine and step it to the end, as LLM.generate does,
    timestamping each request's new tokens after every step."""
    from ladle.sampling_params import SamplingParams

    start = time.perf_counter()
    timings: dict[str, RequestTiming] = {}
    for i, (prompt, n_out) in enumerate(zip(workload.prompts, workload.output_lens)):
        rid = f"bench-{i}"
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        engine.add_request(rid, None, prompt, params)
        timings[rid] = RequestTiming(start, len(prompt))
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            t = timings[out.request_id]
            n = len(out.outputs[0].token_ids)
            t.token_times.extend([now] * (n - t.num_output_tokens))
            t.num_output_tokens = n
            if out.error:
                t.error = out.error
    return summarize(list(timings.values()), time.perf_counter() - start)


async def _one_request(client: Any, url: str, model: str, prompt: list[int], max_tokens: int,
                       timing: RequestTiming) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                timing.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = str(chunk["error"])[:200]
                    return
                if chunk.get("choices"):
                    timing.token_times.append(time.perf_counter())  # one chunk, as vLLM's client counts ITL
                if chunk.get("usage"):
                    timing.num_output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 -- a benchmark reports failures; it does not stop at the first
        timing.error = f"{type(e).__name__}: {e}"


async def run_serve(base_url: str, model: str, workload: Workload, request_rate: float,
                    max_concurrency: int | None, seed: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Send the workload with Poisson arrivals (exponential gaps of mean 1/rate; rate inf sends all at once),
    at most max_concurrency in flight; returns the summary with the achieved settings."""
    import httpx

    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timings = [RequestTiming(0.0, len(p)) for p in workload.prompts]
    # An idle connection is dropped before the server's keep-alive timeout (uvicorn's and vLLM's: 5 s, as is
    # httpx's default): at equal timeouts a request sent just as the server closes the connection fails with
    # a ReadError (seen once at 0.25 req/s, where arrival gaps are often near 5 s).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def send(i: int) -> None:
            if sem is not None:
                await sem.acquire()
            try:
                timings[i].sent = time.perf_counter()
                await _one_request(client, url, model, workload.prompts[i], workload.output_lens[i], timings[i])
            finally:
                if sem is not None:
                    sem.release()

        start = time.perf_counter()
        tasks = []
        for i in range(len(workload.prompts)):
            tasks.append(asyncio.create_task(send(i)))
            if request_rate != float("inf") and i + 1 < len(workload.prompts):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    result = summarize(timings, duration)
    result.update(request_rate=request_rate, max_concurrency=max_concurrency)
    return result


def format_summary(title: str, r: dict[str, Any]) -> str:
    lines = [f"== {title} ==",
             f"completed {r['completed']} (failed {r['failed']}) in {r['duration_s']:.2f} s; "
             f"{r['prompt_tokens']} prompt + {r['output_tokens']} output tokens",
             f"requests/s {r['requests_per_s']:.3f}   output tok/s {r['output_tok_per_s']:.1f}   "
             f"total tok/s {r['total_tok_per_s']:.1f}"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        lines.append(f"{key[:-3].upper():>5} ms  mean {s['mean']:9.1f}  median {s['median']:9.1f}  "
                     f"p99 {s['p99']:9.1f}  max {s['max']:9.1f}")
    lines += [f"error: {e}" for e in r.get("errors", [])]
    return "\n".join(lines)


def _vocab_size(model_dir: str) -> int:
    from ladle.gguf.path import gguf_file_of

    gguf = gguf_file_of(model_dir)
    if gguf is not None:  # a GGUF file's vocabulary is in its metadata (ladle.gguf.config)
        from ladle.models.loading.loader import load_config

        return int(load_config(str(gguf)).vocab_size)
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _workload(args: argparse.Namespace, vocab: int) -> Workload:
    return random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.dataset_seed)


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    result["command"] = "ladle " + " ".join(sys.argv[1:]) if sys.argv else ""
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from ladle.entrypoints.cli_args import ENGINE_KEYS, resolve_model
    from ladle.frontend.llm_engine import LLMEngine

    model = resolve_model(args.model)
    engine_kwargs = {k: getattr(args, k) for k in ENGINE_KEYS if hasattr(args, k)}
    engine = LLMEngine.from_kwargs(model=model, **engine_kwargs)
    workload = _workload(args, _vocab_size(model))
    if args.warmup:
        run_ladle_offline(engine, random_workload(2, (32, 64), (4, 4), _vocab_size(model), seed=-1))
    result = run_ladle_offline(engine, workload)
    result.update(engine="ladle", model=model, workload=asdict(_workload_spec(args)))
    print(format_summary("ladle bench offline", result))
    _write(args, result)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    model = args.model
    workload = _workload(args, _vocab_size(model))
    rate = float(args.request_rate)
    result = asyncio.run(run_serve(args.base_url, args.served_model_name or model, workload, rate,
                                   args.max_concurrency, args.dataset_seed))
    result.update(engine="ladle serve", base_url=args.base_url, workload=asdict(_workload_spec(args)))
    print(format_summary(f"ladle bench serve (rate {rate}/s, max concurrency {args.max_concurrency})", result))
    _write(args, result)
    return 0 if result["failed"] == 0 else 1


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int


def _workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.dataset_seed)


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 1024], metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] (default 64 1024)")
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   help="output lengths, uniform in [MIN, MAX]; greedy with ignore_eos (default 32 256)")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts and arrivals")
    p.add_argument("--json", default=None, help="write the results here")


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench offline` and `bench serve` on the `ladle` command's subparsers."""
    from ladle.entrypoints.cli_args import add_engine_flags

    bench = subparsers.add_parser("bench", help="throughput and latency benchmarks (vLLM's bench metrics)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    off = sub.add_parser("offline", help="in-process batch throughput (like vllm bench throughput)")
    off.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: the demo model)")
    off.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the two-request warm-up")
    _add_workload_flags(off)
    add_engine_flags(off)
    off.set_defaults(func=cmd_bench_offline)
    srv = sub.add_parser("serve", help="online latency against a running `ladle serve` (like vllm bench serve)")
    srv.add_argument("--model", required=True, help="the served checkpoint dir (its config gives the vocab)")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    srv.add_argument("--request-rate", default="inf", help="Poisson arrivals per second (default inf: all at once)")
    srv.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    _add_workload_flags(srv)
    srv.set_defaults(func=cmd_bench_serve)
    return bench
