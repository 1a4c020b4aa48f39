"""The constraint and tool fields of OpenAI requests: ``response_format``, vLLM's ``structured_outputs`` (and its
older ``guided_*`` names), ``tools`` and ``tool_choice``.

Lifecycle: stateless. ``router.openai.http_api`` calls ``plan(body, chat, tool_call_parser)`` once per request, before
tokenizing: it checks these fields (``ValueError`` naming the field the client wrote), and returns a ``Plan``:
the tools for the chat template, the ``ToolCallParser`` that reads the answer (or None), and the one output
constraint (an ``engine.StructuredOutputsParams``) that goes into every ``GenerateRequest`` of the request as
``structured_outputs``. The router's validation compiles the constraint against the vocabulary; its errors name
``structured_outputs.<field>``, and ``Plan.relabel`` turns that into the field the client actually wrote
(``response_format.json_schema.schema``, ``guided_regex``, ``tool_choice``...).

``tool_choice`` follows vLLM: ``"none"`` renders the tools in the prompt and never parses calls; ``"auto"``
(the default when tools are given) parses the free answer with the router's ``--tool-call-parser`` (an error
without one, as vLLM's server answers without ``--tool-call-parser``); ``"required"`` constrains the answer to
a JSON array of ``{"name", "parameters"}`` objects, one of the tools each (vLLM's schema); a named function
constrains the answer to that function's ``parameters`` schema, and the answer is its arguments.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engine import StructuredOutputsParams
from router.openai.tool_parsers import ToolCallParser, parser_for

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
"""A tool without ``parameters`` takes none: its arguments are an empty object."""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs`` extra body (its knobs for other backends are ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: Optional[Union[str, dict[str, Any]]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Any] = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: NamedFunction


class ConstraintFields(BaseModel):
    """Mixed into both request bodies."""

    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class ToolFields(BaseModel):
    """Mixed into the chat body."""

    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None


@dataclass
class Plan:
    """What a request's constraint and tool fields mean for the router (see module docstring)."""

    tools: Optional[list[dict]] = None
    """The tools as the chat template's ``tools`` variable (None: no tools)."""
    parser: Optional[ToolCallParser] = None
    """Reads tool calls out of each choice's answer (None: the answer is content)."""
    constraint: Optional[StructuredOutputsParams] = None
    origin: str = "structured_outputs"
    """The request field the constraint came from, for error messages."""

    def relabel(self, message: str) -> str:
        """A validation message naming ``structured_outputs.<field>`` -> naming ``origin``."""
        if self.constraint is None or self.origin == "structured_outputs":
            return message
        head = f"structured_outputs.{self.constraint.kind}"
        if message.startswith(head):
            return message.replace(head, self.origin, 1)
        if message.startswith("structured_outputs"):  # about the constraint as a whole (e.g. with beam search)
            return message.replace("structured_outputs", self.origin.split(".")[0].split("[")[0], 1)
        return message


def _constraint(kind: str, value: Any, origin: str) -> tuple[StructuredOutputsParams, str]:
    try:
        return StructuredOutputsParams(**{kind: value}), origin
    except ValueError as e:
        msg = str(e)
        head = f"structured_outputs.{kind}"
        raise ValueError(msg.replace(head, origin, 1) if msg.startswith(head) else f"{origin}: {msg}") from None


def _from_response_format(rf: ResponseFormat) -> Optional[tuple[StructuredOutputsParams, str]]:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return _constraint("json_object", True, "response_format")
    if rf.json_schema is None:
        raise ValueError("response_format.json_schema is required when response_format.type is 'json_schema'")
    if rf.json_schema.schema_ is None:
        raise ValueError("response_format.json_schema.schema is required")
    return _constraint("json", rf.json_schema.schema_, "response_format.json_schema.schema")


def _from_structured_outputs(so: StructuredOutputsBody) -> Optional[tuple[StructuredOutputsParams, str]]:
    if so.structural_tag is not None:
        raise ValueError("structured_outputs.structural_tag is not supported; use json, regex, choice, grammar "
                         "or json_object")
    given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                  ("grammar", so.grammar), ("json_object", so.json_object)) if v is not None]
    if len(given) > 1:
        raise ValueError("structured_outputs: set only one of json, regex, choice, grammar, json_object; got "
                         + ", ".join(k for k, _ in given))
    if not given:
        return None
    k, v = given[0]
    return _constraint(k, v, f"structured_outputs.{k}")


