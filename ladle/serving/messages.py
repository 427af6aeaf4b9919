"""The messages between the API process and the engine process, over one duplex pipe: plain frozen data (no
torch), so the API process unpickles them without importing the engine."""
from __future__ import annotations

from dataclasses import dataclass

from ladle.engine.core_output import EngineCoreOutput, EngineSnapshot
from ladle.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    pid: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    config_table: str
    checkpointing: bool = False  # prefix hits need state checkpoints: chat prompts' message ends are worth marking
    eos_token_ids: tuple[int, ...] = ()  # what the engine's grammar matchers allow where a grammar is complete


# API -> engine


@dataclass(frozen=True)
class AddRequest:
    """One API request: params.n children per prompt (EngineCore.make_requests), admitted all or none."""
    parent_id: str
    prompts: tuple[tuple[int, ...], ...] | list[list[int]]
    params: SamplingParams
    checkpoint_marks: tuple[int, ...] = ()  # where a chat prompt's messages end (ladle.frontend.message_marks)
    session_id: str | None = None  # the client's session (ladle.kv_cache.session_retention)


@dataclass(frozen=True)
class AbortRequests:
    child_ids: tuple[str, ...]


@dataclass(frozen=True)
class Ping:
    ping_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


# engine -> API


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class StartupFailed:
    reason: str
    user_error: bool  # a setting or input to change (ValueError and kin), not a crash


@dataclass(frozen=True)
class Added:
    parent_id: str


@dataclass(frozen=True)
class Rejected:
    parent_id: str
    code: str
    message: str


@dataclass(frozen=True)
class Outputs:
    outputs: list[EngineCoreOutput]
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class Pong:
    ping_id: int
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class Fatal:
    """Sent just before the engine process exits on an error inside a step."""
    reason: str


ToEngine = AddRequest | AbortRequests | Ping | Shutdown
FromEngine = Ready | StartupFailed | Added | Rejected | Outputs | Pong | Fatal
