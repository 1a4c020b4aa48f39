"""Anthropic's Messages API translated to the chat path and rendered back, one layer alone (no server): system,
turns, tool_use and tool_result blocks become exactly the chat messages a chat client would send for the same
conversation; tools and tool_choice become chat's; errors name the Messages field; a streamed answer (text and
calls read by the hermes parser) is a run of events Anthropic's SDK validates and accumulates to the message the
whole answer is. The served path: tests/roles/test_anthropic_messages.py."""
from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from router.events import FlowEvent, Usage
from router.openai import anthropic_api as aa
from router.openai import protocol as oa
from router.openai.tool_parsers import parser_for

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _req(**kw) -> aa.MessagesRequest:
    return aa.MessagesRequest.model_validate({"model": "m", "max_tokens": 8,
                                              "messages": [{"role": "user", "content": "hi"}], **kw})


def test_a_tool_turn_renders_as_the_chat_apis_messages_would():
    t = aa.to_chat_request(_req(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                                tools=[WEATHER], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Lyon?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two calls", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}]},
            {"type": "text", "text": "Thanks."}]}]))
    chat = oa.ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "two calls", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"},
        {"role": "user", "content": "Thanks."}]})
    assert oa.message_dicts(t.chat) == oa.message_dicts(chat)
    assert t.where == ["system", "messages[0]", "messages[1]", "messages[2].content[0]", "messages[2].content[1]",
                       "messages[2]"]
    (tool,) = t.chat.tools
    assert (tool.function.name, tool.function.parameters) == ("get_weather", WEATHER["input_schema"])
    assert t.chat.max_tokens == 8 and t.chat.tool_choice is None


@pytest.mark.parametrize("choice,chat,parallel", [
    ({"type": "auto"}, "auto", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "none"}, "none", None),
])
def test_tool_choice_becomes_chats(choice, chat, parallel):
    t = aa.to_chat_request(_req(tools=[WEATHER], tool_choice=choice, stop_sequences=["\n\n"], top_k=5))
    assert (t.chat.tool_choice, t.chat.parallel_tool_calls, t.chat.stop, t.chat.top_k) == \
        (chat, parallel, ["\n\n"], 5)
    named = aa.to_chat_request(_req(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}))
    assert named.chat.tool_choice.function.name == "get_weather"


@pytest.mark.parametrize("kw,field", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
     "messages[0].content[0].tool_use_id"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "messages[0].content[0].type"),
    (dict(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]),
     "messages[0].content[0].input"),
    (dict(system=[{"type": "image"}]), "system[0]"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (dict(tools=[{"input_schema": {}}]), "tools[0].name"),
    (dict(tool_choice={"type": "function"}), "tool_choice.type"),
    (dict(tool_choice={"type": "tool"}), "tool_choice.name"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(mcp_servers=[{"url": "x"}]), "mcp_servers"),
])
def test_what_is_not_served_is_refused_naming_the_messages_field(kw, field):
    with pytest.raises(ValueError) as e:
        aa.to_chat_request(_req(**kw))
    assert str(e.value).startswith(field), str(e.value)


def test_the_chat_paths_messages_are_relabelled_with_the_messages_field():
    t = aa.to_chat_request(_req(system="s", messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]))
    assert t.relabel("messages[3] is too long") == "messages[2].content[0] is too long"
    assert t.relabel("messages[0]: x") == "system: x"
    assert t.relabel("tools[1].function.parameters: not a schema") == "tools[1].input_schema: not a schema"
    assert t.relabel("tools[0].function.name: 'f' twice") == "tools[0].name: 'f' twice"
    assert t.relabel("tool_choice.function.name: 'x' is not one").startswith("tool_choice.name: ")
    assert t.relabel("stop: too many") == "stop_sequences: too many"
    assert t.relabel("temperature must be >= 0") == "temperature must be >= 0"


