"""The API side of a request's token stream, without a server: a backlog is worked off in slices that let the
event loop run between them, joined updates give the same text and tokens as one update per output, a stop
string ends the choice at the output that made it, and responses written in pieces equal pydantic's JSON."""
from __future__ import annotations

import asyncio
import json

import pytest

from ladle.serving.async_client import RequestHandle
from ladle.engine.core_output import EngineCoreOutput
from ladle.entrypoints.openai.generation_stream import _SLICE, GenerationStream, TokenTexts, coalesce
from ladle.entrypoints.openai.metrics import ServerMetrics
from ladle.entrypoints.openai.protocol import (
    ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionResponse, ChatCompletionResponseChoice,
    ChatResponseMessage, CompletionLogProbs, CompletionResponse, CompletionResponseChoice, TopLogprob, UsageInfo,
)
from ladle.entrypoints.openai.serving_engine import json_pieces, with_choices
from ladle.outputs import Logprob
from ladle.request import child_request_ids
from ladle.sampling_params import SamplingParams


class FakeClient:
    def __init__(self) -> None:
        self.aborted: list[tuple[str, list[str] | None]] = []

    def abort(self, request_id: str, child_ids: list[str] | None = None) -> None:
        self.aborted.append((request_id, child_ids))


def make_stream(tokenizer, params: SamplingParams) -> tuple[GenerationStream, FakeClient]:
    client = FakeClient()
    stream = GenerationStream(client, tokenizer, TokenTexts(tokenizer), ServerMetrics("m"),  # type: ignore[arg-type]
                              "r", [tokenizer.encode("Once upon")], params)
    return stream, client


def outputs_for(n: int, tokens: int, last_reason: str = "length") -> list[EngineCoreOutput]:
    """One output per token and child, interleaved as the engine sends them step by step."""
    outs = []
    ids = child_request_ids("r", n)
    for t in range(tokens):
        for i in range(n):
            lp = {100 + t % 50: Logprob(-0.5, 1), 7: Logprob(-2.0, 2)}
            outs.append(EngineCoreOutput(ids[i], [100 + (t * 7 + i) % 300], [lp],
                                         last_reason if t == tokens - 1 else None))
    return outs


def run_stream(stream: GenerationStream, backlog: list[EngineCoreOutput]) -> tuple[list[list], int]:
    """All deltas of a backlog (outputs the engine sent while nobody read them), and how often a concurrent
    task got the loop while they were worked off."""
    async def go() -> tuple[list[list], int]:
        handle = RequestHandle("r", [c.child_id for c in stream.choices], 1)
        for out in backlog:
            handle.queue.put_nowait(out)
        stream._handle = handle
        ticks = [0]
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                ticks[0] += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = ticks[0]
        got = [d async for d in stream.deltas()]
        done.set()
        await task
        return got, ticks[0] - start

    return asyncio.run(go())


def test_a_backlog_is_worked_off_in_slices_that_yield_the_loop(tokenizer):
    n, tokens = 4, 500
    stream, _ = make_stream(tokenizer, SamplingParams(n=n, max_tokens=tokens, logprobs=1))
    batches, ticks = run_stream(stream, outputs_for(n, tokens))
    slices = -(-n * tokens // _SLICE)
    assert len(batches) == slices and ticks >= slices - 1, (len(batches), ticks)
    assert all(len(b) <= n for b in batches)  # each child's outputs of a slice joined into one delta
    assert all(len(c.token_ids) == tokens and len(c.logprobs) == tokens for c in stream.choices)
    assert all(c.finish_reason == "length" for c in stream.choices)


def test_joined_updates_give_the_same_text_as_one_per_output(tokenizer):
    n, tokens = 3, 200
    outs = outputs_for(n, tokens)
    joined, _ = make_stream(tokenizer, SamplingParams(n=n, max_tokens=tokens))
    batches, _ = run_stream(joined, outs)
    for c in joined.choices:
        ids = [o.new_token_ids[0] for o in outs if o.request_id == c.child_id]
        assert c.token_ids == ids and c.detok.output_text == tokenizer.decode(ids)
    streamed = "".join(d.text for batch in batches for d in batch if d.choice.index == 0)
    assert streamed == joined.choices[0].detok.output_text


def test_a_stop_string_ends_the_choice_at_the_output_that_made_it(tokenizer):
    outs = outputs_for(1, 300)
    ids = [o.new_token_ids[0] for o in outs]
    text = tokenizer.decode(ids)
    stop = text[len(text) // 3:len(text) // 3 + 4]
    stream, client = make_stream(tokenizer, SamplingParams(max_tokens=300, stop=[stop]))
    run_stream(stream, outs)
    choice = stream.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    first = next(k for k in range(1, 301) if stop in tokenizer.decode(ids[:k]))
    assert len(choice.token_ids) == first  # not the tokens the engine made after it
    assert client.aborted == [("r", ["r"])]  # a lone child has its parent's id


def test_coalesce_keeps_order_and_the_last_ending():
    outs = [EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2]), EngineCoreOutput("a", [3], [], "stop", 9)]
    merged = coalesce(outs)
    assert [(m.request_id, m.new_token_ids, m.finish_reason, m.stop_reason) for m in merged] == \
        [("a", [1, 3], "stop", 9), ("b", [2], None, None)]
    assert outs[0].new_token_ids == [1]  # the engine's outputs are not changed


@pytest.mark.parametrize("tokens", [0, 1, 15, 16, 17, 100])
def test_responses_in_pieces_equal_pydantic_json(tokens):
    top = [TopLogprob(token='a"\u00e9', logprob=-1.0, bytes=[97]) for _ in range(20)]
    content = [ChatCompletionLogProbsContent(token="t", logprob=-0.5, bytes=[116], top_logprobs=top)] * tokens
    choices = [ChatCompletionResponseChoice(index=i, message=ChatResponseMessage(content="x\n"),
                                            logprobs=ChatCompletionLogProbs(content=content) if i % 2 else None,
                                            finish_reason="length") for i in range(18)]
    usage = UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    chat = ChatCompletionResponse(id="c", model='m"1', choices=choices, usage=usage)
    assert b"".join(json_pieces(chat)) == chat.model_dump_json().encode()
    empty = ChatCompletionResponse(id="c", model='m"1', created=chat.created, choices=[], usage=usage)
    assert b"".join(with_choices(empty, iter(choices))) == chat.model_dump_json().encode()
    logprobs = CompletionLogProbs(tokens=["a"] * tokens, token_logprobs=[-1.0] * tokens,
                                  top_logprobs=[{"a": -1.0, "b": -2.0}] * tokens, text_offset=list(range(tokens)))
    done = CompletionResponse(id="x", model="m", choices=[CompletionResponseChoice(
        index=0, text="t", logprobs=logprobs, finish_reason="length")] * 3, usage=usage)
    assert json.loads(b"".join(json_pieces(done))) == json.loads(done.model_dump_json())
    assert b"".join(json_pieces(done)) == done.model_dump_json().encode()
