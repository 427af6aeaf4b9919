"""What every OpenAI protocol model and error shares: strict validation, UTF-8 text, and OpenAI's error
envelope."""
from __future__ import annotations

import logging
import uuid
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

logger = logging.getLogger("ladle.server")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid UTF-8: a lone surrogate at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0)]  # the vocabulary's upper bound is checked against the served model

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "service_unavailable_error"}


class OpenAIError(Exception):
    """An error the server answers with OpenAI's envelope."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> ErrorResponse:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))


def internal_error(what: str, error: BaseException) -> OpenAIError:
    """A 500 that names no exception text: that goes to the log, under an id the client can quote."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    logger.error("%s (error id %s)", what, error_id, exc_info=error)
    return OpenAIError(500, f"internal server error; the server log has the details under id {error_id}",
                       code="internal_error")


def clip(text: str, limit: int = 80) -> str:
    """A client's string as an error message quotes it: its start, so a megabyte sent is not echoed back."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class OpenAIBaseModel(BaseModel):
    """A request body: a field ladle does not serve is a 400 naming it, never dropped."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class EchoModel(BaseModel):
    """A message or call a client sends back as it received it: the output-only keys a response carried
    (refusal, annotations, ...) come along and are not requests, so they are let through."""
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
