"""`ladle serve`'s own flags (the engine's are in cli.add_engine_flags), and their checks, which run before
anything binds or loads."""
from __future__ import annotations

import argparse
import os

from ladle.entrypoints.cli_args import add_engine_flags
from ladle.entrypoints.openai.http_protocol import RESERVED_FILES


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint dir, as in `vllm serve MODEL` (or --model)")
    p.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: the demo model, "
                                                  "SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model dir)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models shows (default: the model directory's name; "
                        "the model argument as given is accepted too, never shown)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 when this many requests are already waiting (default: unbounded)")
    p.add_argument("--engine-max-failures", type=int, default=5,
                   help="engine deaths in a row before the supervisor gives up (default 5)")
    p.add_argument("--engine-restart-backoff", type=float, default=1.0,
                   help="seconds before the second restart in a row; doubles after (default 1; the first is at once)")
    p.add_argument("--engine-max-backoff", type=float, default=30.0,
                   help="the longest wait between restarts; after --engine-max-failures in a row the supervisor "
                        "keeps trying at this interval, since the cause may go away (default 30)")
    p.add_argument("--engine-startup-timeout", type=float, default=600.0,
                   help="seconds an engine may take to load and plan (default 600)")
    p.add_argument("--engine-hang-timeout", type=float, default=300.0,
                   help="an engine that answers no ping for this long is killed and restarted (default 300)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish; the rest then end with a 503 "
                        "(default 30)")
    p.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: $LADLE_API_KEY, "
                        "else none); /health and /metrics stay open")
    p.add_argument("--max-request-body-bytes", type=int, default=4 * 2**20,
                   help="answer 413 to a larger request body, before reading it (default 4 MiB)")
    p.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="prompts one /v1/completions request may batch (default 256)")
    p.add_argument("--max-choices-per-request", type=int, default=512,
                   help="prompts x n one request may ask for (default 512)")
    p.add_argument("--max-stop-strings", type=int, default=256,
                   help="stop strings one request may give (default 256)")
    p.add_argument("--max-stop-chars", type=int, default=16384,
                   help="characters one request's stop strings may total (default 16384)")
    p.add_argument("--max-logprobs-per-request", type=int, default=262144,
                   help="logprob entries one request may ask for: choices x max_tokens x (logprobs + 1) "
                        "(default 262144)")
    p.add_argument("--timeout-request-body", type=float, default=30.0,
                   help="seconds a request body may pause between two parts before the request gets 408 "
                        "(default 30)")
    p.add_argument("--tool-call-parser", default=None,
                   help="how the model writes tool calls: hermes (Qwen3); none turns it off (default: derived "
                        "from the checkpoint's architecture)")
    p.add_argument("--reasoning-parser", default=None,
                   help="how the model writes its thinking: qwen3, deepseek_v4; none turns it off (default: "
                        "derived from the architecture)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model choose to call tools (tool_choice auto); on whenever a tool-call parser is "
                        "set or derived, and refused without one")
    p.add_argument("--structured-outputs-enable-in-reasoning", action="store_true",
                   help="a structured-output constraint holds from the first token, thinking included (the grammar "
                        "spells the thinking block); by default it waits for the thinking block's end")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="seconds one structured-output constraint (a schema, grammar or forced tool call) may take "
                        "to compile in the grammar sandbox; past them its worker is killed and the request gets a "
                        "400 (default 10)")
    p.add_argument("--grammar-workers", type=int, default=2,
                   help="processes compiling clients' constraints before they are queued, a crash costing one "
                        "request (default 2)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) replacing the tokenizer's")
    add_engine_flags(p)



def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """The connection flags of `ladle serve` (Ray Serve's proxy owns the connections of serve-replicas, so
    `ladle serve-replicas` does not take them)."""
    p.add_argument("--timeout-request-head", type=float, default=10.0,
                   help="seconds a connection may take to send a whole request head; then it is closed "
                        "(default 10)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open between requests (default 5)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections beyond which a new one is answered 503 and closed (default: the "
                        f"open-file limit, raised to its hard limit, less {RESERVED_FILES})")
    p.add_argument("--stream-stall-timeout", type=float, default=30.0,
                   help="a response the client takes no bytes of for this many seconds (its socket buffers "
                        "full) is aborted, and its requests with it (default 30)")


def _positive(name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_serve_flags(args: argparse.Namespace) -> None:
    """Every serving flag checked before anything binds or loads."""
    _positive("--max-queue-len", args.max_queue_len, allow_none=True)
    _positive("--engine-max-failures", args.engine_max_failures)
    _positive("--engine-startup-timeout", args.engine_startup_timeout)
    _positive("--engine-hang-timeout", args.engine_hang_timeout)
    _positive("--shutdown-timeout", args.shutdown_timeout)
    _positive("--max-request-body-bytes", args.max_request_body_bytes)
    _positive("--max-prompts-per-request", args.max_prompts_per_request)
    _positive("--max-choices-per-request", args.max_choices_per_request)
    _positive("--max-stop-strings", args.max_stop_strings)
    _positive("--max-stop-chars", args.max_stop_chars)
    _positive("--max-logprobs-per-request", args.max_logprobs_per_request)
    _positive("--timeout-request-body", args.timeout_request_body)
    _positive("--grammar-compile-timeout", args.grammar_compile_timeout)
    _positive("--grammar-workers", args.grammar_workers)
    _positive("--engine-max-backoff", args.engine_max_backoff)
    if args.api_key is not None:
        args.api_key = _api_key(args.api_key)
    if args.engine_restart_backoff < 0:
        raise ValueError(f"--engine-restart-backoff must be >= 0, got {args.engine_restart_backoff}")


def _api_key(key: str) -> str:
    """The key as clients can send it: stripped (a key file's trailing newline would otherwise make every
    request a 401, since a header's value is stripped), and only characters a header can carry."""
    key = key.strip()
    if not key:
        raise ValueError("--api-key (or LADLE_API_KEY) is empty; give a key or leave it unset")
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"--api-key (or LADLE_API_KEY) contains {bad!r}; a bearer token is printable ASCII "
                         "without spaces")
    return key


