"""When a sampled token ends a request (stop strings are text: the frontends find those)."""
from __future__ import annotations

from ladle.request import Request, RequestStatus


def check_stop(req: Request, max_model_len: int, grammar_complete: bool = False) -> RequestStatus | None:
    """How the last token ends req, if it does: a stop token (past min_tokens), a structured-output grammar
    that allows nothing more (grammar_complete), max_tokens or the context."""
    last = req.output_token_ids[-1]
    if req.num_output_tokens >= req.sampling_params.min_tokens and last in req.stop_token_ids:
        if last in req.sampling_params.stop_token_ids:
            req.stop_reason = last
        return RequestStatus.FINISHED_STOPPED
    if grammar_complete:
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
