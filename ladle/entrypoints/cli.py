"""`ladle generate | serve | plan | bench | demo-model`: the command line."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ladle.entrypoints.cli_args import (
    DEFAULT_PROMPT,
    GENERATE_FLAGS,
    add_engine_flags,
    add_log_level,
    engine_args_from_flags,
    report_error,
    sampling_from_flags,
)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    for f in args.prompt_file or []:
        try:
            prompts.append(Path(f).read_text())
        except OSError as e:
            raise FileNotFoundError(f"--prompt-file {f}: {e.strerror or e}") from None
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    if args.batch_size is not None:
        if args.batch_size < len(prompts):
            raise ValueError(f"--batch-size {args.batch_size} is smaller than the {len(prompts)} prompts given")
        prompts = [prompts[i % len(prompts)] for i in range(args.batch_size)]
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_from_flags(args)
    prompts = read_prompts(args)
    engine_args, explicit = engine_args_from_flags(args, args.model)
    from ladle.entrypoints.llm import LLM

    llm = LLM.from_engine_args(engine_args, explicit)
    print(llm.config.report(), file=sys.stderr)
    start = time.perf_counter()
    if args.chat:  # each prompt one user message, rendered by the model's chat template
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.no_progress)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    for out in outputs:
        c = out.outputs[0]
        print(f"--- request {out.request_id}: {len(out.prompt_token_ids)} prompt tokens, "
              f"{len(c.token_ids)} generated, finish_reason={c.finish_reason}")
        print(c.text)
    stats = llm.stats
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    if args.profile:
        print(stats.profile_table())
    print(f"{len(outputs)} requests, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s: "
          f"{n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s; "
          f"largest step {stats.max_step_tokens} tokens; {stats.num_preemptions} preemptions")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be a positive integer, got {args.prompt_tokens}")
    engine_args, explicit = engine_args_from_flags(args, args.model)
    from ladle.startup.setup import load_and_plan

    if engine_args.tensor_parallel_size > 1:  # every rank plans at once, so the group starts as it would serve
        from ladle.engine.core import EngineCore

        core = EngineCore(engine_args, explicit)
        config = core.config
        core.shutdown()
    else:
        config = load_and_plan(engine_args, explicit).config
    print(config.report())
    if args.prompt_tokens is not None:
        assert config.plan is not None  # load_and_plan always plans
        print(config.plan.prompt_report(args.prompt_tokens))
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from ladle.demo import build_demo_model

    path = build_demo_model(args.dir)
    print(f"wrote the demo model (Qwen3 architecture, RANDOM weights) to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle", description="LLM inference with memory-bounded chunked prefill")
    add_log_level(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline batch generation")
    gen.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: the demo model, "
                                                    "SmolLM2-135M-Instruct, fetched on first use)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    gen.add_argument("--prompt-file", action="append", help="a file whose whole text is one prompt; repeatable")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the model's chat template (LLM.chat)")
    gen.add_argument("--batch-size", type=int, default=None,
                     help="submit this many independent requests, cycling through the prompts")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--profile", action="store_true", help="print a per-step table at the end")
    gen.add_argument("--no-progress", action="store_true")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    plan = sub.add_parser("plan", help="print the memory plan and every setting's provenance, serve nothing")
    plan.add_argument("--model", default=None, help="HF checkpoint dir or GGUF file (default: the demo model)")
    plan.add_argument("--prompt-tokens", type=int, default=None, help="say whether such a prompt fits, and how")
    add_engine_flags(plan)
    plan.set_defaults(func=cmd_plan)

    from ladle.entrypoints.openai.api_server import add_serve_parser  # argparse + uvicorn only at import time

    add_serve_parser(sub)
    from ladle.entrypoints.openai.ray_serve import add_replica_arguments, cmd_serve_replicas

    replicas = sub.add_parser("serve-replicas", help="data-parallel `ladle serve` replicas behind one endpoint, on "
                                                     "Ray Serve (the ray extra)")
    add_replica_arguments(replicas)
    replicas.set_defaults(func=cmd_serve_replicas)
    from ladle.entrypoints.bench import add_bench_parser

    add_bench_parser(sub)

    demo = sub.add_parser("demo-model", help="write a small Qwen3 checkpoint with random weights (for tests)")
    demo.add_argument("dir")
    demo.set_defaults(func=cmd_demo_model)
    for command, p in sub.choices.items():
        # --log-level after the subcommand too (vLLM style); serve logs its settings table at INFO.
        add_log_level(p, argparse.SUPPRESS)
        p.set_defaults(default_log_level="INFO" if command.startswith("serve") else "WARNING")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # serve-replicas hands its flags on to each replica as typed
    level = args.log_level or args.default_log_level
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ladle").setLevel(level)  # also when the root logger was configured before (tests)
    args.log_level = level
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 -- every mistake ends as one line and an exit code
        return report_error(e, level == "DEBUG", GENERATE_FLAGS if args.command == "generate" else None)


if __name__ == "__main__":
    sys.exit(main())
