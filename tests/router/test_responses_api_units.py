"""The Responses API's translation to the chat path and its rendering, one layer alone (no server): function tools
and tool_choice become chat's, function_call / function_call_output items become the assistant turn's
``tool_calls`` and ``tool`` messages (checked against chat's own rendering through a real chat template), errors
name the Responses field, and a streamed answer read by the hermes parser comes out as the typed events OpenAI's
SDK assembles to the same items the whole answer has. The served path is tested through a cluster in
tests/router/test_openai_structured.py and tests/roles/test_http_openai.py."""
from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from router.events import FlowEvent
from router.openai import protocol as oa
from router.openai import responses_api as ora
from router.openai.tool_parsers import parser_for

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def _req(**kw) -> ora.ResponsesRequest:
    return ora.ResponsesRequest.model_validate({"model": "m", "input": "x", **kw})


def test_function_tools_and_tool_choice_become_chats():
    t = ora.to_chat_request(_req(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False))
    (tool,) = t.chat.tools
    assert tool.function.name == "get_weather" and tool.function.parameters == WEATHER["parameters"]
    assert tool.function.description == "Weather in a city"
    assert t.chat.tool_choice.function.name == "get_weather" and t.chat.parallel_tool_calls is False
    assert ora.to_chat_request(_req(tools=[WEATHER], tool_choice="required")).chat.tool_choice == "required"
    assert ora.to_chat_request(_req(tools=[WEATHER])).chat.tool_choice is None  # the chat default: auto


def test_a_tool_turn_renders_as_the_chat_apis_messages_would():
    """The conversation an agent sends back (its call and the call's output) becomes exactly the chat messages a
    chat client would send for the same turn: one assistant message with the text and the call, then a tool
    message answering it by id."""
    t = ora.to_chat_request(_req(instructions="Be brief.", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        CALL, {**CALL, "call_id": "call_2", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]))
    chat = oa.ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]})
    assert oa.message_dicts(t.chat) == oa.message_dicts(chat)
    assert t.where == ["instructions", "input[0]", "input[1]", "input[4]", "input[5]"]
    # a call with no assistant text before it is an assistant turn of its own
    alone = ora.to_chat_request(_req(input=[{"role": "user", "content": "hi"}, CALL]))
    assert oa.message_dicts(alone.chat)[-1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


@pytest.mark.parametrize("kw,field", [
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(tools=[{"type": "function"}]), "tools[0].name"),
    (dict(tool_choice={"type": "file_search"}), "tool_choice"),
    (dict(tool_choice={"type": "function"}), "tool_choice.name"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "1"}]), "input[0].call_id"),
    (dict(input=[CALL, CALL]), "input[1].call_id"),
    (dict(input=[{**CALL, "name": ""}]), "input[0].name"),
    (dict(input=[{**CALL, "arguments": {"city": "Paris"}}]), "input[0].arguments"),
    (dict(input=[CALL, {"type": "function_call_output", "call_id": "call_1", "output": 3}]), "input[1].output"),
    (dict(input=[{"type": "image_generation_call"}]), "input[0].type"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input: holds no message"),
    (dict(input=["hi"]), "input[0]"),
])
def test_what_is_not_served_is_refused_naming_the_responses_field(kw, field):
    with pytest.raises(ValueError) as e:
        ora.to_chat_request(_req(**kw))
    assert str(e.value).startswith(field), str(e.value)


def test_the_chat_paths_messages_are_relabelled_with_the_responses_field():
    t = ora.to_chat_request(_req(instructions="sys", input=[{"role": "user", "content": "a"}, CALL]))
    assert t.relabel("messages[2].tool_calls[0].function.arguments must be JSON") == \
        "input[1].tool_calls[0].function.arguments must be JSON"
    assert t.relabel("messages[0] is odd") == "instructions is odd"
    assert t.relabel("tools[1].function.name: 'f' is given twice") == "tools[1].name: 'f' is given twice"
    assert t.relabel("tool_choice.function.name: 'x' is not one of the tools").startswith("tool_choice.name: ")
    assert t.relabel("response_format.json_schema.schema: bad").startswith("text.format.schema: ")
    assert t.relabel("max_tokens must be at most 10").startswith("max_output_tokens must")
    assert t.relabel("temperature must be >= 0") == "temperature must be >= 0"


def _events(sse: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in sse.splitlines() if line.startswith("data: ")]


def _stream(pieces: list[str], parser=None, reason: str = "stop") -> tuple[list[dict], ora.ResponseCollector]:
    body = _req(tools=[WEATHER]) if parser is not None else _req()
    out = ora.ResponseEventStream(body, "m", 3, parser)
    whole = ora.ResponseCollector(body, "m", 3, parser)
    sse = ""
    for k, p in enumerate(pieces):
        ev = FlowEvent("r", text=p, finish_reason=reason if k == len(pieces) - 1 else None)
        whole.add(ev)
        sse += out.chunk(0, ev)
    sse += "".join(out.end())
    events = _events(sse)
    for e in events:  # every event is one the OpenAI SDK knows, with the fields it requires
        TypeAdapter(ResponseStreamEvent).validate_python(e)
    return events, whole


