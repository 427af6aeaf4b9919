"""The request fields that ask for structured outputs, and the engine constraint they make.

OpenAI's `response_format` (chat and, as vLLM takes it, completions), vLLM's `structured_outputs` object, and
vLLM's older `guided_*` fields, which vLLM maps onto structured_outputs the same way. Every field is either
enforced or answered with a 400 that names it: unknown keys inside these objects are refused, not dropped.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ladle.entrypoints.openai.protocol_base import OpenAIBaseModel, OpenAIError, Text
from ladle.sampling_params import InvalidSamplingParam, StructuredOutputsParams

# llguidance is ladle's one structured-output backend; these names ask for the same enforcement.
BACKENDS = ("auto", "guidance", "llguidance")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # Accepted either way: ladle always enforces the whole schema, which is what strict asks of OpenAI.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request field (ladle.sampling_params.StructuredOutputsParams)."""
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Text | None = None
    disable_fallback: bool = False
    structural_tag: Any = None  # refused by name: not supported yet


class GuidedFields(OpenAIBaseModel):
    """vLLM's deprecated spelling, still sent by older clients."""
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None
    guided_decoding_backend: Text | None = None


def structured_outputs_of(req: Any) -> tuple[StructuredOutputsParams | None, str]:
    """The engine constraint a request asks for, and the request field that asked (for errors); 400 when it
    asks twice or for what ladle does not support."""
    asked = [name for name in ("response_format", "structured_outputs") if getattr(req, name) is not None
             and not (name == "response_format" and req.response_format.type == "text")]
    guided = [f for f in GuidedFields.model_fields if f != "guided_decoding_backend" and getattr(req, f) is not None
              and f != "guided_whitespace_pattern"]
    backend = req.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise OpenAIError(400, f"guided_decoding_backend {backend!r} is not available: ladle's structured outputs "
                          f"run on llguidance (one of {', '.join(BACKENDS)})", code="unsupported_parameter",
                          param="guided_decoding_backend")
    if len(asked) + len(guided) > 1:
        raise OpenAIError(400, f"{' and '.join(asked + guided)} each ask for structured output; set one",
                          code="invalid_value", param=(asked + guided)[1])
    if guided:
        field = guided[0]
        spec = {field.removeprefix("guided_"): getattr(req, field)}
        if req.guided_whitespace_pattern is not None:
            spec["whitespace_pattern"] = req.guided_whitespace_pattern
        return _params(spec, field), field
    if req.guided_whitespace_pattern is not None:
        raise OpenAIError(400, "guided_whitespace_pattern needs guided_json", code="invalid_value",
                          param="guided_whitespace_pattern")
    if not asked:
        return None, ""
    if asked[0] == "structured_outputs":
        so: StructuredOutputsRequest = req.structured_outputs
        if so.structural_tag is not None:
            raise OpenAIError(400, "structured_outputs.structural_tag is not supported; use json, regex, choice "
                              "or grammar", code="unsupported_parameter", param="structured_outputs.structural_tag")
        fields = so.model_dump(by_alias=True, exclude={"structural_tag"}, exclude_none=True)
        return _params(fields, "structured_outputs"), "structured_outputs"
    fmt: ResponseFormat = req.response_format
    if fmt.type == "json_object":
        return _params({"json_object": True}, "response_format"), "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema", code="invalid_value",
                          param="response_format.json_schema.schema")
    return _params({"json": fmt.json_schema.schema_}, "response_format"), "response_format.json_schema.schema"


def _params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidSamplingParam as e:
        where = e.field if param == "structured_outputs" else param
        raise OpenAIError(400, f"{where}: {e.rule}", code="invalid_value", param=where) from None
