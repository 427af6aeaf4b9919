"""Structured outputs offline: a random-weight model (whose unconstrained text is never valid) writes JSON that
parses and validates against every schema of the corpus, in every sampling mode, with chunked prefill,
preemption, constrained and unconstrained rows in one batch, and n > 1; regexes, choices and grammars match;
and the constraint never changes an unconstrained row."""
from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from ladle import LLM, SamplingParams
from ladle.sampling_params import InvalidSamplingParam, StructuredOutputsParams as SO
from ladle.structured_output.grammar import InvalidStructuredOutput
from structured_corpus import SCHEMAS

MODES = [
    dict(temperature=0),
    dict(temperature=1.0, seed=11),
    dict(temperature=0.9, top_k=5, seed=12),
    dict(temperature=1.0, top_p=0.8, seed=13),
    dict(temperature=1.0, min_p=0.2, seed=14),
    dict(temperature=0, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3),
    dict(temperature=0.7, logprobs=3, seed=15),
]
PROMPT = "Write the answer as JSON. " * 3  # longer than the 16-token chunks below


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    # 16-token chunks and budget: every prompt prefills in pieces, in steps shared with other rows' decodes.
    return LLM(tiny_qwen3_dir, max_model_len=2048, max_num_batched_tokens=64, max_prefill_length=16,
               max_num_seqs=80)


