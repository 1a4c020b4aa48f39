"""Structured outputs and tool calling through the OpenAI-compatible API, driven by the official ``openai`` client
over a real router, prefill and decode worker (gloo KV) serving the built-in ``tiny`` model: Pydantic models
through ``chat.completions.parse`` (streamed and not, greedy and seeded, n=3), regex and choice, named, required
and auto tool calls whose arguments validate against the tool's schema, /tokenize and /detokenize, echo, and bad
input answered 400 naming the field before any worker works. One cluster for the module (startup is the cost)."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Literal, Optional

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from engine import SamplingParams, StructuredOutputsParams
from tests.roles.harness import offline, start_roles

KEY = "structured-test-key-0123456789"


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    # qwen3's reasoning parser with thinking off by default (as --default-chat-template-kwargs sets it): plain chats
    # stay all content; a request turns thinking on with chat_template_kwargs
    r = start_roles(tag="so-", router=dict(http_port=0, api_keys=(KEY,), tool_call_parser="hermes",
                                           reasoning_parser="qwen3",
                                           default_chat_template_kwargs={"enable_thinking": False}))
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(roles):
    return openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(roles, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://{roles.router.http_address}{path}", json=body,
                      headers={"authorization": f"Bearer {KEY}"}, timeout=60)


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip_code: int = Field(ge=1000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


class Reading(BaseModel):
    sensor: Literal["t1", "t2"]
    value: float = Field(ge=-10.0, le=10.0)
    ok: bool
    note: Optional[str] = Field(max_length=6)


MSGS = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Describe a person."}]


@pytest.mark.parametrize("model", [Person, Reading])
def test_parse_pydantic_greedy_seeded_and_n3(client, model):
    r = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=model, temperature=0,
                                      max_completion_tokens=150)
    c = r.choices[0]
    assert c.finish_reason == "stop" and isinstance(c.message.parsed, model), c.message.content
    assert model.model_validate_json(c.message.content) == c.message.parsed
    seeded = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=model, temperature=1.0,
                                           seed=7, n=3, max_completion_tokens=150)
    assert sorted(ch.index for ch in seeded.choices) == [0, 1, 2]
    assert all(isinstance(ch.message.parsed, model) for ch in seeded.choices), [ch.message.content
                                                                               for ch in seeded.choices]
    again = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=model, temperature=1.0,
                                          seed=7, n=3, max_completion_tokens=150)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in seeded.choices]


def test_streamed_parse_equals_the_whole_answer(client):
    """No max_tokens: vLLM's chat default (the rest of the context), so the grammar, not 16 tokens, ends it."""
    whole = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=Person, temperature=0)
    assert whole.usage.completion_tokens > 16 and whole.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model="tiny", messages=MSGS, response_format=Person, temperature=0) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed
    assert final.choices[0].message.content == whole.choices[0].message.content


