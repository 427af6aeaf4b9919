"""Long contexts beside vLLM's CPU build, same model (qwen3-768-128k: qwen3-768's ~100M parameters with room
for 64K-token prompts; fp32), same run: TTFT of one cold prompt
at each length, decode tokens/s of one request at a deep context, and TTFT of one prompt at several chunk sizes
(chunking's cost at depth), with each process's peak resident memory. Each (engine, chunk size) is one fresh
process; engines alternate, their order flipping every repeat; the report takes medians.

vLLM lives in its own virtual environment (benchmarks/setup_vllm.sh); without it, ladle runs alone.

    python benchmarks/long_context.py                           # 8K-64K, 3 repeats: hours on 2 cores
    python benchmarks/long_context.py --lengths 8192 16384 --decode 8192 --chunks --repeats 1   # a first look
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

HERE = Path(__file__).resolve().parent


def run(python: str, engine: str, model: str, chunk: int, max_len: int, measurements: list[str],
        seed: int) -> list[dict[str, Any]]:
    cmd = [python, str(HERE / "long_context_worker.py"), "--engine", engine, "--model", model, "--chunk", str(chunk),
           "--max-len", str(max_len), "--seed", str(seed), *measurements]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * 3600)
    rows = [json.loads(x.removeprefix("RESULT ")) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0:
        raise RuntimeError(f"{engine} chunk {chunk} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    for r in rows:
        r |= {"engine": engine, "chunk": chunk}
        print(json.dumps(r), flush=True)
    return rows


def medians(rows: list[dict[str, Any]], key: str) -> dict[tuple, float]:
    """By (engine, prompt tokens, chunk): a decode run's first token is a TTFT measurement too."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            groups.setdefault((r["engine"], r["tokens"], r["chunk"]), []).append(r[key])
    return {k: statistics.median(v) for k, v in groups.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-name", default="qwen3-768-128k")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--decode", type=int, nargs="*", default=[8192, 32768], help="contexts of the decode runs")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=2048, help="the chunk size of the TTFT and decode runs")
    ap.add_argument("--chunks", type=int, nargs="*", default=[512, 2048, 8192])
    ap.add_argument("--chunk-at", type=int, default=32768, help="the prompt of the chunk-size runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="long_context")
    args = ap.parse_args()
    model = build_model(args.model_name)
    engines = [("ladle", sys.executable)] + ([("vllm", args.vllm_python)] if Path(args.vllm_python).exists() else [])
    max_len = max([*args.lengths, *args.decode, args.chunk_at]) + args.decode_tokens + 64
    # A decode run prefills its context first, so a length it covers needs no TTFT run of its own.
    main_run = ([f"ttft:{n}" for n in args.lengths if n not in args.decode]
                + [f"decode:{n}:{args.decode_tokens}" for n in args.decode])
    rows: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for engine, python in engines if rep % 2 == 0 else engines[::-1]:
            rows += run(python, engine, model, args.chunk, max_len, main_run, rep)
            for chunk in [c for c in args.chunks if c != args.chunk]:  # the main run has args.chunk's
                rows += run(python, engine, model, chunk, args.chunk_at + 64, [f"ttft:{args.chunk_at}"], rep)
    ttft, decode, rss = medians(rows, "ttft_s"), medians(rows, "decode_tok_s"), medians(rows, "peak_rss_mib")
    summary = [{"engine": e, "tokens": n, "chunk": c, "ttft_s": ttft[(e, n, c)], "decode_tok_s": decode.get((e, n, c)),
                "peak_rss_mib": rss.get((e, n, c))} for (e, n, c) in sorted(ttft)]
    save(args.out, {"model": args.model_name, "model_config": model_facts(model), "repeats": args.repeats,
                    "engines": [e for e, _ in engines], "chunk": args.chunk, "chunk_at": args.chunk_at,
                    "decode_tokens": args.decode_tokens, "summary": summary, "runs": rows})


if __name__ == "__main__":
    main()