def _run(pieces: list[str], parser=None, reason: str = "stop", stop_reason=None,
         usage: Usage = Usage(prompt_tokens=30, completion_tokens=7, cached_tokens=16)):
    body = _req(tools=[WEATHER]) if parser is not None else _req()
    stream, whole = aa.MessageEventStream(body, "m", 30, parser), aa.ResponseMessage(body, "m", 30, parser)
    sse = ""
    for k, p in enumerate(pieces):
        last = k == len(pieces) - 1
        ev = FlowEvent("r", text=p, finish_reason=reason if last else None, stop_reason=stop_reason if last else None,
                       usage=usage if last else None)
        whole.add(ev)
        sse += stream.chunk(0, ev)
    sse += "".join(stream.end())
    events = [TypeAdapter(RawMessageStreamEvent).validate_python(json.loads(line[len("data: "):]))
              for line in sse.splitlines() if line.startswith("data: ") and '"ping"' not in line]
    message, bufs = None, {}
    for e in events:  # as client.messages.stream() assembles them
        message = accumulate_event(event=e, current_snapshot=message, json_bufs=bufs)
    return events, message, Message.model_validate(whole.json_body())


def test_streamed_text_and_calls_assemble_to_the_whole_message():
    pieces = ["Let me ", "look.<tool", '_call>{"name": "get_weather", "argu', 'ments": {"city": "Pa',
              'ris"}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>']
    events, streamed, whole = _run(pieces, parser_for("hermes"))
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert [e.type for e in events][-2:] == ["message_delta", "message_stop"]

    def strip(m: Message) -> list:
        return [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
                for b in m.content]
    assert strip(streamed) == strip(whole) == [("text", "Let me look.", None, None),
                                               ("tool_use", None, "get_weather", {"city": "Paris"}),
                                               ("tool_use", None, "get_weather", {"city": "Lyon"})]
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens, whole.usage.output_tokens) == (14, 16, 7)
    assert streamed.usage.output_tokens == 7


@pytest.mark.parametrize("reason,stop_reason,want", [
    ("stop", None, ("end_turn", None)),
    ("stop", "\n\n", ("stop_sequence", "\n\n")),
    ("stop", 7, ("end_turn", None)),  # a stop token id: Anthropic has no name for it
    ("length", None, ("max_tokens", None)),
])
def test_stop_reasons(reason, stop_reason, want):
    events, streamed, whole = _run(["Hello", " there"], None, reason, stop_reason)
    assert (whole.stop_reason, whole.stop_sequence) == (streamed.stop_reason, streamed.stop_sequence) == want
    assert whole.content[0].text == streamed.content[0].text == "Hello there"


def test_a_call_cut_off_by_max_tokens_stays_text_and_an_empty_answer_is_an_empty_block():
    _, streamed, whole = _run(['{"city": "Pa'], parser_for("named", "get_weather"), reason="length")
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason == "max_tokens"
    _, streamed, whole = _run([""], None)
    assert [(b.type, b.text) for b in whole.content] == [(b.type, b.text) for b in streamed.content] == [("text", "")]


def test_a_failure_mid_stream_is_an_error_event_in_anthropics_shape_and_nothing_follows():
    import grpc
    from anthropic.types import ErrorResponse

    from router.events import FlowError

    stream = aa.MessageEventStream(_req(), "m", 3)
    stream.chunk(0, FlowEvent("r", text="Hel"))
    sse = stream.error(FlowError(grpc.StatusCode.UNAVAILABLE, "request r: the decode worker went away"))
    assert sse.startswith("event: error\n")
    err = ErrorResponse.model_validate(json.loads(sse.split("data: ", 1)[1]))
    assert err.error.type == "overloaded_error" and "went away" in err.error.message
    assert stream.end() == []  # no message_delta / message_stop after the error
    assert aa.error_body(400, "x")["error"]["type"] == "invalid_request_error"


def test_vllms_request_extras_reach_the_generate_request():
    """allowed_token_ids, bad_words, cache_salt and priority pass through the translation to the GenerateRequest the
    router validates (as on the chat path)."""
    t = aa.to_chat_request(_req(allowed_token_ids=[5, 6], bad_words=["no"], cache_salt="t", priority=2))
    g = oa.to_generate_request(t.chat, token_ids=[1, 2])
    assert (list(g.allowed_token_ids), list(g.bad_words), g.cache_salt, g.priority) == ([5, 6], ["no"], "t", 2)