def test_json_object_regex_choice_and_offline_equality(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the constraint keeps it a JSON object's prefix, cut by max_tokens
        assert r.choices[0].message.content.lstrip().startswith("{")
    rx = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    c = client.completions.create(model="tiny", prompt="def f(x):", temperature=0, max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": rx}})
    assert re.fullmatch(rx, c.choices[0].text) and c.choices[0].finish_reason == "stop"
    # greedy constrained output through the cluster = the offline engine's, token for token
    want = offline(["def f(x):"], [SamplingParams(max_tokens=20, temperature=0.0,
                                                  structured_outputs=StructuredOutputsParams(regex=rx))])[0]
    assert c.choices[0].text == want[1]
    old = client.completions.create(model="tiny", prompt="def f(x):", temperature=0, max_tokens=20,
                                    extra_body={"guided_regex": rx})
    assert old.choices[0].text == c.choices[0].text
    choices = ["alpha", "beta", "gamma delta"]
    ch = client.chat.completions.create(model="tiny", messages=MSGS, temperature=1.0, seed=3, n=3, max_tokens=10,
                                        extra_body={"structured_outputs": {"choice": choices}})
    assert all(x.message.content in choices for x in ch.choices)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                                                "maximum": 12}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_and_required_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
                                       max_tokens=40)
    m = r.choices[0].message
    assert [c.function.name for c in m.tool_calls] == ["get_time"] and not m.content
    _check_calls(m.tool_calls)
    streamed = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                                   temperature=0, max_tokens=40, stream=True))
    deltas = [tc for ch in streamed for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_time" and deltas[0].index == 0
    assert "".join(d.function.arguments or "" for d in deltas) == m.tool_calls[0].function.arguments
    req = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=5, n=3, max_tokens=120)
    for ch in req.choices:
        assert ch.finish_reason == "tool_calls", ch.message
        _check_calls(ch.message.tool_calls)
    # the SDK's own strict function tools: parse() hands back the arguments as the Pydantic model
    tool = openai.pydantic_function_tool(Address, name="lookup_address")
    parsed = client.chat.completions.parse(model="tiny", messages=ASK, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
    (call,) = parsed.choices[0].message.tool_calls  # parallel_tool_calls false: exactly one
    assert isinstance(call.function.parsed_arguments, Address)


AUTO_GRAMMAR = r'''
start: "<tool_call>" call "</tool_call>"
call: %json{"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false}}, "required": ["name", "arguments"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}
'''


def test_auto_tool_call_parsed_by_hermes(client):
    """tool_choice auto: the answer is free text the hermes parser reads; a grammar forces the tiny model to
    write a call in the Hermes format, so the parse has something to find."""
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {"grammar": AUTO_GRAMMAR}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    _check_calls(c.message.tool_calls)
    parts = list(client.chat.completions.create(**kw, stream=True))
    calls: dict = {}
    for p in parts:
        for d in p.choices[0].delta.tool_calls or []:
            e = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
            e["args"] += d.function.arguments or ""
    assert [(e["name"], e["args"]) for e in calls.values()] == [("get_weather", c.message.tool_calls[0].function.arguments)]
    assert parts[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice none: the same grammar's text stays content
    none = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content.startswith("<tool_call>")


def test_tokenize_detokenize_and_echo(roles, client):
    tok = roles.router.tokenizer
    r = _post(roles, "/tokenize", {"model": "tiny", "prompt": "def add(a, b):"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("def add(a, b):") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == roles.router.limits.max_context_length and body["token_strs"] is None
    strs = _post(roles, "/tokenize", {"prompt": "def add(a, b):", "return_token_strs": True}).json()["token_strs"]
    assert strs == tok.convert_ids_to_tokens(body["tokens"])
    chat = _post(roles, "/tokenize", {"messages": ASK, "tools": TOOLS}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True, tools=TOOLS),
                                        add_special_tokens=False)
    d = _post(roles, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert d.status_code == 200 and d.json() == {"prompt": tok.decode(body["tokens"], skip_special_tokens=False)}
    assert _post(roles, "/detokenize", {"tokens": [10 ** 6]}).status_code == 400
    assert httpx.post(f"http://{roles.router.http_address}/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401
    plain = client.completions.create(model="tiny", prompt="import os", max_tokens=5, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="import os", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "import os" + plain.choices[0].text
    parts = list(client.completions.create(model="tiny", prompt="import os", max_tokens=5, temperature=0, echo=True,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == echoed.choices[0].text


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
    ("/v1/completions", {"guided_regex": "([a-z"}, "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": "start: foo_undefined"}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools.0.function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ("/v1/chat/completions", {"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "response_format and guided_regex"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"use_beam_search": True, "n": 2, "response_format": {"type": "json_object"}},
     "response_format cannot be used with beam_width"),
    ("/v1/chat/completions", {"thinking_token_budget": -1, "chat_template_kwargs": {"enable_thinking": True}},
     "thinking_token_budget must be in [0, 2**31)"),
    ("/v1/chat/completions", {"thinking_token_budget": 2**40, "chat_template_kwargs": {"enable_thinking": True}},
     "thinking_token_budget must be in [0, 2**31)"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages is set by"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs: 'not a name'"),
]


@pytest.mark.parametrize("path,extra,field", BAD)
def test_bad_input_is_400_naming_the_field_before_any_worker_works(roles, path, extra, field):
    p_eng, d_eng = roles.prefills[0].engine, roles.decodes[0].engine
    before = (p_eng.prefix_cache_queries, d_eng.prefix_cache_queries)
    base = {"model": "tiny", "max_tokens": 5}
    base.update({"messages": ASK} if path.endswith("chat/completions") else {"prompt": "x"})
    r = _post(roles, path, {**base, **extra})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.json()
    assert (p_eng.prefix_cache_queries, d_eng.prefix_cache_queries) == before


def test_readme_structured_outputs_example_runs(client):
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    m = re.search(r"<!-- structured-outputs-example[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "the README lost its structured-outputs example"
    out = io.StringIO()
    scope: dict = {"client": client}
    with contextlib.redirect_stdout(out):
        exec(m.group(1), scope)  # noqa: S102 - our own README
    assert isinstance(scope["r"].choices[0].message.parsed, scope["City"])
    assert out.getvalue().startswith("name=")


def _flat(tool: dict) -> dict:
    """A chat tool as the Responses API writes it (the function's fields beside ``type``)."""
    return {"type": "function", **tool["function"]}


def test_responses_api_function_calls_forced_read_and_answered(client):
    """Function calling on /v1/responses through the OpenAI SDK: a named tool_choice and "required" force calls
    whose arguments validate against the tool's schema, whole and streamed alike (the streamed argument deltas add
    up to the whole answer's); "auto" reads a Hermes call out of the text (a grammar makes the tiny model write
    one); the agent's next turn, sending the call and its output back as input items, gets the answer the chat API
    gives the same conversation (so both render it through the chat template the same way)."""
    tools = [_flat(t) for t in TOOLS]
    kw = dict(model="tiny", input="What is the weather in Paris?", tools=tools, temperature=0, max_output_tokens=40)
    r = client.responses.create(**kw, tool_choice={"type": "function", "name": "get_time"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_time" and r.status == "completed"
    assert [t.name for t in r.tools] == ["get_weather", "get_time"] and r.tool_choice.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_time"])
    events = list(client.responses.create(**kw, tool_choice={"type": "function", "name": "get_time"}, stream=True))
    done = events[-1].response
    assert [(i.type, i.name, i.arguments) for i in done.output] == [("function_call", "get_time", call.arguments)]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [call.arguments]
    req = client.responses.create(**{**kw, "max_output_tokens": 120}, tool_choice="required",
                                  parallel_tool_calls=False)
    (only,) = req.output  # parallel_tool_calls false: exactly one call
    jsonschema.validate(json.loads(only.arguments), SCHEMAS[only.name])
    auto = client.responses.create(**{**kw, "max_output_tokens": 80},
                                   extra_body={"structured_outputs": {"grammar": AUTO_GRAMMAR}})
    assert [(i.type, i.name) for i in auto.output] == [("function_call", "get_weather")]
    (weather,) = auto.output
    jsonschema.validate(json.loads(weather.arguments), SCHEMAS["get_weather"])
    # the next turn: the call and its output go back as input; the answer is the chat API's to the same turns
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": weather.call_id, "name": weather.name,
             "arguments": weather.arguments},
            {"type": "function_call_output", "call_id": weather.call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model="tiny", input=turn, tools=tools, tool_choice="none", temperature=0,
                                     max_output_tokens=12, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(
        model="tiny", tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12, extra_body={"ignore_eos": True},
        messages=[ASK[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": weather.call_id, "type": "function",
             "function": {"name": weather.name, "arguments": weather.arguments}}]},
            {"role": "tool", "tool_call_id": weather.call_id, "content": "sunny, 21 C"}])
    assert answer.output_text == chat.choices[0].message.content and answer.usage.input_tokens == \
        chat.usage.prompt_tokens
    # and a different tool output is a different prompt (the output item is rendered, not dropped)
    other = client.responses.create(model="tiny", input=turn[:2] + [{**turn[2], "output": "snow"}], tools=tools,
                                    tool_choice="none", temperature=0, max_output_tokens=12,
                                    extra_body={"ignore_eos": True})
    assert other.usage.input_tokens != answer.usage.input_tokens or other.output_text != answer.output_text


def test_responses_api_tool_errors_name_the_responses_field(roles, client):
    p_eng, d_eng = roles.prefills[0].engine, roles.decodes[0].engine
    before = (p_eng.prefix_cache_queries, d_eng.prefix_cache_queries)
    tools = [_flat(t) for t in TOOLS]
    for kw, field, head in (
            (dict(tools=tools, tool_choice={"type": "function", "name": "nope"}), "tool_choice", "tool_choice.name"),
            (dict(tools=[tools[0], tools[0]]), "tools", "tools[1].name"),
            (dict(tools=[{"type": "web_search_preview"}]), "tools", "tools[0].type"),
            (dict(tool_choice="required"), "tool_choice", "tool_choice"),
            (dict(tools=tools, tool_choice="required", text={"format": {"type": "json_object"}}), "text",
             "text.format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input="x", **kw)
        assert e.value.body["param"] == field and e.value.body["message"].startswith(head), (kw, e.value.body)
    assert (p_eng.prefix_cache_queries, d_eng.prefix_cache_queries) == before


THINK = {"chat_template_kwargs": {"enable_thinking": True}}


def _thinking_reference(roles, msgs: list[dict], budget: int, n: int, tools=None) -> tuple[str, str]:
    """The offline engine's greedy answer to ``msgs`` rendered with thinking on, under the same budget, split at
    the first ``</think>`` by plain string partition: (reasoning, content)."""
    tok = roles.router.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tools=tools, enable_thinking=True),
                     add_special_tokens=False)
    end, start = (tok.encode(m, add_special_tokens=False) for m in ("</think>", "<think>"))
    text = offline([ids], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, reasoning_end_token_ids=end,
                                          reasoning_start_token_ids=start, thinking_token_budget=budget)])[0][1]
    reasoning, sep, content = text.partition("</think>")
    assert sep
    return reasoning, content


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def test_reasoning_is_split_from_the_answer_whole_and_streamed(roles, client):
    """vLLM's reasoning parser (qwen3): with thinking on, the text before ``</think>`` is ``message.reasoning`` (and
    ``reasoning_content``), the rest ``content``; the budget closed the block after 5 tokens on the workers."""
    want_r, want_c = _thinking_reference(roles, ASK, 5, 30)
    kw = dict(model="tiny", messages=ASK, max_tokens=30, temperature=0,
              extra_body={**THINK, "thinking_token_budget": 5, "ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert (_extra(msg, "reasoning"), _extra(msg, "reasoning_content"), msg.content) == (want_r, want_r, want_c)
    n_end = len(roles.router.tokenizer.encode("</think>", add_special_tokens=False))
    assert whole.usage.completion_tokens_details.reasoning_tokens == 5 + n_end  # the block and its end marker
    thought = content = ""
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens_details.reasoning_tokens == 5 + n_end
        d = chunk.choices[0].delta if chunk.choices else None
        if d is not None:
            thought += _extra(d, "reasoning") or ""
            content += d.content or ""
            assert _extra(d, "reasoning") == _extra(d, "reasoning_content")
    assert (thought, content) == (want_r, want_c)
    # include_reasoning false: the same content, no reasoning
    kw["extra_body"] = {**kw["extra_body"], "include_reasoning": False}
    quiet = client.chat.completions.create(**kw).choices[0].message
    assert quiet.content == want_c and _extra(quiet, "reasoning") is None
    # thinking off (the server's default here): all content, as the plain engine writes it
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True, "thinking_token_budget": 3})
    assert _extra(plain.choices[0].message, "reasoning") is None
    tok = roles.router.tokenizer
    ids = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True), add_special_tokens=False)
    assert plain.choices[0].message.content == offline([ids], [SamplingParams(max_tokens=12, temperature=0.0,
                                                                            ignore_eos=True)])[0][1]


def test_structured_outputs_constrain_the_answer_after_the_reasoning(roles, client):
    """With a reasoning parser the grammar waits for the block to close (vLLM's rule): the reasoning is what the
    unconstrained model writes, the answer after it parses as the Pydantic model, streamed or not."""
    want_r, _ = _thinking_reference(roles, MSGS, 6, 12)
    kw = dict(model="tiny", messages=MSGS, response_format=Reading, temperature=0, max_completion_tokens=150,
              extra_body={**THINK, "thinking_token_budget": 6})
    r = client.chat.completions.parse(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and isinstance(c.message.parsed, Reading), c.message.content
    assert _extra(c.message, "reasoning") == want_r
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == c.message.parsed


def test_tool_calls_are_read_from_the_content_after_the_reasoning(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
              extra_body={**THINK, "thinking_token_budget": 4, "structured_outputs": {"grammar": AUTO_GRAMMAR}})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    _check_calls(c.message.tool_calls)
    assert _extra(c.message, "reasoning") and "<tool_call>" not in _extra(c.message, "reasoning")
    assert not c.message.content


def test_responses_and_messages_apis_answer_the_reasoning_in_their_own_items(roles, client):
    """The same split on OpenAI's Responses API (a ``reasoning`` output item before the message, its tokens in
    ``reasoning_tokens``) and Anthropic's Messages API (``thinking: enabled`` with ``budget_tokens``: a
    ``thinking`` block before the text), whole and streamed through each vendor's SDK."""
    import anthropic

    want_r, want_c = _thinking_reference(roles, ASK, 5, 30)
    n_end = len(roles.router.tokenizer.encode("</think>", add_special_tokens=False))
    kw = dict(model="tiny", input=ASK[0]["content"], max_output_tokens=30, temperature=0,
              extra_body={**THINK, "thinking_token_budget": 5, "ignore_eos": True})
    r = client.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == want_r and r.output_text == want_c
    assert r.usage.output_tokens_details.reasoning_tokens == 5 + n_end
    events = list(client.responses.create(**kw, stream=True))
    final = events[-1].response  # (response.incomplete: max_output_tokens ended it)
    assert events[-1].type == "response.incomplete" and [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == want_r and final.output_text == want_c
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert "".join(deltas) == want_r and done == [want_r]
    # a reasoning item sent back with the conversation (as the Agents SDK does) is taken and left out of the prompt
    again = client.responses.create(model="tiny", input=[*[i.model_dump(exclude_none=True) for i in r.output],
                                                         {"role": "user", "content": "and Rome?"}],
                                    max_output_tokens=4, temperature=0)
    assert again.status in ("completed", "incomplete")

    ant = anthropic.Anthropic(base_url=f"http://{roles.router.http_address}", api_key=KEY, max_retries=0)
    akw = dict(model="tiny", max_tokens=30, messages=ASK, thinking={"type": "enabled", "budget_tokens": 5},
               extra_body={"temperature": 0, "ignore_eos": True})
    m = ant.messages.create(**akw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", want_r), ("text", want_c)]
    with ant.messages.stream(**akw) as s:
        streamed = s.get_final_message()
    assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == [
        b.model_dump(exclude={"signature"}) for b in m.content]
    # thinking disabled: the template closes the block, the answer is all text
    off = ant.messages.create(**{**akw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
    with pytest.raises(anthropic.BadRequestError, match="thinking.budget_tokens"):
        ant.messages.create(**{**akw, "thinking": {"type": "enabled", "budget_tokens": 30}})
