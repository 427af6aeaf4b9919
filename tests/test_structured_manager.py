"""The engine's grammar matchers (ladle.structured_output.manager) and the sampler's bitmask, piece by piece:
compile off the loop with a cache and a deadline, masks that allow exactly the grammar's next tokens, rollback
for speculative tokens, forced tokens for a drafter, and the sampler applying a row's mask to that row only."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ladle.runner.sampler import Sampler, unpack_bitmask
from ladle.runner.sampling_batch import sampling_batch
from ladle.sampling_params import SamplingParams, StructuredOutputsParams as SO
from ladle.structured_output.manager import StructuredOutputManager

EOS = 511


@pytest.fixture()
def manager(tiny_qwen3_dir):
    m = StructuredOutputManager(tiny_qwen3_dir, 512, frozenset([EOS]))
    yield m
    m.shutdown()


def ready(m: StructuredOutputManager, timeout: float = 30.0) -> list[tuple[str, str]]:
    deadline = time.monotonic() + timeout
    failed = []
    while m.num_pending and time.monotonic() < deadline:
        m.wait(0.05)
        failed += m.poll()
    return failed


def allowed(m: StructuredOutputManager, rid: str) -> set[int]:
    bits = unpack_bitmask(torch.from_numpy(m.fill_bitmasks([rid])), 512)[0]
    return set(bits.nonzero()[:, 0].tolist())


def test_masks_allow_exactly_the_grammars_next_tokens(manager, tokenizer):
    manager.add("a", SO(choice=["yes", "no"]))
    assert not manager.is_ready("a")
    assert ready(manager) == [] and manager.is_ready("a")
    first = allowed(manager, "a")
    assert first and all(("yes".startswith(t) or "no".startswith(t)) and t for t in map(tokenizer.decode, first))
    assert EOS not in first  # the grammar is not complete yet
    for t in tokenizer.encode("yes"):
        assert manager.accept("a", t)
    assert manager.is_terminated("a")  # nothing may follow "yes": the request ends without sampling EOS
    assert allowed(manager, "a") == {EOS}


def test_rollback_undoes_tokens_and_forced_tokens_are_the_only_continuation(manager, tokenizer):
    manager.add("r", SO(regex="abc-[0-9]"))
    ready(manager)
    forced = manager.forced_tokens("r")
    assert tokenizer.decode(forced) == "abc-"[: len(tokenizer.decode(forced))] and forced
    before = allowed(manager, "r")
    for t in forced:
        assert manager.accept("r", t)
    assert allowed(manager, "r") != before
    manager.rollback("r", len(forced))
    assert allowed(manager, "r") == before
    bad = tokenizer.encode("z")[0]
    assert not manager.accept("r", bad) and manager.error("r")


def test_the_cache_compiles_a_grammar_once_and_bad_ones_fail_alone(manager):
    for rid in ("x", "y", "z"):
        manager.add(rid, SO(json={"type": "integer"}))
    manager.add("never", SO(regex=r"[^\x00-\x{10FFFF}]"))  # valid syntax, matches nothing at all
    failed = ready(manager)
    assert [rid for rid, _ in failed] == ["never"] and "could not be compiled" in failed[0][1]
    assert all(manager.is_ready(r) for r in "xyz") and manager.num_compiled == 1
    manager.remove("x")
    assert not manager.is_ready("x")


def test_a_compile_that_misses_its_deadline_fails_its_request_but_queueing_does_not(tiny_qwen3_dir):
    import threading

    now = [0.0]
    m = StructuredOutputManager(tiny_qwen3_dir, 512, frozenset([EOS]), compile_timeout_s=5.0, clock=lambda: now[0])
    release, running = threading.Event(), threading.Event()
    compile_for_real = m._matcher

    def slow(tokenizer, grammar):
        running.set()
        release.wait(30)
        return compile_for_real(tokenizer, grammar)

    m._matcher = slow  # type: ignore[method-assign]
    m.add("slow", SO(regex="a+"))
    m.add("queued", SO(regex="b+"))  # waits behind "slow" on the one worker
    assert running.wait(30) and m.poll() == []
    now[0] = 6.0
    failed = m.poll()
    assert [rid for rid, _ in failed] == ["slow"] and "within 5 s" in failed[0][1]
    release.set()
    assert ready(m) == [] and m.is_ready("queued")  # its compile began after the clock moved: in time
    m.shutdown()


def test_unpack_bitmask_reads_bit_t_of_word_t_over_32():
    words = np.zeros((2, 3), dtype=np.int32)
    words[0, 0] = 1 << 5
    words[0, 2] = np.int32(-2**31)  # bit 31 of word 2: token 95
    words[1, 1] = 0b11
    bits = unpack_bitmask(torch.from_numpy(words), 90)
    assert bits.shape == (2, 90)
    assert bits[0].nonzero()[:, 0].tolist() == [5] and bits[1].nonzero()[:, 0].tolist() == [32, 33]
    assert unpack_bitmask(torch.from_numpy(words), 96)[0].nonzero()[:, 0].tolist() == [5, 95]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
                                    SamplingParams(temperature=1.0, top_k=3, seed=2, logprobs=5)])
def test_the_sampler_draws_a_constrained_row_among_its_allowed_tokens_only(params):
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    batch, pos, counts = sampling_batch([params] * 3, vocab)
    free = Sampler()(logits, batch.step(pos, counts))
    words = np.zeros((1, 2), dtype=np.int32)
    words[0, 1] = (1 << 7) | (1 << 20)  # tokens 39 and 52
    out = Sampler()(logits, batch.step(pos, counts, [(1, words[0])]))
    assert out.token_ids[1] in (39, 52)
    assert out.token_ids[0] == free.token_ids[0] and out.token_ids[2] == free.token_ids[2]
    if params.logprobs:  # only allowed tokens are reported, each with a finite logprob
        assert set(out.logprobs[1]) <= {39, 52}
        assert all(np.isfinite(lp.logprob) for lp in out.logprobs[1].values())


@pytest.mark.parametrize("vocab", [37, 64, 1000])
def test_the_c_kernel_masks_exactly_what_the_torch_path_masks(vocab):
    from ladle.kernels.cpu_kernels import load
    from ladle.runner.sampler import allowed_only

    rng = np.random.default_rng(vocab)
    width = (vocab + 31) // 32
    words = rng.integers(-2**31, 2**31, size=(3, width), dtype=np.int64).astype(np.int32)
    words[0, 0], words[1, :] = -1, 0  # a whole word allowed; a row with nothing allowed
    words[2, -1] = 0x55555555
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    batch, pos, counts = sampling_batch([SamplingParams(temperature=0)] * 5, vocab)
    meta = batch.step(pos, counts, [(0, words[0]), (2, words[1]), (4, words[2])])
    want = allowed_only(logits.clone(), meta)
    got = allowed_only(logits.clone(), meta, load())
    assert torch.equal(got, want) and not torch.equal(got, logits)
    assert torch.equal(got[[1, 3]], logits[[1, 3]]) and bool(torch.isinf(got[2]).all())
    bf16 = logits.bfloat16()  # not fp32: masked in a float32 copy, the caller's tensor untouched
    assert torch.equal(allowed_only(bf16, meta, load()), allowed_only(bf16.float(), meta)) and torch.equal(
        bf16, logits.bfloat16())


def test_a_parser_limit_hit_mid_output_is_one_clear_line(manager):
    """2,100 choices compile and give a first mask, but taking a token leaves llguidance's parser a row of over
    2,000 items: the request's error says so in one line (GrammarLimits keeps choices below it)."""
    from ladle.engine.structured_step import advance
    from ladle.request import Request

    manager.add("big", SO(choice=[f"c{i:06d}" for i in range(2_100)]))
    assert ready(manager) == []
    req = Request("big", [1, 2], SamplingParams(structured_outputs=SO(choice=["x"])), 8, frozenset([EOS]))
    token = min(allowed(manager, "big"))
    why, done = advance(manager, req, token)
    assert why is not None and not done
    assert "Parser Error" in why and "max is 2000" in why and "\n" not in why and len(why) < 300, why
