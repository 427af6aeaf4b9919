"""The issue's scenario on the engine: with only max_num_batched_tokens=512 and max_model_len=40000 set, a
16-token request sent during a 30K-token prefill finishes within a small fraction of the long prompt's steps,
the long prompt takes barely more steps than alone, and both give the tokens they give alone. Counted in
steps, not seconds (timings live in benchmarks/long_prompt_fairness.py)."""
from __future__ import annotations

import random

import pytest

from ladle import LLM, SamplingParams
from ladle.demo import build_checkpoint

pytestmark = [pytest.mark.slow]

LONG, SHORT, NEW = 30_000, 16, 4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("long_ctx"), "qwen3", vocab_size=512, hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=128, max_position_embeddings=40_960, seed=2)
    return LLM(path, max_num_batched_tokens=512, max_model_len=40_000)


def _drive(core, requests: dict, add_short_after_steps: int | None) -> tuple[dict, dict]:
    """Run to completion from an empty prefix cache; returns per request its tokens and the step it finished
    at (and the step the short one was added at)."""
    assert core.reset_prefix_cache()
    tokens = {rid: [] for rid in requests}
    steps = {}
    core.add_request(core.make_request("long", requests["long"], GREEDY))
    n = 0
    while core.has_unfinished_requests():
        if n == add_short_after_steps:
            core.add_request(core.make_request("short", requests["short"], GREEDY))
            steps["short_added_at"] = n
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason:
                steps[out.request_id] = n + 1
        n += 1
    return tokens, steps


def test_a_short_request_during_a_30k_prefill_finishes_in_a_fraction_of_its_steps(llm):
    settings = llm.config.settings
    assert {k for k, s in settings.items() if s.source == "explicit"} == {"max_num_batched_tokens", "max_model_len"}
    rng = random.Random(0)
    prompts = {"long": [rng.randrange(512) for _ in range(LONG)], "short": [rng.randrange(512) for _ in range(SHORT)]}
    core = llm.engine.core
    alone_tokens, alone_steps = _drive(core, {"long": prompts["long"]}, None)
    tokens, steps = _drive(core, prompts, add_short_after_steps=5)
    short_steps = steps["short"] - steps["short_added_at"]
    assert short_steps <= 1 + NEW  # admitted at once: prefill + decodes
    assert short_steps <= 0.15 * steps["long"], steps
    assert steps["long"] <= 1.10 * alone_steps["long"], (steps, alone_steps)
    short_alone, _ = _drive(core, {"long": prompts["short"]}, None)
    assert tokens["long"] == alone_tokens["long"] and tokens["short"] == short_alone["long"]
