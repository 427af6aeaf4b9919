"""The report section of benchmarks/spec_decode_smollm2.py: n-gram drafts on SmolLM2 editing code it was shown."""
from __future__ import annotations

from typing import Any

from report_common import table


def spec_decode_smollm2(r: dict[str, Any]) -> list[str]:
    rows, m = r["rows"], r["machine"]
    asks = "; ".join(f"({i + 1}) {a.split('. Reply')[0]}" for i, a in enumerate(r["instructions"]))
    lines = ["## SmolLM2: n-gram drafts on an edit-this-code prompt", "",
             f"Reproduce: `{r['command']}`", "",
             f"Model: {r['model']}. Each prompt is SmolLM2's chat template around textwrap's `dedent` and `indent` "
             f"as this Python ships them and one instruction, ending \"Reply with the whole edited code in one Python "
             f"block\" ({', '.join(str(n) for n in r['prompt_tokens'])} tokens): {asks}. Batch 1 takes the first; "
             "batch 4 all four. The answer re-emits most of the code, which prompt lookup (n-grams of 2-4 tokens) "
             f"drafts from the prompt. Greedy, {r['tokens']} tokens a row; the tokens with drafts equal the plain "
             "run's in every turn (checked). Measured as benchmarks/spec_decode.py measures: decode tok/s over "
             "decode-only steps, the plain side the same engine with its speculator detached, turns alternating, the "
             "median of "
             f"{r['repeats']} per-turn ratios. CPU: {r['cpu']}; torch {m['torch']}, {m['threads']} thread(s), a "
             "shared machine.", ""]
    lines += table(["batch", "k", "plain tok/s", "with drafts tok/s", "ratio (median)", "per-turn ratios",
                    "accepted / drafted", "acceptance rate", "mean acceptance length"],
                   [[x["batch"], x["k"], f"{x['plain_tok_s']:.1f}", f"{x['spec_tok_s']:.1f}", f"{x['ratio']:.2f}",
                     ", ".join(f"{v:.2f}" for v in x["ratios"]), f"{x['accepted']} / {x['drafted']}",
                     f"{x['acceptance_rate']:.0%}", f"{x['mean_acceptance_length']:.2f}"] for x in rows])
    lines += ["", "The start of the first answer with drafts:", "", "````", r["sample_answer"][:600].rstrip(), "````"]
    return lines + [""]