def _constraints(body: ConstraintFields) -> list[tuple[str, tuple[StructuredOutputsParams, str]]]:
    found: list[tuple[str, tuple[StructuredOutputsParams, str]]] = []
    if body.response_format is not None:
        c = _from_response_format(body.response_format)
        if c is not None:
            found.append(("response_format", c))
    if body.structured_outputs is not None:
        c = _from_structured_outputs(body.structured_outputs)
        if c is not None:
            found.append(("structured_outputs", c))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        v = getattr(body, name)
        if v is not None:
            found.append((name, _constraint(kind, v, name)))
    return found


def _check_tools(tools: list[ChatTool]) -> None:
    seen: dict[str, int] = {}
    for i, t in enumerate(tools):
        name = t.function.name
        if not name.strip():
            raise ValueError(f"tools[{i}].function.name must not be empty")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name: {name!r} is also the name of tools[{seen[name]}]; "
                             f"tool names must be unique")
        seen[name] = i


def required_schema(tools: list[ChatTool], single: bool = False) -> dict:
    """vLLM's schema for ``tool_choice: "required"``: an array of one or more calls (exactly one with ``single``,
    i.e. ``parallel_tool_calls: false``), each one of the tools (``{"name": <its name>, "parameters": <its
    schema>}``); ``$defs`` of the tools' schemas lifted to the top, where their ``$ref``s point."""
    defs: dict[str, Any] = {}
    options = []
    for i, t in enumerate(tools):
        params = dict(t.function.parameters or EMPTY_PARAMETERS)
        for name, d in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != d:
                raise ValueError(f"tools[{i}].function.parameters: $defs {name!r} differs from another tool's "
                                 f"$defs of that name")
            defs[name] = d
        options.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_tools(body: ToolFields) -> Optional[list[dict]]:
    """The request's tools (checked: named, names unique) as the chat template's ``tools`` variable."""
    if not body.tools:
        return None
    _check_tools(body.tools)
    return [t.model_dump(exclude_none=True) for t in body.tools]


def _plan_tools(body: ToolFields, tool_call_parser: Optional[str]) -> Plan:
    tools, choice = body.tools or None, body.tool_choice
    template = template_tools(body)
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ValueError(f"tool_choice: {json.dumps(choice if isinstance(choice, str) else choice.model_dump())} "
                             f"needs tools, and the request has none")
        return Plan()
    if choice == "none":
        return Plan(tools=template)
    if choice == "auto":
        if tool_call_parser is None:
            raise ValueError('tool_choice: "auto" needs the router started with --tool-call-parser (hermes, '
                             'llama3_json); or use tool_choice "required", a named function, or "none"')
        return Plan(tools=template, parser=parser_for(tool_call_parser))
    if choice == "required":
        params, origin = _constraint("json", required_schema(tools, body.parallel_tool_calls is False), "tools")
        return Plan(tools=template, parser=parser_for("required"), constraint=params, origin=origin)
    name = choice.function.name
    index = next((i for i, t in enumerate(tools) if t.function.name == name), None)
    if index is None:
        raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools ("
                         + ", ".join(repr(t.function.name) for t in tools) + ")")
    params, origin = _constraint("json", tools[index].function.parameters or EMPTY_PARAMETERS,
                                 f"tools[{index}].function.parameters")
    return Plan(tools=template, parser=parser_for("named", name), constraint=params, origin=origin)


def plan(body: Any, chat: bool, tool_call_parser: Optional[str]) -> Plan:
    """The request's tools, tool-call parser and output constraint (ValueError names the field)."""
    found = _constraints(body)
    p = _plan_tools(body, tool_call_parser) if chat else Plan()
    if p.constraint is not None and found:
        raise ValueError(f"{found[0][0]} cannot be combined with tool_choice {_choice_text(body.tool_choice)}, "
                         f"which constrains the answer itself")
    if len(found) > 1:
        raise ValueError(" and ".join(n for n, _ in found) + " are both set: give one output constraint")
    if found:
        p.constraint, p.origin = found[0][1]
    return p


def _choice_text(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
