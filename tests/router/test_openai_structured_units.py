"""The request and response side of structured outputs and tools, one layer at a time (no cluster): what
``router.openai.structured.plan`` makes of the request fields, the chat template rendering tools and past calls
as transformers does, and OpenAI's tool_calls shapes out of ``ResponseBody`` / ``EventStream``."""
from __future__ import annotations

import json

import pytest

from engine import Tokenizer
from router.openai import protocol as oa
from router.openai import responses as rs
from router.events import FlowEvent
from router.openai.structured import plan
from router.openai.tool_parsers import parser_for

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather <in> a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
REF_TOOL = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"when": {"$ref": "#/$defs/Date"}}, "$defs": {"Date": {"type": "string"}}}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(**kw) -> oa.ChatCompletionRequest:
    return oa.ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def test_named_and_required_tool_choice_become_vllms_schemas():
    named = plan(_chat(tools=[TOOL, REF_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                 True, None)
    assert named.constraint.json == TOOL["function"]["parameters"] and named.parser.kind == "named"
    assert [t["function"]["name"] for t in named.tools] == ["get_weather", "book"]
    req = plan(_chat(tools=[TOOL, REF_TOOL], tool_choice="required"), True, None)
    schema = req.constraint.json
    assert (schema["type"], schema["minItems"]) == ("array", 1)
    assert [o["properties"]["name"] for o in schema["items"]["anyOf"]] == [{"type": "string", "enum": ["get_weather"]},
                                                                          {"type": "string", "enum": ["book"]}]
    assert all(o["required"] == ["name", "parameters"] for o in schema["items"]["anyOf"])
    # $defs lifted to the top, where "#/$defs/Date" resolves
    assert schema["$defs"] == {"Date": {"type": "string"}}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert "maxItems" not in schema
    one = plan(_chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), True, None).constraint.json
    assert one["maxItems"] == 1


def test_auto_none_and_defaults():
    assert plan(_chat(tools=[TOOL]), True, "hermes").parser.kind == "hermes"  # tools given: auto
    with pytest.raises(ValueError, match="--tool-call-parser"):
        plan(_chat(tools=[TOOL]), True, None)
    none = plan(_chat(tools=[TOOL], tool_choice="none"), True, None)
    assert none.parser is None and none.constraint is None and none.tools  # rendered, never parsed
    assert plan(_chat(), True, None).tools is None


def test_constraints_and_relabelled_errors():
    p = plan(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
             True, None)
    assert p.constraint.json == {"type": "object"} and p.origin == "response_format.json_schema.schema"
    assert p.relabel("structured_outputs.json: bad thing") == "response_format.json_schema.schema: bad thing"
    assert p.relabel("structured_outputs cannot be used with beam_width") == \
        "response_format cannot be used with beam_width"
    assert p.relabel("max_tokens must be >= 1") == "max_tokens must be >= 1"
    assert plan(_chat(response_format={"type": "text"}), True, None).constraint is None
    assert plan(_chat(guided_choice=["a", "b"]), True, None).constraint.choice == ["a", "b"]
    with pytest.raises(ValueError, match="^guided_choice must not be empty"):
        plan(_chat(guided_choice=[]), True, None)
    with pytest.raises(ValueError, match="response_format.json_schema is required"):
        plan(_chat(response_format={"type": "json_schema"}), True, None)
    with pytest.raises(ValueError, match="structured_outputs: set only one of"):
        plan(_chat(structured_outputs={"regex": "a", "choice": ["b"]}), True, None)
    with pytest.raises(ValueError, match="cannot be combined with tool_choice"):
        plan(_chat(tools=[TOOL], tool_choice="required", guided_regex="a"), True, None)


QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{% for tc in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_chat_template_gets_tools_and_past_calls_as_transformers_passes_them():
    base = Tokenizer.builtin()
    tok = Tokenizer(base._tok, {"chat_template": QWEN_LIKE, "bos_token": "<|bos|>", "eos_token": "<|eos|>"})
    body = _chat(tools=[TOOL], messages=[
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = oa.render_chat(body, tok, plan(body, True, "hermes").tools)
    # tojson as transformers has it: plain JSON, no HTML escapes of <, > in a schema
    assert json.dumps(TOOL, ensure_ascii=False) in text and "\\u003c" not in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # arguments passed as a dict
    assert text.endswith("<|im_start|>tool\nsunny<|im_end|><|im_start|>assistant")
    cont = oa.render_chat(_chat(messages=[*MSGS, {"role": "assistant", "content": "It is"}],
                                continue_final_message=True), tok)
    assert cont.endswith("<|im_start|>assistant\nIt is")
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"):
        oa.message_dicts(_chat(messages=[*MSGS, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}]))


HERMES_OUT = ['Checking. <tool', '_call>{"name": "get_weather", "argu', 'ments": {"city": "Pa', 'ris"}}</tool_call>']


def _events(pieces: list[str], reason: str = "stop") -> list[FlowEvent]:
    return [FlowEvent("r", text=t, finish_reason=reason if i == len(pieces) - 1 else None)
            for i, t in enumerate(pieces)]


def test_whole_response_has_tool_calls_and_finish_reason():
    whole = rs.ResponseBody("id", True, "tiny", 1, 5, str, parser_for("hermes"))
    for ev in _events(HERMES_OUT):
        whole.add(0, ev)
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    named = rs.ResponseBody("id", True, "tiny", 1, 5, str, parser_for("named", "get_weather"))
    for ev in _events(['{"city": ', '"Rome"}']):
        named.add(0, ev)
    choice = named.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None  # OpenAI: a forced call stops
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'


def test_streamed_tool_call_deltas_as_the_sdk_assembles_them():
    s = rs.EventStream("id", True, "tiny", 5, str, tool_parser=parser_for("hermes"))
    chunks = [json.loads(c[6:]) for ev in _events(HERMES_OUT) if (c := s.chunk(0, ev))]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "Checking. "}
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first = calls[0]
    assert (first["index"], first["type"], first["function"]["name"]) == (0, "function", "get_weather")
    assert first["id"].startswith("chatcmpl-tool-")
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in calls[1:])
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    # a length cut keeps "length"; text without calls stays content with the model's finish reason
    plain = rs.EventStream("id", True, "tiny", 5, str, tool_parser=parser_for("hermes"))
    last = json.loads(plain.chunk(0, FlowEvent("r", text="no tools", finish_reason="stop"))[6:])["choices"][0]
    assert last["delta"] == {"role": "assistant", "content": "no tools"} and last["finish_reason"] == "stop"


def test_echo_prefixes_each_choice():
    whole = rs.ResponseBody("id", False, "tiny", 2, 3, str, echo=["p0", "p1"])
    whole.add(0, FlowEvent("r", text=" a", finish_reason="stop"))
    whole.add(1, FlowEvent("r", text=" b", finish_reason="stop"))
    assert [c["text"] for c in whole.json()["choices"]] == ["p0 a", "p1 b"]
    s = rs.EventStream("id", False, "tiny", 3, str, echo=["p0"])
    texts = [json.loads(s.chunk(0, ev)[6:])["choices"][0]["text"] for ev in _events([" x", " y"])]
    assert texts == ["p0 x", " y"]


def test_tool_call_parser_flag_reaches_the_router_config():
    from cluster.cli import build_parser
    from cluster.up_flags import router_overrides
    from router.config import RouterConfig
    from router.openai.tool_parsers import TOOL_CALL_PARSERS

    for cmd in (["up"], ["router", "--namespace", "ns"]):
        for name in TOOL_CALL_PARSERS:  # the flag's choices are the router's parsers
            args = build_parser().parse_args([*cmd, "--tool-call-parser", name])
            assert RouterConfig(**router_overrides(args)).tool_call_parser == name
    assert RouterConfig(**router_overrides(build_parser().parse_args(["up"]))).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--tool-call-parser", "mistral"])
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        RouterConfig(tool_call_parser="mistral")
