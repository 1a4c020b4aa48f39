"""router.openai.reasoning: a thinking model's answer split into reasoning and content, whole and streamed in
every cut, and where a block opens decided from the rendered prompt."""
from __future__ import annotations

import pytest

from router.openai.reasoning import ReasoningStream, format_of, opens_in_reasoning, split

R1, QWEN3 = format_of("deepseek_r1"), format_of("qwen3")

CASES = [
    # (answer, opens in reasoning, expected (reasoning, content))
    ("Let me think.</think>\n\nThe answer is 4.", True, ("Let me think.", "\n\nThe answer is 4.")),
    ("<think>\nhmm</think>4", True, ("\nhmm", "4")),            # the model writing its own start marker
    ("  <think>a</think>b", True, ("a", "b")),                  # ... after whitespace
    ("still thinking when max_tokens ran out", True, ("still thinking when max_tokens ran out", "")),
    ("a < b </thin", True, ("a < b </thin", "")),               # a held-back partial marker ends as reasoning
    ("x</think>y</think>z", True, ("x", "y</think>z")),          # only the first end closes the block
    ("</think>only content", True, (None, "only content")),
    ("The answer is 4.", False, (None, "The answer is 4.")),    # the prompt closed the block
    ("<think>not parsed</think>", False, (None, "<think>not parsed</think>")),
    ("", True, (None, "")),
]


@pytest.mark.parametrize("text, open_, want", CASES)
def test_whole_answers(text, open_, want):
    assert split(R1, text, open_) == want
    assert split(QWEN3, text, open_) == want


@pytest.mark.parametrize("text, open_, want", CASES)
def test_every_two_and_three_piece_stream_assembles_to_the_whole_answer(text, open_, want):
    """However the text is cut into pieces (the detokenizer's are arbitrary), the pieces assemble to the whole."""
    cuts = [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(len(text) + 1)
                                                   for j in range(i, len(text) + 1, 3)]
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        s = ReasoningStream(R1, open_)
        thought = content = ""
        for p in pieces:
            r, c = s.feed(p)
            thought, content = thought + r, content + c
        r, c = s.finish()
        assert ((thought + r) or None, content + c) == want, pieces


def test_nothing_of_a_marker_leaks_into_a_streamed_piece():
    s = ReasoningStream(R1, True)
    assert s.feed("<thi") == ("", "")           # may be the start marker: held
    assert s.feed("nk>abc</th") == ("abc", "")  # the end marker's beginning held
    assert s.feed("ink>done") == ("", "done")
    assert s.feed(" more") == ("", " more")


def test_where_the_answer_opens():
    # the rendered prompt's end decides: a template that closed the block (Qwen3 enable_thinking=false,
    # DeepSeek-V3.1 non-thinking) leaves the answer all content
    assert opens_in_reasoning(R1, "<|Assistant|><think>\n") is True
    assert opens_in_reasoning(QWEN3, "<|im_start|>assistant\n") is True
    assert opens_in_reasoning(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    # the qwen3 switch, as vLLM reads it; deepseek_r1 has none
    assert opens_in_reasoning(QWEN3, "assistant\n", {"enable_thinking": False}) is False
    assert opens_in_reasoning(QWEN3, "assistant\n", {"enable_thinking": True}) is True
    assert opens_in_reasoning(R1, "assistant\n", {"enable_thinking": False}) is True
    # continue_final_message: the answer continues the final message, in a block only if that one left it open
    assert opens_in_reasoning(R1, "", continued="<think>first, ") is True
    assert opens_in_reasoning(R1, "", continued="<think>done</think>The answer") is False
    assert opens_in_reasoning(R1, "", continued="The answer") is False


def test_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        format_of("granite")