def test_a_streamed_answer_with_text_and_calls_gives_the_whole_answers_items():
    pieces = ["Let me ", "look.<tool", '_call>{"name": "get_weather", "argu', 'ments": {"city": "Pa',
              'ris"}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>']
    events, whole = _stream(pieces, parser_for("hermes"))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    final = Response.model_validate(events[-1]["response"])
    want = Response.model_validate(whole.json_body())
    strip = [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
              [c.text for c in getattr(i, "content", None) or []]) for i in final.output]
    assert strip == [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
                      [c.text for c in getattr(i, "content", None) or []]) for i in want.output]
    assert strip == [("message", None, None, ["Let me look."]),
                     ("function_call", "get_weather", '{"city": "Paris"}', []),
                     ("function_call", "get_weather", '{"city": "Lyon"}', [])]
    # each call's streamed arguments add up to its item's, announced under its item id and output index
    for index, item in enumerate(final.output[1:], start=1):
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["item_id"] == item.id and e["output_index"] == index]
        assert "".join(deltas) == item.arguments
        (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"
                   and e["item_id"] == item.id]
        assert done["arguments"] == item.arguments
        added = [e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == index]
        assert added[0]["item"]["name"] == "get_weather" and added[0]["item"]["call_id"] == item.call_id
    # each item is closed (output_item.done) before the next opens
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")


def test_a_forced_call_has_no_message_and_plain_text_has_no_call():
    events, whole = _stream(['{"city"', ': "Rome"}'], parser_for("named", "get_weather"))
    final = Response.model_validate(events[-1]["response"])
    assert [(i.type, i.arguments) for i in final.output] == [("function_call", '{"city": "Rome"}')]
    assert [(i.type, i.arguments) for i in Response.model_validate(whole.json_body()).output] == \
        [("function_call", '{"city": "Rome"}')]
    events, whole = _stream(["No tools ", "needed."], parser_for("hermes"))
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "No tools needed." and [i.type for i in final.output] == ["message"]
    assert Response.model_validate(whole.json_body()).output_text == "No tools needed."
    events, _ = _stream(["cut"], None, reason="length")
    assert events[-1]["type"] == "response.incomplete"


def test_a_failure_mid_stream_is_an_error_event_and_nothing_follows():
    import grpc

    from router.events import FlowError

    out = ora.ResponseEventStream(_req(), "m", 3)
    out.chunk(0, FlowEvent("r", text="Hel"))
    (event,) = _events(out.error(FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, "request r: deadline passed")))
    TypeAdapter(ResponseStreamEvent).validate_python(event)
    assert event["type"] == "error" and "deadline" in event["message"]
    assert out.end() == []  # no response.completed after the error


def test_vllms_request_extras_reach_the_generate_request():
    """allowed_token_ids, bad_words, cache_salt and priority pass through the translation to the GenerateRequest the
    router validates (as on the chat path)."""
    t = ora.to_chat_request(_req(allowed_token_ids=[5, 6], bad_words=["no"], cache_salt="t", priority=2))
    g = oa.to_generate_request(t.chat, token_ids=[1, 2])
    assert (list(g.allowed_token_ids), list(g.bad_words), g.cache_salt, g.priority) == ([5, 6], ["no"], "t", 2)


def test_reasoning_items_sent_back_become_the_next_assistant_turns_reasoning_content():
    """A client replaying a response's output (the Agents SDK does) sends its reasoning item back: its text is the
    following assistant turn's ``reasoning_content`` (what thinking templates read, Qwen3's in tool loops), a message
    or a call; reasoning with no assistant turn after it is dropped."""
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and?"}]
    with_item = ora.to_chat_request(_req(input=[turns[0], item, *turns[1:]]))
    plain = oa.message_dicts(ora.to_chat_request(_req(input=turns)).chat)
    got = oa.message_dicts(with_item.chat)
    assert got[-2] == {**plain[-2], "reasoning_content": "hm"} and got[:-2] + got[-1:] == plain[:-2] + plain[-1:]
    assert with_item.where == [*with_item.where[:-3], "input[0]", "input[2]", "input[3]"]
    call = ora.to_chat_request(_req(input=[turns[0], item, CALL]))
    assert oa.message_dicts(call.chat)[-1]["reasoning_content"] == "hm"
    dropped = ora.to_chat_request(_req(input=[turns[0], item, turns[2]]))
    assert all("reasoning_content" not in m for m in oa.message_dicts(dropped.chat))


def test_chat_messages_carry_reasoning_to_the_template_by_either_name():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "reasoning_content": "r2"},
            {"role": "user", "content": "q3"}]
    got = oa.message_dicts(oa.ChatCompletionRequest(messages=msgs))
    assert [m.get("reasoning_content") for m in got] == [None, "r1", None, "r2", None]
