"""Structured outputs' cost: decode throughput with every row constrained by a JSON schema against the same
batch unconstrained, at batch 1, 16 and 64, on a 32K and a 152K vocabulary; the per-token overhead; the
bitmask fill alone; and grammar compile times (cold, cache missed).

Each (vocabulary, batch) pair runs unconstrained and constrained in turns (interleaved, so drift on a shared
machine hits both). Decode tok/s is the batch over the median time of its full decode steps (each engine step
timed whole, as LLM.generate drives it), the median of the turns; the ratio and the overhead are taken per turn
(its two runs back to back, in alternating order) and their median reported. The schema is an array of
small objects with minItems 10,000, so no row completes early: every row decodes exactly max_tokens tokens,
through string, number, boolean and separator states.

    python benchmarks/structured.py                      # qwen3-512 (32K) and qwen3-512-152k, 5 turns
    python benchmarks/structured.py --models tiny --batches 1 4 --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.sampling_params import StructuredOutputsParams  # noqa: E402
from ladle.structured_output.manager import StructuredOutputManager  # noqa: E402

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                         "ok": {"type": "boolean"}},
        "required": ["name", "id", "ok"], "additionalProperties": False}
LONG = {"type": "array", "minItems": 10000, "items": ITEM}
# Cold compiles: one of each kind, as a client would send them.
COMPILES = {
    "json schema (object, 3 fields)": StructuredOutputsParams(json=ITEM),
    "json schema (nested, $defs, anyOf)": StructuredOutputsParams(json={
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                         "required": ["x", "y"]}},
        "type": "object", "properties": {"shape": {"anyOf": [
            {"type": "object", "properties": {"center": {"$ref": "#/$defs/pt"}, "r": {"type": "number"}}},
            {"type": "object", "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/pt"}}}}]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}, "name": {"type": "string"}},
        "required": ["shape"]}),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,9} [0-9]{1,4}(, [A-Z][a-z]{2,9} [0-9]{1,4}){0,5}"),
    "choice (3)": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    "lark grammar": StructuredOutputsParams(grammar='start: expr\nexpr: term (("+"|"-") term)*\n'
                                                    'term: NUM | "(" expr ")"\nNUM: /[0-9]+/'),
}
MODEL_OF_VOCAB = {"32K": "qwen3-512", "152K": "qwen3-512-152k"}


def compile_times(model_dir: str, vocab: int) -> dict[str, float]:
    """ms for the tokenizer's first build, then each grammar's cold compile (a fresh manager, no cache)."""
    out: dict[str, float] = {}
    m = StructuredOutputManager(model_dir, vocab, frozenset())
    start = time.perf_counter()
    m._tokenizer()
    out["tokenizer (once per engine)"] = (time.perf_counter() - start) * 1000
    for name, spec in COMPILES.items():
        start = time.perf_counter()
        m.add(name, spec)
        while m.num_pending:
            m.wait(0.01)
            assert not m.poll(), name
        out[name] = (time.perf_counter() - start) * 1000
    m.shutdown()
    return out


def decode_step_ms(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> float:
    """The median time of the batch's full decode steps (every row decoding), each step timed whole through the
    engine as LLM.generate drives it: scheduling, grammar masks, forward, sampling, matchers, detokenizing."""
    engine, stats = llm.engine, llm.engine.core.stats
    for i, ids in enumerate(prompts):
        rid = f"{tag}-{i}"
        engine.add_request(rid, None, ids, params, engine.make_requests(rid, ids, params))
    times, lengths = [], {}
    while engine.has_unfinished_requests():
        steps = stats.num_steps
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                lengths[out.request_id] = len(out.outputs[0].token_ids)
        took = time.perf_counter() - start
        if stats.num_steps > steps and stats.steps[-1].num_decodes == len(prompts):
            times.append(took)
    assert set(lengths.values()) == {params.max_tokens}, f"a row ended early: {lengths}"
    return statistics.median(times) * 1000


class FillTimer:
    """Times the engine's bitmask fills (llguidance) as the decode steps run them."""

    def __init__(self, llm: LLM) -> None:
        self.grammars = llm.engine.core.grammars
        self.fill = self.grammars.fill_bitmasks
        self.times: list[float] = []
        self.grammars.fill_bitmasks = self  # type: ignore[method-assign]

    def __call__(self, request_ids: list[str]):
        start = time.perf_counter()
        out = self.fill(request_ids)
        self.times.append(time.perf_counter() - start)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODEL_OF_VOCAB.values()))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=48, help="tokens decoded per row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="structured")
    args = ap.parse_args()
    rng = random.Random(0)
    rows, compiles, facts = [], {}, {}
    for name in args.models:
        model_dir = build_model(name)
        facts[name] = model_facts(model_dir)
        vocab = facts[name]["vocab_size"]
        compiles[name] = compile_times(model_dir, vocab)
        print(name, {k: f"{v:.1f} ms" for k, v in compiles[name].items()}, flush=True)
        llm = LLM(model_dir, max_num_seqs=max(args.batches), max_model_len=1024, enable_prefix_caching=False)
        fills = FillTimer(llm)
        free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                     structured_outputs=StructuredOutputsParams(json=LONG))
        tags = iter(range(10**9))
        for batch in args.batches:
            prompts = [[rng.randrange(vocab) for _ in range(32)] for _ in range(batch)]
            for params in (free, constrained):  # warm: the engine's tokenizer for llguidance, the caches
                decode_step_ms(llm, prompts, params, f"warm{next(tags)}")
            turns: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
            fills.times.clear()
            for turn in range(args.repeats):
                kinds = [("unconstrained", free), ("constrained", constrained)]
                for kind, params in kinds if turn % 2 == 0 else kinds[::-1]:  # drift within a turn cancels
                    turns[kind].append(decode_step_ms(llm, prompts, params, f"t{next(tags)}"))
            step_ms = {k: statistics.median(v) for k, v in turns.items()}
            med = {k: batch * 1000 / v for k, v in step_ms.items()}
            pairs = list(zip(turns["unconstrained"], turns["constrained"]))
            row = {"model": name, "vocab": vocab, "batch": batch, "decode_step_ms": turns,
                   "unconstrained_tok_s": med["unconstrained"], "constrained_tok_s": med["constrained"],
                   # Per turn (the two runs back to back), then the median: the machine's drift over a run is
                   # larger than the effect measured.
                   "ratio": statistics.median(u / c for u, c in pairs),
                   "overhead_ms_per_step": statistics.median(c - u for u, c in pairs),
                   "mask_fill_ms_per_step": statistics.median(fills.times) * 1000}
            rows.append(row)
            print(f"{name} batch {batch}: {med['unconstrained']:.1f} -> {med['constrained']:.1f} decode tok/s "
                  f"({row['ratio']:.2f}x), mask fill {row['mask_fill_ms_per_step']:.2f} ms/step", flush=True)
        llm.shutdown()
        del llm
    save(args.out, {"models": facts, "tokens": args.tokens, "repeats": args.repeats, "schema": LONG,
                    "rows": rows, "compile_ms": compiles})


if __name__ == "__main__":
    main()