def valid_json(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    return value


def test_every_schema_in_every_mode_validates(llm):
    params = [SamplingParams(max_tokens=400, structured_outputs=SO(json=schema), **MODES[(i + shift) % len(MODES)])
              for shift in (0, 3) for i, schema in enumerate(SCHEMAS)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert len(SCHEMAS) >= 30
    for i, (out, p) in enumerate(zip(outs, params)):
        c = out.outputs[0]
        schema = SCHEMAS[i % len(SCHEMAS)]
        assert c.finish_reason == "stop", (schema, c.text)
        valid_json(c.text, schema)
        # Whitespace between JSON tokens is bounded (20 characters), so no run is longer outside strings.
        assert not re.search(r"[ \t\r\n]{21,}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text)), c.text
        if p.logprobs is not None:  # the sampled token's logprob, and top ones, all allowed: all finite
            assert all(math.isfinite(lp.logprob) for d in c.logprobs for lp in d.values())
    # Unconstrained, the same model writes no JSON at all.
    free = llm.generate([PROMPT], SamplingParams(max_tokens=60, temperature=0), use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError):
        json.loads(free)


def test_regex_choice_and_grammars_match(llm):
    cases = [
        (SO(regex=r"[a-z]{3}-[0-9]{2,4}"), lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", t)),
        (SO(regex=r"(cat|dog)s? (run|sleep)"), lambda t: re.fullmatch(r"(cat|dog)s? (run|sleep)", t)),
        (SO(choice=["yes", "no", "maybe so", 'quote "q"']), lambda t: t in ("yes", "no", "maybe so", 'quote "q"')),
        (SO(grammar='start: NAME "=" NUM ";"\nNAME: /[a-z]{1,6}/\nNUM: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"[a-z]{1,6}=[0-9]{1,3};", t)),
        (SO(grammar='root ::= ("on" | "off") " " [0-9]'), lambda t: re.fullmatch(r"(on|off) [0-9]", t)),
        (SO(json_object=True, disable_any_whitespace=True), None),
    ]
    params = [SamplingParams(max_tokens=60, structured_outputs=so, **MODES[i % len(MODES)])
              for i, (so, _) in enumerate(cases * 2)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out, (so, check) in zip(outs, cases * 2):
        c = out.outputs[0]
        if check is None:  # any JSON object: unbounded, so it may run out of tokens, but never claims to be done
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
            outside_strings = re.sub(r'"(?:[^"\\]|\\.)*("|$)', "", c.text)  # the last one may be cut off
            assert c.text.startswith("{") and not re.search(r"\s", outside_strings), c.text
            continue
        assert c.finish_reason == "stop" and check(c.text), (so, c.text)


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(llm):
    prompts = [f"row {i}: once upon a time" for i in range(6)]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed_params = [plain if i % 2 == 0 else SamplingParams(max_tokens=400, temperature=0,
                                                             structured_outputs=SO(json=SCHEMAS[i]))
                    for i in range(6)]
    mixed = llm.generate(prompts, mixed_params, use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in range(0, 6, 2)] == alone[0::2]
    for i in range(1, 6, 2):
        valid_json(mixed[i].outputs[0].text, SCHEMAS[i])


def test_chunking_and_preemption_never_change_constrained_tokens(tiny_qwen3_dir, llm):
    prompts = [f"{i} " + "tell me a story about the sea " * 4 for i in range(8)]
    params = [SamplingParams(max_tokens=120, structured_outputs=SO(json=SCHEMAS[i * 3]), **MODES[i % len(MODES)])
              for i in range(8)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # 10 blocks of 16 tokens for 8 requests of about 40 + up to 120 tokens: preemptions, recomputed prefills.
    tight = LLM(tiny_qwen3_dir, max_model_len=2048, max_num_batched_tokens=32, max_prefill_length=7,
                num_kv_blocks=14)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for i, o in enumerate(got):
        valid_json(o.outputs[0].text, SCHEMAS[i * 3])


def test_n_samples_each_follow_the_grammar_and_compile_once(llm):
    grammars = llm.engine.core.grammars
    before = grammars.num_compiled
    schema = {**SCHEMAS[4], "title": "compiled once"}  # a schema no other test compiled
    out = llm.generate([PROMPT], SamplingParams(n=5, max_tokens=200, temperature=1.0, seed=3,
                                                structured_outputs=SO(json=schema)), use_tqdm=False)[0]
    assert len(out.outputs) == 5 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        valid_json(c.text, schema)
    assert grammars.num_compiled == before + 1
    assert grammars.num_pending == 0 and not grammars._matchers  # every matcher went with its request


def test_max_tokens_cuts_a_grammar_short_as_length(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, structured_outputs=SO(json=SCHEMAS[5])),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_a_complete_grammar_stops_without_eos_and_keeps_its_last_token(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                structured_outputs=SO(choice=["done"])), use_tqdm=False)[0].outputs[0]
    assert out.text == "done" and out.finish_reason == "stop" and out.stop_reason is None


def test_seeded_constrained_sampling_is_reproducible_in_any_batch(llm):
    p = SamplingParams(max_tokens=100, temperature=1.0, seed=77, structured_outputs=SO(json=SCHEMAS[0]))
    alone = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["other prompt"] * 3 + [PROMPT], [SamplingParams(max_tokens=30)] * 3 + [p], use_tqdm=False)
    assert crowd[3].outputs[0].token_ids == alone


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "structured_outputs"),
    (dict(regex="a", choice=["b"]), "structured_outputs"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(json=5), "structured_outputs.json"),
    (dict(json={}, disable_any_whitespace=True, whitespace_pattern=" "), "structured_outputs.whitespace_pattern"),
])
def test_malformed_constraints_are_refused_when_made(kwargs, field):
    with pytest.raises(InvalidSamplingParam) as e:
        SO(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("so, message", [
    (SO(regex="a(b"), "unclosed group"),
    (SO(json={"type": "foo"}), "Invalid type"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (SO(grammar="start: undefined_rule"), "unknown name"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
])
def test_constraints_that_do_not_compile_fail_before_any_work(llm, so, message):
    steps = llm.stats.num_steps
    with pytest.raises(InvalidStructuredOutput, match=message) as e:
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured_outputs=so)],
                     use_tqdm=False)
    assert e.value.field == f"structured_outputs.{so.kind}" and "prompt 1" in str(e.value)
    assert llm.stats.num_steps == steps and not llm.engine.has_unfinished_requests()
