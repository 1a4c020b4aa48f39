"""Anthropic's Messages API (router/openai/anthropic_api.py) driven by Anthropic's own SDK over a real router,
prefill and decode worker (gloo KV) serving the built-in ``tiny`` model: greedy text equals the offline engine's
answer to the chat-templated conversation, whole and streamed (``client.messages.stream``); stop sequences, the
length limit and usage (cached tokens apart) are reported as Anthropic reports them; forced, required and parsed
tool calls come back as ``tool_use`` blocks whose ``input`` fits the tool's schema, and the next turn's
``tool_result`` gets the answer the chat API gives the same conversation; ``count_tokens`` counts what a request
would send; bad input, a wrong key and an unknown model are answered in Anthropic's error shape, naming the field,
before any worker works."""
from __future__ import annotations

from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from engine import SamplingParams
from tests.roles.harness import offline, start_roles
from tests.router.test_openai_structured import AUTO_GRAMMAR

KEY = "anthropic-test-key-0123456789"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                            "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                                                      "maximum": 12}},
                                              "required": ["tz"], "additionalProperties": False}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}
"""(Anthropic's current SDK takes no ``temperature`` argument: the body's field sets it.)"""


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="anth-", router=dict(http_port=0, api_keys=(KEY,), tool_call_parser="hermes"))
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(roles):
    return anthropic.Anthropic(base_url=f"http://{roles.router.http_address}", api_key=KEY, max_retries=0,
                               timeout=60)


def _reference(roles, msgs: list[dict], n: int, tools=None) -> tuple[str, int]:
    tok = roles.router.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tools=tools), add_special_tokens=False)
    return offline([ids], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)])[0][1], len(ids)


def test_text_whole_and_streamed_equals_offline(roles, client):
    want, n_prompt = _reference(roles, [{"role": "system", "content": "You write Python."},
                                        {"role": "user", "content": "A loop, please."}], 8)
    kw = dict(model="tiny", system="You write Python.", max_tokens=8,
              messages=[{"role": "user", "content": [{"type": "text", "text": "A loop, please."}]}],
              extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert (m.role, m.stop_reason, m.stop_sequence, m.id[:4]) == ("assistant", "max_tokens", None, "msg_")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n_prompt and m.usage.output_tokens == 8
    with client.messages.stream(**kw) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == final.content[0].text == want and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    # a stop sequence ends it, and is named
    cut = want[3:6]
    stopped = client.messages.create(**{**kw, "stop_sequences": [cut, "\x00never"]})
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == \
        ("stop_sequence", cut, want[:want.index(cut)])
    # an earlier assistant turn is part of the conversation
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Count to three."}]
    again = client.messages.create(model="tiny", messages=turns, max_tokens=6, extra_body=GREEDY)
    assert again.content[0].text == _reference(roles, turns, 6)[0]
    # output_config.format: the answer follows the schema (client.messages.parse)
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: Literal["yes", "no"]

    parsed = client.messages.parse(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "Yes?"}],
                                   output_format=Answer, extra_body={"temperature": 0})
    assert isinstance(parsed.parsed_output, Answer), parsed.content
    # the model list, as Anthropic's SDK reads it (an OpenAI client still gets OpenAI's)
    assert [(m.id, m.type, m.display_name) for m in client.models.list()] == [("tiny", "model", "tiny")]
    # count_tokens: what that request sends
    assert client.messages.count_tokens(model="tiny", messages=turns).input_tokens == _reference(roles, turns, 1)[1]


def test_tool_use_forced_required_parsed_and_answered(roles, client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, extra_body={"temperature": 0})
    m = client.messages.create(**kw, tool_choice={"type": "tool", "name": "get_time"})
    (use,) = m.content
    assert (use.type, use.name, m.stop_reason) == ("tool_use", "get_time", "tool_use") and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMAS["get_time"])
    with client.messages.stream(**kw, tool_choice={"type": "tool", "name": "get_time"}) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_time", use.input)]
    one = client.messages.create(**{**kw, "max_tokens": 120},
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (only,) = one.content
    jsonschema.validate(only.input, SCHEMAS[only.name])
    auto = client.messages.create(**{**kw, "max_tokens": 80, "extra_body": {
        "temperature": 0, "structured_outputs": {"grammar": AUTO_GRAMMAR}}})
    (weather,) = [b for b in auto.content if b.type == "tool_use"]
    assert weather.name == "get_weather" and auto.stop_reason == "tool_use"
    jsonschema.validate(weather.input, SCHEMAS["get_weather"])
    # the next turn: the call and its result; the answer is the chat API's to the same conversation
    turn = [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": weather.id, "name": weather.name,
                                                      "input": weather.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": weather.id,
                                          "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model="tiny", messages=turn, tools=TOOLS, tool_choice={"type": "none"},
                                    max_tokens=10, extra_body=GREEDY)
    oai = openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key=KEY, max_retries=0, timeout=60)
    chat = oai.chat.completions.create(
        model="tiny", temperature=0, max_tokens=10, tool_choice="none", extra_body={"ignore_eos": True},
        tools=[{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                 **({"description": t["description"]} if "description" in t
                                                    else {})}} for t in TOOLS],
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": weather.id, "type": "function",
             "function": {"name": weather.name, "arguments": __import__("json").dumps(weather.input)}}]},
            {"role": "tool", "tool_call_id": weather.id, "content": "sunny, 21 C"}])
    assert answer.content[0].text == chat.choices[0].message.content
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert client.messages.count_tokens(model="tiny", messages=turn, tools=TOOLS).input_tokens == \
        chat.usage.prompt_tokens


def test_errors_come_in_anthropics_shape_naming_the_field_before_any_worker_works(roles, client):
    p_eng, d_eng = roles.prefills[0].engine, roles.decodes[0].engine
    before = (p_eng.prefix_cache_queries, d_eng.prefix_cache_queries)
    for kw, head in (
            (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                                      "media_type": "image/png",
                                                                                      "data": "AA=="}}]}]),
             "messages[0].content[0].type"),
            (dict(messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
            (dict(messages=ASK, tools=[WEATHER, WEATHER]), "tools[1].name"),
            (dict(messages=ASK, extra_body={"temperature": -1}), "temperature"),
            (dict(messages=ASK, output_config={"format": {"type": "json_schema", "schema": {"type": "nope"}}}),
             "output_config.format"),
            (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                          "content": "1"}]}]), "messages[0].content[0].tool_use_id")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="tiny", max_tokens=5, **kw)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith(head), (kw, e.value.body)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    base = f"http://{roles.router.http_address}"
    r = httpx.post(f"{base}/v1/messages", json={"model": "tiny", "messages": ASK}, headers={"x-api-key": KEY},
                   timeout=30)  # max_tokens is required, as Anthropic has it
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens"), r.text
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert (p_eng.prefix_cache_queries, d_eng.prefix_cache_queries) == before
    # a bearer token works too (the SDK's auth_token)
    bearer = anthropic.Anthropic(base_url=base, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(model="tiny", max_tokens=2, messages=ASK).usage.output_tokens >= 1
