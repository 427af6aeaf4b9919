"""Structured outputs on a reasoning model (StructuredOutputsParams.think_tags): unconstrained but for EOS inside
the thinking block, the grammar enforced from the token after its end tag; a prompt that leaves the block open
starts thinking, any other may open one with its first token."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.demo import build_checkpoint
from ladle.runner.sampler import unpack_bitmask
from ladle.sampling_params import StructuredOutputsParams as SO, ThinkTags
from ladle.structured_output.manager import StructuredOutputManager
from ladle.structured_output.think_gate import Gate, ThinkGate, last_index

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("think"), added_tokens=("<think>", "</think>"), seed=4)


@pytest.fixture(scope="module")
def llm(think_dir):
    return LLM(think_dir, max_model_len=1024)


def tags(llm) -> ThinkTags:
    tok = llm.get_tokenizer()
    return ThinkTags((tok.convert_tokens_to_ids("<think>"),), (tok.convert_tokens_to_ids("</think>"),))


def test_gate_states_follow_the_prompt_and_the_tokens():
    t = ThinkTags((7,), (8, 9))
    assert last_index([1, 7, 2, 7, 3], (7,)) == 3 and last_index([8, 9, 1, 8], (8, 9)) == 0
    assert last_index([1, 2], (7,)) == -1
    assert ThinkGate.at_prompt(t, [1, 7, 5]).state is Gate.THINKING
    assert ThinkGate.at_prompt(t, [7, 5, 8, 9, 4]).state is Gate.MAY_OPEN  # closed in the prompt
    assert ThinkGate.at_prompt(ThinkTags((6, 7), (8,)), [1]).state is Gate.ENFORCED  # no one-token start
    gate = ThinkGate.at_prompt(t, [1])
    assert not gate.take(7) and gate.state is Gate.THINKING  # the model opens a block
    assert [gate.take(x) for x in (8, 3, 8)] == [False] * 3 and gate.state is Gate.THINKING
    assert not gate.take(9) and gate.state is Gate.ENFORCED  # "8 9" ended it
    assert gate.take(7) and gate.fed == 1  # from here every token is the grammar's, a start tag too
    first = ThinkGate.at_prompt(t, [1])
    assert first.take(3) and first.state is Gate.ENFORCED  # did not open: the grammar holds at once


def test_masks_while_thinking_allow_all_but_eos_then_the_grammar(think_dir, tokenizer):
    eos = 511
    m = StructuredOutputManager(think_dir, 514, frozenset([eos]))
    t = ThinkTags((512,), (513,))
    m.add("open", SO(choice=["yes"], think_tags=t), [1, 2, 512])  # the prompt opened the block
    m.add("may", SO(choice=["yes"], think_tags=t), [1, 2])
    while m.num_pending:
        m.wait(0.05)
        assert m.poll() == []
    rows = unpack_bitmask(torch.from_numpy(m.fill_bitmasks(["open", "may"])), 514)
    assert int(rows[0].sum()) == 513 and not rows[0, eos]
    may = set(rows[1].nonzero()[:, 0].tolist())
    assert 512 in may and 513 not in may and all(tokenizer.decode([x]) in "yes" for x in may - {512})
    think = tokenizer.encode("some thoughts")
    for x in think:  # thinking: tokens do not reach the matcher, nothing ends the request
        assert m.accept("open", x) and not m.is_terminated("open")
    assert m.forced_tokens("open") == []
    assert m.accept("open", 513)  # the end tag
    for x in tokenizer.encode("yes"):
        assert m.accept("open", x)
    assert m.is_terminated("open")
    with pytest.raises(Exception, match="across its thinking block"):
        m.rollback("open", 5)
    m.shutdown()


def test_an_open_block_is_free_text_then_the_forced_end_starts_the_grammar(llm):
    t, tok = tags(llm), llm.get_tokenizer()
    prompt = tok.encode("question?") + list(t.start)
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=SCHEMA, think_tags=t))
    # Inside the block the row is free but for EOS: the same tokens as an unconstrained row that may not stop.
    free = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    got, want = (llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0] for p in (constrained,
                                                                                                       free))
    assert got.token_ids == want.token_ids and got.finish_reason == "length" and t.end[0] not in got.token_ids
    # A model forced to close its block after 5 tokens: the grammar holds from the next token on.
    model = llm.engine.core.model_executor.runner.model
    logits_of, calls = model.compute_logits, [0]

    def closes_after_five(hidden: torch.Tensor) -> torch.Tensor:
        out = logits_of(hidden)
        calls[0] += 1
        if calls[0] == 6:
            out[:, t.end[0]] = 1e4
        return out

    model.compute_logits = closes_after_five
    try:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=200, structured_outputs=SO(
            json=SCHEMA, think_tags=t)), use_tqdm=False)[0].outputs[0]
    finally:
        model.compute_logits = logits_of
    ids = out.token_ids
    assert ids[:5] == want.token_ids[:5] and ids[5] == t.end[0] and out.finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(ids[6:])), SCHEMA)


def test_a_closed_block_in_the_prompt_enforces_the_grammar_from_the_first_token(llm):
    t, tok = tags(llm), llm.get_tokenizer()
    prompt = tok.encode("q") + list(t.start) + tok.encode("thought") + list(t.end)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, [SamplingParams(
        temperature=1.0, seed=s, max_tokens=200, structured_outputs=SO(json=SCHEMA, think_tags=t)) for s in range(4)],
        use_tqdm=False)
    for o in outs:
        ids, finish = o.outputs[0].token_ids, o.outputs[0].finish_reason
        if ids[0] == t.start[0]:  # it chose to think first: allowed; it cannot stop inside the block
            if t.end[0] not in ids:
                assert finish == "length"
                continue
            ids = ids[ids.index(t.end[0]) + 1:]
        assert finish == "stop"
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


def test_think_tags_are_checked():
    from ladle.sampling_params import InvalidSamplingParam

    with pytest.raises(InvalidSamplingParam, match="think_tags"):
        ThinkTags((), (3,))
    with pytest.raises(InvalidSamplingParam, match="think_tags"):
        SO(json={}, think_tags=(1, 2))  # type: ignore[arg-type]
