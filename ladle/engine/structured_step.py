"""The structured-output side of a step: bitmask rows for the constrained requests that sample in it, and each
committed token fed to its request's matcher (ladle.structured_output.manager)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ladle.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from ladle.request import Request
from ladle.structured_output.manager import StructuredOutputManager


def constrained(grammars: StructuredOutputManager | None, req: Request) -> bool:
    return grammars is not None and req.sampling_params.structured_outputs is not None


def compiling(grammars: StructuredOutputManager | None, req: Request) -> bool:
    """A constrained request whose matcher is not ready yet: the scheduler passes over it."""
    return constrained(grammars, req) and not grammars.is_ready(req.request_id)  # type: ignore[union-attr]


def with_bitmasks(sched: SchedulerOutput, grammars: StructuredOutputManager | None) -> SchedulerOutput:
    """sched with a bitmask on every constrained chunk that samples (one batched fill for all of them); a
    chunk that stops short of its request's last token samples nothing and gets none. A constrained row with
    drafts gets one mask per position (draft_masks)."""
    rows = [i for i, s in enumerate(sched.scheduled) if s.samples and constrained(grammars, s.request)]
    if not rows:
        return sched
    assert grammars is not None
    plain = [i for i in rows if not sched.scheduled[i].draft_token_ids]
    scheduled = list(sched.scheduled)
    if plain:
        masks = grammars.fill_bitmasks([sched.scheduled[i].request.request_id for i in plain])
        for mask, i in zip(masks, plain):
            scheduled[i] = replace(scheduled[i], bitmask=mask)
    for i in rows:
        if scheduled[i].draft_token_ids:
            scheduled[i] = draft_masks(grammars, scheduled[i])
    return replace(sched, scheduled=scheduled)


def draft_masks(grammars: StructuredOutputManager, s: ScheduledRequest) -> ScheduledRequest:
    """A constrained row with drafts: the grammar's mask at each of its positions, found by feeding the drafts
    to its matcher and taking them back ([1 + drafts, words]). Drafts from the first one the grammar forbids are
    dropped (its masked sampling could never accept them), and the row's tokens with them."""
    rid, drafts = s.request.request_id, s.draft_token_ids
    masks, fed = [], 0
    for j in range(len(drafts) + 1):
        masks.append(grammars.fill_bitmasks([rid])[0])
        if j == len(drafts):
            break
        d = drafts[j]
        if not (int(masks[-1][d // 32]) >> (d % 32)) & 1 or not grammars.accept(rid, d):
            drafts = drafts[:j]
            break
        fed += 1
    if fed:
        grammars.rollback(rid, fed)
    dropped = len(s.draft_token_ids) - len(drafts)
    return replace(s, num_new_tokens=s.num_new_tokens - dropped, draft_token_ids=drafts,
                   bitmask=np.stack(masks) if drafts else masks[0])


def grammar_error(grammars: StructuredOutputManager | None, req: Request) -> str | None:
    """Why req's matcher broke (a parser limit hit mid-output), or None."""
    if not constrained(grammars, req):
        return None
    assert grammars is not None
    error = grammars.error(req.request_id)
    return None if error is None else f"request {req.request_id}: its structured-output grammar failed: {error}"


def advance(grammars: StructuredOutputManager | None, req: Request, token_id: int) -> tuple[str | None, bool]:
    """Feed req's committed token to its matcher: (why the grammar refused it, or None; whether the grammar is
    now complete and allows nothing more). Unconstrained requests: (None, False)."""
    if not constrained(grammars, req):
        return None, False
    assert grammars is not None
    rid = req.request_id
    if not grammars.accept(rid, token_id):
        why = grammars.error(rid)
        if why is not None and "Parser Error" in why:  # the mask allowed it; the parser hit a limit taking it
            return f"request {rid}: its structured-output grammar failed at token {token_id}: {why}", False
        return (f"request {rid} sampled token {token_id}, which its structured-output grammar does not allow "
                f"({why})"), False
    return None, grammars.is_terminated(rid)
