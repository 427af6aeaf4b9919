"""SmolLM2's GGUF beside llama.cpp (issue 57 item 5): the same file, the same token ids, the same threads, one run.

ladle (`ladle serve --model FILE.gguf --num-threads 2`) and llama.cpp (`llama-server -t 2 -tb 2`) serve the same
GGUF file on this machine, all up at once and taking turns (one is measured at a time, the others idle), and one
client (httpx, this process) sends each the same OpenAI /v1/completions requests, token ids as prompts, greedy,
ignore_eos:

  prefill     one 512-token prompt, max_tokens 1, nothing cached (ladle's prefix cache off, llama.cpp's
              cache_prompt false): 512 / the request's time, sent to answered (the time to its one token).
  decode      a 32-token prompt, 129 tokens streamed: 128 / the time from the first token's event to the last's
              (the mean inter-token time of batch-1 decode).
  concurrent  16 different 32-token prompts sent at once, 128 tokens each (not streamed): 16 x 128 / the time
              from the first send to the last answer (llama-server with 16 parallel slots, continuous batching).

Rounds repeat the set with the engines in rotating order; the tables show medians and every repeat. A 2-thread
team on 2 cores loses most of its speed beside any other busy job, so each measurement starts once other jobs leave
the cores free (/proc/stat's busy time less this benchmark's) and is taken again when they did not while it ran: on
a busy machine the run waits, saying so, rather than measure the neighbour. Beside the client's numbers, each
engine's own: llama-server's `timings` (prompt_per_second, predicted_per_second) of the same requests and
`llama-bench -p 512 -n 128`, and ladle's offline LLM (in a fresh process, 2 torch threads).

llama.cpp is built from source in this benchmark's own environment, never a test dependency: the
llama-cpp-python 0.3.36 sdist's vendored llama.cpp (`pip download --no-deps --no-binary :all:`), configured by
cmake with -march=native and built (llama-server, llama-bench) into --llamacpp-dir on first use, about 10 minutes
on 2 cores. Then:

    python benchmarks/llamacpp_gguf.py

writes benchmarks/results/llamacpp_gguf.json and .md and prints the summary table.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, cpu_name, save, write_markdown  # noqa: E402
from serve_sweep import free_port, wait_healthy  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp's source at vendor/llama.cpp
TARGETS = ("llama-server", "llama-bench")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON")
# The prompts' text: stdlib module docstrings (fixed for a Python version; the ids are recorded in the results).
TEXT_MODULES = ("argparse", "json", "subprocess", "collections")
GOALS = {"decode": 1.0, "prefill": 1.5, "concurrent": 3.0}  # ladle / llama.cpp, issue 57 item 5


def default_llamacpp_dir() -> Path:
    from ladle.paths import cache_dir

    return cache_dir("llama.cpp", "LADLE_LLAMACPP_DIR")


def run_logged(cmd: list[str], cwd: Path | None = None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def llamacpp_source(root: Path) -> Path:
    """llama.cpp's source tree under root: root itself when it is one, else the sdist's vendored copy (fetched
    and unpacked into root when missing)."""
    if (root / "CMakeLists.txt").exists() and (root / "tools" / "server").is_dir():
        return root
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        print(f"llama.cpp: fetching the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (its vendored llama.cpp) into "
              f"{root}", flush=True)
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)])
    print(f"llama.cpp: unpacking {sdist}", flush=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    return src


def llamacpp_binaries(root: Path, build: bool = True) -> dict[str, Path]:
    """{target: path} of llama.cpp's binaries under root, built first when any is missing (the sdist's source,
    cmake + ninja, `nice`, two jobs)."""
    src = llamacpp_source(root) if build else root
    bins = {t: src / "build" / "bin" / t for t in TARGETS}
    if all(p.exists() for p in bins.values()):
        return bins
    if not build:
        raise FileNotFoundError(f"no llama.cpp build under {root}")
    print(f"llama.cpp: building {', '.join(TARGETS)} in {src / 'build'} (about 10 minutes on 2 cores)", flush=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_logged(["nice", "cmake", "-S", str(src), "-B", str(src / "build"), *generator, *CMAKE_FLAGS])
    run_logged(["nice", "cmake", "--build", str(src / "build"), "-j", "2", "--target", *TARGETS])
    missing = [str(p) for p in bins.values() if not p.exists()]
    if missing:
        raise RuntimeError(f"the llama.cpp build did not produce {missing}")
    return bins


def llamacpp_version(server: Path) -> str:
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout + out.stderr).split("\n")[-3:]).strip() or "unknown"


def smollm2_path() -> Path:
    from ladle.gguf.smollm2 import smollm2_gguf
    from ladle.paths import cache_dir

    return smollm2_gguf(cache_dir("smollm2", "LADLE_SMOLLM2_CACHE"))


def workload(gguf: Path, prefill_len: int, short_len: int, concurrency: int) -> dict[str, Any]:
    """The token ids every engine gets: one prefill prompt, one decode prompt, `concurrency` different short
    prompts, consecutive slices of the stdlib docstrings' tokens (ladle's tokenizer of the file, no BOS)."""
    import importlib

    from ladle.gguf.reader import read_gguf
    from ladle.gguf.tokenizer import build_tokenizer

    tok = build_tokenizer(read_gguf(gguf))
    text = "\n\n".join(importlib.import_module(m).__doc__ for m in TEXT_MODULES)
    ids = tok.encode(text, add_special_tokens=False)
    need = prefill_len + short_len * (1 + concurrency)
    if len(ids) < need:
        raise ValueError(f"the text gives {len(ids)} tokens, {need} needed")
    short = [ids[prefill_len + short_len * i: prefill_len + short_len * (i + 1)] for i in range(1 + concurrency)]
    return {"text_source": f"the docstrings of {', '.join(TEXT_MODULES)} (Python {sys.version.split()[0]}), "
                           "joined by blank lines, tokenized by the GGUF's tokenizer without BOS",
            "ids_sha256": hashlib.sha256(json.dumps(ids[:need]).encode()).hexdigest(),
            "prefill": ids[:prefill_len], "decode": short[0], "concurrent": short[1:]}


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants so far."""
    total = 0
    for p in descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


