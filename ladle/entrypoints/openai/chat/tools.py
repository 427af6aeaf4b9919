"""A chat request's tools: which functions it offers, what tool_choice asks (checked against them and against
the server's parsers), and the grammar that enforces a call when the choice is "required" or a named function
(a custom tool's Lark grammar included: the Responses API's custom tools are functions of one string here)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ladle.entrypoints.openai.chat.settings import ChatSettings
from ladle.entrypoints.openai.chat.tool_parsers.base import Tools, UnsupportedSchema
from ladle.entrypoints.openai.protocol_base import OpenAIError
from ladle.sampling_params import SamplingParams, StructuredOutputsParams, ThinkTags
from ladle.structured_output.limits import ConstraintTooLarge, GrammarLimits, check_schema


@dataclass(frozen=True)
class ToolPlan:
    tools: Tools  # name -> JSON schema of its parameters
    choice: str  # "none", "auto", "required" or "function"
    function: str | None = None  # the function a named choice forces
    grammars: Mapping[str, str] = field(default_factory=dict)  # custom tools held to a Lark grammar, by name

    @property
    def parse(self) -> bool:
        """Whether the output is read for calls."""
        return self.choice != "none"


def tool_plan(req: Any, settings: ChatSettings, grammars: Mapping[str, str] | None = None) -> ToolPlan:
    tools: Tools = {}
    for i, t in enumerate(req.tools or []):
        if t.function.name in tools:
            raise OpenAIError(400, f"tools[{i}]: a second function named {t.function.name!r}; names must differ",
                              code="invalid_value", param="tools")
        tools[t.function.name] = t.function.parameters or {"type": "object", "properties": {}}
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    function = None
    if not isinstance(choice, str):
        function = choice.function.name
        if function not in tools:
            raise OpenAIError(400, f"tool_choice names {function!r}, which is not among the tools "
                              f"({', '.join(tools) or 'none given'})", code="invalid_value", param="tool_choice")
        choice = "function"
    if choice in ("required", "function", "auto") and not tools:
        raise OpenAIError(400, f"tool_choice {choice!r} needs tools", code="invalid_value", param="tool_choice")
    if choice != "none" and settings.tool_format is None:
        raise OpenAIError(400, "this server has no tool-call parser for its model, so it cannot read tool calls; "
                          "start it with --tool-call-parser NAME, or send tool_choice \"none\"",
                          code="unsupported_parameter", param="tool_choice")
    return ToolPlan(tools, choice, function, dict(grammars or {}))


def constrain(plan: ToolPlan, settings: ChatSettings, parallel: bool, structured: StructuredOutputsParams | None,
              param: str, limits: GrammarLimits) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint: a forced call's grammar for "required" or a named function (which then may not
    be combined with response_format or structured_outputs); each tool's schema within limits."""
    if plan.choice in ("required", "function"):
        if structured is not None:
            raise OpenAIError(400, f"tool_choice {plan.choice!r} forces a tool call, so {param} cannot also "
                              "constrain the output; send one", code="invalid_value", param="tool_choice")
        assert settings.tool_format is not None
        tools = plan.tools if plan.function is None else {plan.function: plan.tools[plan.function]}
        for name, schema in tools.items():  # bounded before the grammar holds them (ladle.structured_output.limits)
            try:
                check_schema(schema, f"the parameters of tool {name!r}", limits)
            except ConstraintTooLarge as e:
                raise OpenAIError(400, str(e), code="invalid_value", param="tools") from None
        forced = {name: g for name, g in plan.grammars.items() if name in tools}
        try:
            grammar = settings.tool_format.grammar(tools, parallel and plan.function is None, forced)
        except UnsupportedSchema as e:
            raise OpenAIError(400, str(e), code="invalid_value", param="tools") from None
        structured, param = StructuredOutputsParams(grammar=grammar), "tool_choice"
    return structured, param


def gated(params: SamplingParams, settings: ChatSettings, think: ThinkTags | None, prompt_text: str) -> SamplingParams:
    """With a reasoning parser, a constraint waits for the thinking block, starting where the rendered prompt
    leaves the model (ReasoningParser.gate); --structured-outputs-enable-in-reasoning holds it from the start."""
    so = params.structured_outputs
    if so is None or think is None or settings.reasoning is None or settings.enable_in_reasoning:
        return params
    tags = replace(think, initial=settings.reasoning.gate(prompt_text))
    return replace(params, structured_outputs=replace(so, think_tags=tags))
