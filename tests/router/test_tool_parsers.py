"""router.openai.tool_parsers on fixed strings: each format's calls and content, whole and streamed in pieces of every
size (a streamed answer joins to exactly the whole one), and answers that must stay content."""
from __future__ import annotations

import json

import pytest

from router.openai.tool_parsers import ArgsDelta, CallStart, ContentDelta, assemble, parser_for

HERMES = ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris </tool_call>", '
          '"days": [1, {"x": "}"}], "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"arguments": {"q": "a\\"b"}, '
          '"name": "search"}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Rome", "n": [1, 2]}}, {"name": "now", "parameters": {}}]'


def _streamed(kind: str, text: str, size: int, name=None) -> tuple:
    s = parser_for(kind, name).stream()
    deltas = []
    for i in range(0, len(text), size):
        deltas += s.feed(text[i:i + size])
    deltas += s.finish()
    content, calls = assemble(deltas)
    return content, [(c.name, c.arguments) for c in calls], deltas


def _whole(kind: str, text: str, name=None) -> tuple:
    found = parser_for(kind, name).extract(text)
    return found.content, [(c.name, c.arguments) for c in found.calls]


def test_hermes_calls_content_and_tags_inside_strings():
    content, calls = _whole("hermes", HERMES)
    assert content == "I will look that up.\n"
    assert calls == [("get_weather", '{"city": "Paris </tool_call>", "days": [1, {"x": "}"}], "unit": "celsius"}'),
                     ("search", '{"q": "a\\"b"}')]  # name after the arguments: the call comes whole, re-dumped
    assert json.loads(calls[0][1])["city"] == "Paris </tool_call>"


@pytest.mark.parametrize("kind,text", [("hermes", HERMES), ("llama3_json", LLAMA), ("required", REQUIRED)])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 10_000])
def test_streamed_in_pieces_joins_to_the_whole_answer(kind, text, size):
    content, calls, deltas = _streamed(kind, text, size)
    assert (content or None, calls) == _whole(kind, text)
    starts = [d for d in deltas if isinstance(d, CallStart)]
    assert [d.index for d in starts] == list(range(len(calls)))
    # each call's start comes before any of its arguments
    for i in range(len(calls)):
        first_args = next(k for k, d in enumerate(deltas) if isinstance(d, ArgsDelta) and d.index == i)
        assert deltas.index(starts[i]) < first_args


def test_hermes_streams_arguments_before_the_call_is_complete():
    """The name first (as templates write it): the start and the arguments so far come before the closing tag."""
    s = parser_for("hermes").stream()
    assert s.feed("Sure. <tool") == [ContentDelta("Sure. ")]  # "<tool" may be a tag: held back
    out = s.feed('_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert out == [CallStart(0, "get_weather"), ArgsDelta(0, '{"city": "Pa')]
    assert s.feed('ris"}}') == [ArgsDelta(0, 'ris"}')]
    assert s.feed("</tool_call>") == [] and s.finish() == []


def test_hermes_without_calls_is_content_and_a_lone_tag_prefix_is_flushed():
    assert _whole("hermes", "just text <b>bold</b> <tool") == ("just text <b>bold</b> <tool", [])
    assert _streamed("hermes", "just text <b>bold</b> <tool", 1)[:2] == ("just text <b>bold</b> <tool", [])


@pytest.mark.parametrize("bad", ['<tool_call>{"name": "f", "arguments": {"a": 1}',  # never closed
                                 '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',  # not JSON
                                 '<tool_call>{"arguments": {}}</tool_call>',  # no name
                                 '<tool_call>[1, 2]</tool_call>'])
def test_a_call_that_does_not_parse_leaves_the_text_as_content(bad):
    assert _whole("hermes", bad) == (bad, [])


def test_llama3_json():
    assert _whole("llama3_json", LLAMA) == (None, [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])
    assert _whole("llama3_json", '  {"name": "f", "arguments": {"x": true}}') == (None, [("f", '{"x": true}')])
    assert _whole("llama3_json", 'The answer is {"name": "f"}') == ('The answer is {"name": "f"}', [])
    assert _streamed("llama3_json", "Hello there", 1)[:2] == ("Hello there", [])


def test_required_array_and_named():
    assert _whole("required", REQUIRED) == (None, [("get_weather", '{"city": "Rome", "n": [1, 2]}'), ("now", "{}")])
    assert _whole("named", '{"city": "Rome"}', "get_weather") == (None, [("get_weather", '{"city": "Rome"}')])
    content, calls, deltas = _streamed("named", '{"city": "Rome"}', 4, "get_weather")
    assert calls == [("get_weather", '{"city": "Rome"}')] and deltas[0] == CallStart(0, "get_weather")


def test_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        parser_for("mistral")