class Server:
    """One server under test: its command, log and launch-to-healthy time; stopped with its process group."""

    def __init__(self, name: str, engine: str, cmd: list[str], tmp: Path) -> None:
        self.name, self.engine, self.port = name, engine, free_port()
        self.cmd = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = tmp / f"{name.replace(' ', '_')}.log"
        env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
        print("starting:", " ".join(self.cmd), flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self.startup_s = wait_healthy(self.port, self.proc, timeout_s=900)
        except Exception:
            print(self.log.read_text()[-3000:], file=sys.stderr)
            raise
        print(f"{name} healthy after {self.startup_s:.1f} s", flush=True)
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"

    def stop(self) -> None:
        procs = descendants(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in procs[1:]:  # ladle's engine runs in a session of its own: end it if it outlived its parent
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "engine": self.engine, "command": " ".join(self.cmd),
                "startup_s": round(self.startup_s, 2)}


def body(server: Server, prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    b: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        b.update(stream=True, stream_options={"include_usage": True})
    if server.engine == "llama.cpp":
        b["cache_prompt"] = False  # llama-server reuses a slot's KV for a repeated prompt unless told not to
    return b


def check_usage(server: Server, usage: dict[str, Any], prompt_len: int, out_len: int) -> None:
    got = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if got != (prompt_len, out_len) or cached:
        raise RuntimeError(f"{server.name}: usage {usage}, expected {prompt_len} prompt tokens (none cached) and "
                           f"{out_len} completion tokens")


async def prefill(client: Any, server: Server, ids: list[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = await client.post(server.url, json=body(server, ids, 1))
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    check_usage(server, out["usage"], len(ids), 1)
    row = {"seconds": seconds, "tok_per_s": len(ids) / seconds}
    if "timings" in out:
        t = out["timings"]
        if t.get("cache_n"):
            raise RuntimeError(f"{server.name} served {t['cache_n']} prompt tokens from its cache")
        row["server_prompt_per_second"] = t["prompt_per_second"]
    return row


async def decode(client: Any, server: Server, ids: list[int], n: int) -> dict[str, Any]:
    """Streams n tokens; the rate is (n - 1) over the span from the first token's event to the last one's."""
    times, usage, timings, text = [], None, None, []
    async with client.stream("POST", server.url, json=body(server, ids, n, stream=True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    times.append(now)
                    text.append(choice["text"])
    check_usage(server, usage or {}, len(ids), n)
    row = {"seconds": times[-1] - times[0], "tok_per_s": (n - 1) / (times[-1] - times[0]), "events": len(times),
           "text": "".join(text)}
    if timings:
        row["server_predicted_per_second"] = timings["predicted_per_second"]
    return row


async def concurrent(client: Any, server: Server, prompts: list[list[int]], n: int) -> dict[str, Any]:
    async def one(ids: list[int]) -> dict[str, Any]:
        r = await client.post(server.url, json=body(server, ids, n))
        r.raise_for_status()
        out = r.json()
        check_usage(server, out["usage"], len(ids), n)
        return out

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - t0
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    row = {"seconds": seconds, "tok_per_s": tokens / seconds, "output_tokens": tokens}
    if all("timings" in o for o in outs):
        row["server_predicted_per_second_per_request"] = statistics.median(
            o["timings"]["predicted_per_second"] for o in outs)
    return row


async def measure_cell(kind: str, server: Server, work: dict[str, Any], args: argparse.Namespace) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)  # a fresh connection per request
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        if kind == "prefill":
            return await prefill(client, server, work["prefill"])
        if kind == "decode":
            return await decode(client, server, work["decode"], args.decode_tokens + 1)
        return await concurrent(client, server, work["concurrent"], args.concurrent_tokens)


def busy_seconds() -> float:
    """CPU seconds every CPU of the machine has been busy so far (/proc/stat: user, nice, system, irq, softirq,
    steal), whoever ran."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu(servers: list[Server] = ()) -> float:
    """CPU seconds of this process, its finished children and every server (with its descendants) so far."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + sum(cpu_seconds(s.proc.pid) for s in servers)


class Foreign:
    """Within the block: the CPUs other jobs on the machine kept busy (all busy CPU time less this benchmark's,
    over the wall time). `mine` gives this benchmark's CPU seconds so far."""

    def __init__(self, mine: Callable[[], float]) -> None:
        self.mine = mine

    def __enter__(self) -> Foreign:
        self.b0, self.o0, self.t0 = busy_seconds(), self.mine(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpus = max(0.0, (busy_seconds() - self.b0 - (self.mine() - self.o0)) / self.seconds)


def quietly(args: argparse.Namespace, mine: Callable[[], float], fn: Callable[[bool], Any],
            score: Callable[[Any], Any], settle: Callable[[], None] = lambda: None) -> tuple[Any, dict[str, Any]]:
    """fn() once other jobs on the machine use under args.quiet_cpus for a second (waiting up to
    args.quiet_wait_s), taken again (up to args.retries times) when they used more while it ran: a 2-thread team
    loses most of its speed when another job takes one of the 2 cores. fn(abortable) may give up early (return
    None) when it sees such load itself (not on the last try); settle() then waits for what it left running.
    Returns fn's result and how it was taken, the discarded tries' scores too."""
    discarded: list[dict[str, Any]] = []
    for attempt in range(args.retries + 1):
        t_wait, told = time.perf_counter(), 0.0
        while True:
            with Foreign(mine) as before:
                time.sleep(1.0)
            waited = time.perf_counter() - t_wait
            if before.cpus <= args.quiet_cpus or waited >= args.quiet_wait_s:
                break
            if waited - told >= 60:
                told = waited
                print(f"    waiting {waited:.0f} s so far: other jobs keep {before.cpus:.2f} CPUs busy", flush=True)
            time.sleep(2.0)
        last = attempt == args.retries
        with Foreign(mine) as during:
            out = fn(not last)
        info = {"waited_s": round(waited, 1), "foreign_cpus_before": round(before.cpus, 2),
                "foreign_cpus": round(during.cpus, 2), "discarded": discarded}
        if out is not None and (during.cpus <= args.quiet_cpus or last):
            return out, info
        got = "given up" if out is None else score(out)
        discarded.append({"foreign_cpus": round(during.cpus, 2), "seconds": round(during.seconds, 1),
                          "result": got})
        print(f"    (other jobs kept {during.cpus:.2f} CPUs busy over {during.seconds:.1f} s: {got}, discarded; "
              "taking it again)", flush=True)
        if out is None:
            settle()
    raise AssertionError


async def watched(coro: Any, mine: Callable[[], float], abort_cpus: float | None) -> Any:
    """coro's result, or None when, checked every second, other jobs kept more than abort_cpus CPUs busy (the
    request is cancelled: its connections close, which both servers take as an abort)."""
    task = asyncio.ensure_future(coro)
    while True:
        with Foreign(mine) as window:
            done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            return task.result()
        if abort_cpus is not None and window.cpus > abort_cpus:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            return None


def wait_idle(server: Server, timeout_s: float = 600.0) -> None:
    """Until the server's processes use under 5% of a CPU for a second (an aborted request's work has ended)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        c0 = cpu_seconds(server.proc.pid)
        time.sleep(1.0)
        if cpu_seconds(server.proc.pid) - c0 < 0.05:
            return


def run_cell(kind: str, server: Server, work: dict[str, Any], args: argparse.Namespace, servers: list[Server],
             rnd: int) -> dict[str, Any]:
    """One measurement of one engine, after a pause, taken quietly (see quietly); records the CPU seconds the
    idle servers used while it ran."""
    time.sleep(args.settle_s)
    mine = lambda: own_cpu(servers)  # noqa: E731

    def attempt(abortable: bool) -> dict[str, Any] | None:
        others = {s.name: cpu_seconds(s.proc.pid) for s in servers if s is not server}
        out = asyncio.run(watched(measure_cell(kind, server, work, args), mine, args.abort_cpus if abortable else None))
        if out is not None:
            out["others_cpu_s"] = {s.name: round(cpu_seconds(s.proc.pid) - others[s.name], 2)
                                   for s in servers if s.name in others}
        return out

    row, info = quietly(args, mine, attempt, lambda x: round(x["tok_per_s"], 1), settle=lambda: wait_idle(server))
    row.update(round=rnd, **info)
    show = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if k != "text"}
    print(f"  {kind:10s} {server.name:16s} {show}", flush=True)
    return row


def llama_bench(binary: Path, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [str(binary), "-m", str(gguf), "-t", str(args.threads), "-p", str(args.prefill_len), "-n",
           str(args.decode_tokens), "-r", str(args.llama_bench_repeats), "-o", "json"]
    print("+ " + " ".join(cmd), flush=True)

    def run(abortable: bool) -> list[dict[str, Any]] | None:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
            while proc.poll() is None:
                with Foreign(lambda: own_cpu() + cpu_seconds(proc.pid)) as window:
                    time.sleep(1.0)
                if abortable and proc.poll() is None and window.cpus > args.abort_cpus:
                    proc.kill()
                    proc.wait()
                    return None
            out.seek(0), err.seek(0)
            if proc.returncode != 0:
                raise RuntimeError(f"llama-bench failed: {err.read()[-2000:]}")
            return json.loads(out.read())

    rows, info = quietly(args, own_cpu, run, lambda rs: [round(r["avg_ts"], 1) for r in rs])
    res: dict[str, Any] = {"command": " ".join(cmd), **info}
    for r in rows:
        key = "prefill" if r["n_prompt"] else "decode"
        res[key] = {"tok_per_s": r["avg_ts"], "stddev": r["stddev_ts"], "samples_ts": r.get("samples_ts"),
                    "test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"}
    print(f"  llama-bench: {res['prefill']['test']} {res['prefill']['tok_per_s']:.1f} tok/s, "
          f"{res['decode']['test']} {res['decode']['tok_per_s']:.1f} tok/s", flush=True)
    return res


def offline_worker(args: argparse.Namespace) -> None:
    """ladle's offline LLM in this process, 2 torch threads: 512-token prefill (generate with max_tokens 1) and
    batch-1 decode ((t(1 + n) - t(1)) / n, each a fresh generate of the decode prompt), repeated."""
    from ladle import LLM, SamplingParams

    work = json.loads(Path(args.offline_worker).read_text())
    t0 = time.perf_counter()
    llm = LLM(str(args.gguf), dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False,
              max_model_len=2048)
    startup = time.perf_counter() - t0

    def timed(ids: list[int], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t

    def decode_rate() -> float:
        one, many = timed(work["decode"], 1), timed(work["decode"], work["decode_tokens"] + 1)
        return work["decode_tokens"] / (many - one)

    timed(work["prefill"], 1), timed(work["decode"], 8)  # warm-up
    prefill, decode, how = [], [], []
    for _ in range(work["repeats"]):
        rate, info = quietly(args, own_cpu, lambda _: len(work["prefill"]) / timed(work["prefill"], 1), round)
        prefill.append(rate)
        how.append({"kind": "prefill", **info})
        rate, info = quietly(args, own_cpu, lambda _: decode_rate(), lambda x: round(x, 1))
        decode.append(rate)
        how.append({"kind": "decode", **info})
    print("RESULT " + json.dumps({"startup_s": startup, "prefill_tok_per_s": prefill, "decode_tok_per_s": decode,
                                  "taken": how}), flush=True)


def ladle_offline(args: argparse.Namespace, gguf: Path, dtype: str, work: dict[str, Any], tmp: Path) -> dict:
    path = tmp / "offline_work.json"
    path.write_text(json.dumps({"prefill": work["prefill"], "decode": work["decode"], "repeats": args.offline_repeats,
                                "decode_tokens": args.decode_tokens}))
    cmd = [sys.executable, __file__, "--offline-worker", str(path), "--gguf", str(gguf), "--dtype", dtype,
           "--threads", str(args.threads), "--quiet-cpus", str(args.quiet_cpus), "--quiet-wait-s",
           str(args.quiet_wait_s), "--retries", str(args.retries), "--abort-cpus", str(args.abort_cpus)]
    print("+ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"ladle's offline worker failed: {out.stderr[-3000:]}")
    res = json.loads(line[7:])
    res.update(prefill_median=statistics.median(res["prefill_tok_per_s"]),
               decode_median=statistics.median(res["decode_tok_per_s"]))
    print(f"  ladle offline {dtype}: prefill {res['prefill_median']:.1f} tok/s, decode {res['decode_median']:.1f} "
          "tok/s", flush=True)
    return res


def summarize(cells: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per measurement and engine: the median over every repeat, the repeats, and (ladle's) the ratio to
    llama.cpp within each round (each side's median that round), which the machine's drift between rounds
    leaves alone."""
    out: dict[str, Any] = {}
    for kind in ("prefill", "decode", "concurrent"):
        out[kind] = {}
        for name in names:
            rows = [c for c in cells if c["kind"] == kind and c["engine"] == name]
            if not rows:
                continue
            entry = {"median": statistics.median(r["tok_per_s"] for r in rows),
                     "repeats": [round(r["tok_per_s"], 2) for r in rows]}
            for key in ("server_prompt_per_second", "server_predicted_per_second",
                        "server_predicted_per_second_per_request"):
                if key in rows[0]:
                    entry[key + "_median"] = statistics.median(r[key] for r in rows)
            out[kind][name] = entry
        rounds = sorted({c["round"] for c in cells})

        def round_median(name: str, rnd: int) -> float:
            return statistics.median(c["tok_per_s"] for c in cells
                                     if c["kind"] == kind and c["engine"] == name and c["round"] == rnd)

        for name in names[1:]:
            ratios = [round_median(name, k) / round_median(names[0], k) for k in rounds]
            out[kind][name]["per_round_ratio"] = [round(x, 3) for x in ratios]
            out[kind][name]["per_round_ratio_median"] = statistics.median(ratios)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: SmolLM2-135M-Instruct Q4_1, "
                                                            "fetched on first use)")
    ap.add_argument("--llamacpp-dir", type=Path, default=None,
                    help="llama.cpp's source root (with build/bin), or a folder to fetch and build it in (default "
                         "$LADLE_LLAMACPP_DIR or ~/.cache/ladle/llama.cpp)")
    ap.add_argument("--build-only", action="store_true", help="fetch and build llama.cpp, then stop")
    ap.add_argument("--report-only", action="store_true", help="write the .md from the saved JSON, then stop")
    ap.add_argument("--threads", type=int, default=2, help="ladle --num-threads, llama.cpp -t and -tb")
    ap.add_argument("--ladle-dtypes", nargs="+", default=["float32", "bfloat16"],
                    help="one ladle server per dtype (the first is compared against the goals)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-per-round", type=int, default=3, help="prefill requests per engine per round")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--short-len", type=int, default=32, help="prompt tokens of the decode and concurrent requests")
    ap.add_argument("--decode-tokens", type=int, default=128, help="decode steps timed (one more token is made)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--concurrent-tokens", type=int, default=128)
    ap.add_argument("--slot-ctx", type=int, default=512, help="llama-server context per slot (-c is slots x this)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="pause before each measurement")
    ap.add_argument("--quiet-cpus", type=float, default=0.25,
                    help="other jobs on the machine count as quiet below this many busy CPUs: each measurement "
                         "waits for a quiet second and is taken again when they used more while it ran")
    ap.add_argument("--quiet-wait-s", type=float, default=1800.0, help="the longest wait, then measure anyway")
    ap.add_argument("--retries", type=int, default=5, help="the most times one measurement is taken again")
    ap.add_argument("--abort-cpus", type=float, default=0.5,
                    help="a measurement (but the last try) gives up as soon as other jobs keep more CPUs than this "
                         "busy for a second")
    ap.add_argument("--llama-bench-repeats", type=int, default=5, help="0: no llama-bench")
    ap.add_argument("--offline-repeats", type=int, default=5, help="0: no ladle offline LLM")
    ap.add_argument("--out", default="llamacpp_gguf")
    ap.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.offline_worker:
        return offline_worker(args)

    if args.report_only:
        return report(args.out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers (finally below)
    root = args.llamacpp_dir or default_llamacpp_dir()
    bins = llamacpp_binaries(root)
    if args.build_only:
        print("llama.cpp binaries:", {k: str(v) for k, v in bins.items()})
        return
    gguf = args.gguf or smollm2_path()
    version = llamacpp_version(bins["llama-server"])
    work = workload(gguf, args.prefill_len, args.short_len, args.concurrency)
    t = str(args.threads)
    llama = [str(bins["llama-server"]), "-m", str(gguf), "-t", t, "-tb", t, "--no-webui"]
    ladle = [sys.executable, "-m", "ladle.entrypoints.cli", "serve", "--model", str(gguf), "--num-threads", t,
             "--no-enable-prefix-caching", "--max-model-len", "2048"]
    print(f"{cpu_name()}; llama.cpp {version}; {gguf}", flush=True)
    servers: list[Server] = []
    cells: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            servers.append(Server("llama.cpp", "llama.cpp", [*llama, "-np", "1", "-c", "2048"], tmp))
            servers.append(Server("llama.cpp x16", "llama.cpp",
                                  [*llama, "-np", str(args.concurrency), "-c", str(args.concurrency * args.slot_ctx),
                                   "-cb"], tmp))
            for dtype in args.ladle_dtypes:
                servers.append(Server(f"ladle {dtype}", "ladle", [*ladle, "--dtype", dtype], tmp))
            # The engines as the tables name them: llama.cpp's batch-1 rows from its one-slot server, its
            # concurrent row from the 16-slot one; ladle's every row from one server.
            engines = ["llama.cpp"] + [f"ladle {d}" for d in args.ladle_dtypes]
            by_kind = {"prefill": {e: e for e in engines}, "decode": {e: e for e in engines},
                       "concurrent": {**{e: e for e in engines}, "llama.cpp": "llama.cpp x16"}}
            named = {s.name: s for s in servers}
            warm = argparse.Namespace(**{**vars(args), "decode_tokens": 8, "concurrent_tokens": 8})
            for kind in ("prefill", "decode", "concurrent"):
                for e in engines:
                    t0 = time.perf_counter()
                    asyncio.run(measure_cell(kind, named[by_kind[kind][e]], work, warm))
                    print(f"  warm-up {kind} {e}: {time.perf_counter() - t0:.1f} s", flush=True)
            for rnd in range(args.rounds):
                order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
                print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", flush=True)
                for kind in ("prefill", "decode", "concurrent"):
                    for e in order:
                        for _ in range(args.prefill_per_round if kind == "prefill" else 1):
                            row = run_cell(kind, named[by_kind[kind][e]], work, args, servers, rnd)
                            cells.append({"kind": kind, "engine": e, "server": by_kind[kind][e], **row})
        finally:
            for s in servers:
                s.stop()
        summaries = [s.summary() for s in servers]
        if args.llama_bench_repeats:
            reference["llama_bench"] = llama_bench(bins["llama-bench"], gguf, args)
        if args.offline_repeats:
            reference["ladle_offline"] = {d: ladle_offline(args, gguf, d, work, tmp) for d in args.ladle_dtypes}
    summary = summarize(cells, engines)
    texts = {e: next(c["text"] for c in cells if c["kind"] == "decode" and c["engine"] == e) for e in engines}
    result = {
        "benchmark": "llamacpp_gguf", "cpu": cpu_name(), "gguf": str(gguf), "gguf_name": gguf.name,
        "gguf_bytes": gguf.stat().st_size, "llamacpp_version": version,
        "llamacpp_build": {"source": f"llama-cpp-python=={LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp",
                           "cmake": " ".join(CMAKE_FLAGS), "targets": list(TARGETS),
                           "binaries": {k: str(v) for k, v in bins.items()}},
        "threads": args.threads, "ladle_dtypes": args.ladle_dtypes, "engines": engines,
        "settings": {k: getattr(args, k) for k in ("rounds", "prefill_per_round", "prefill_len", "short_len",
                                                   "decode_tokens", "concurrency", "concurrent_tokens", "slot_ctx",
                                                   "settle_s", "quiet_cpus", "quiet_wait_s", "retries",
                                                   "abort_cpus")},
        "workload": {k: work[k] for k in ("text_source", "ids_sha256", "prefill", "decode", "concurrent")},
        "servers": summaries, "summary": summary, "reference": reference,
        "decode_texts": texts, "cells": [{k: v for k, v in c.items() if k != "text"} for c in cells],
        "wall_s": round(time.time() - t_start, 1),
        "goals": GOALS,
    }
    save(args.out, result)
    report(args.out)


def report(out: str) -> None:
    """The results' markdown (the BENCHMARKS.md section) beside the JSON, and the summary table printed."""
    from report_llamacpp import llamacpp_gguf, main_table

    r = json.loads((RESULTS / f"{out}.json").read_text())
    write_markdown(llamacpp_gguf(r), str(RESULTS / f"{out}.md"))
    print(f"\n{r['cpu']}, {r['threads']} threads; llama.cpp {r['llamacpp_version']}; medians of "
          f"{r['settings']['rounds']} rounds\n")
    print("\n".join(main_table(r)))


if __name__ == "__main__":
    main()
