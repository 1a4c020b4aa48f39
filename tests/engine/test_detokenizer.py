"""Detokenizer: streamed deltas equal the full decode (CJK, emoji, split bytes); stop strings."""
from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, OutputProcessor
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

TEXT = ("def greet(name):\n    return f\"こんにちは {name}! 你好世界 🙂🚀👩‍👩‍👧\"  # Grüße, naïve café\n"
        "print(greet('Zoë'))  <|eos|> tail ✓")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.builtin()


def stream(tok, ids, prompt=(0,), skip=True, chunks=1):
    d = IncrementalDetokenizer(tok, list(prompt), skip)
    deltas = [d.add(ids[i:i + chunks]) for i in range(0, len(ids), chunks)]
    deltas.append(d.flush())
    return deltas


def test_tokens_split_characters(tok):
    # The check below only means something if byte-level tokens really split characters.
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunks", [1, 3])
def test_stream_concatenates_to_full_decode(tok, skip, chunks):
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas = stream(tok, ids, skip=skip, chunks=chunks)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    for d in deltas:
        assert "\ufffd" not in d  # no half characters are ever emitted
    if skip:
        assert "".join(deltas) == TEXT.replace("<|eos|>", "")


def test_random_byte_soup_matches_full_decode(tok):
    # Arbitrary ids: invalid UTF-8 runs must come out as the full decode shows them (U+FFFD).
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(5, tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("価格 🙂", add_special_tokens=False)
    for cut in range(1, len(ids)):
        out = "".join(stream(tok, ids[cut:], prompt=ids[:cut]))
        assert out == tok.decode(ids[cut:])


def sentencepiece_style() -> Tokenizer:
    """A Llama-2-like tokenizer: Metaspace-style normaliser, byte fallback, decoder strips one leading space."""
    import json

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, trainers

    t = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.train_from_iterator(["hello world this is a test of the sentencepiece style tokenizer"] * 10,
                          trainer=trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                      show_progress=False))
    spec = json.loads(t.to_str())
    for b in range(256):  # byte-fallback pieces are ordinary vocabulary entries, as in Llama's
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    return Tokenizer(RustTokenizer.from_str(json.dumps(spec)), {"bos_token": "<s>", "eos_token": "</s>"})


def test_sentencepiece_leading_space_and_byte_fallback():
    tok = sentencepiece_style()
    text = "hello 世界 world 🙂 this is a test"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback in play
    checked = 0
    for cut in range(1, len(ids)):
        prompt_text = tok.decode(ids[:cut])
        if prompt_text.endswith("\ufffd"):
            continue
        # What the user sees after the prompt: the full text minus the prompt's text, so the
        # space the decoder strips at the start of a sequence is kept between the two.
        expected = tok.decode(ids)[len(prompt_text):]
        deltas = stream(tok, ids[cut:], prompt=ids[:cut])
        assert "".join(deltas) == expected
        checked += 1
    assert checked >= 5


def feed(proc, ids, finish_at_end="length"):
    deltas = []
    for j, t in enumerate(ids):
        fr = finish_at_end if j == len(ids) - 1 else None
        deltas.append(proc.process([t], None, fr))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def test_no_stop_equals_full_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas = feed(OutputProcessor(tok, [0], SamplingParams(max_tokens=500)), ids)
    assert "".join(d.text for d in deltas) == TEXT.replace("<|eos|>", "")
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop_matched is None
    assert [t for d in deltas for t in d.token_ids] == ids


@pytest.mark.parametrize("stop", ["你好世界", "Grüße", "🚀", "print(", "n f\"こ"])
def test_stop_string_spanning_tokens_is_not_emitted(tok, stop):
    ids = tok.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(tok, [0], SamplingParams(max_tokens=500, stop=["NEVER", stop]))
    deltas = feed(proc, ids)
    text = "".join(d.text for d in deltas)
    assert text == TEXT[: TEXT.index(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_matched == stop
    got_ids = [t for d in deltas for t in d.token_ids]
    # token_ids end with the token that completed the stop string: without it the
    # text does not contain the stop string yet, with it it does.
    assert stop in tok.decode(got_ids) and stop not in tok.decode(got_ids[:-1])
    assert got_ids == ids[: len(got_ids)]
    # Text never emitted before the stop was matched can't contain a partial stop string either.
    for d in deltas[:-1]:
        assert stop not in d.text


def test_held_back_text_is_flushed_on_finish(tok):
    # The output ends with "ST", a prefix of the stop string "STOP": held back while it
    # could still become "STOP", flushed when the core says the request is finished.
    ids = tok.encode("value = 1 ST", add_special_tokens=False)
    proc = OutputProcessor(tok, [0], SamplingParams(stop=["STOP"]))
    deltas = [proc.process([t]) for t in ids]
    assert "".join(d.text for d in deltas) == "value = 1 "
    last = proc.process([], None, "length")
    assert last.text == "ST" and last.finish_reason == "length"
    assert proc.process([5]).text == ""  # finished: later outputs add nothing


def test_earliest_stop_wins_and_eos_flushes(tok):
    ids = tok.encode("abc xyz done", add_special_tokens=False)
    proc = OutputProcessor(tok, [0], SamplingParams(stop=["done", "xyz"]))
    d = proc.process(ids)
    assert d.text == "abc " and d.stop_matched == "xyz"
    # EOS (finish_reason "stop" from the core): the special token is in token_ids, not in text.
    proc = OutputProcessor(tok, [0], SamplingParams())
    d = proc.process(ids + [tok.eos_token_id], None, "stop")
    assert d.text == "abc xyz done" and d.token_ids[-1] == tok.eos_token_id and d.stop_matched is None


def test_logprobs_follow_tokens(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    lps = [TokenLogprob(t, -0.5) for t in ids]
    proc = OutputProcessor(tok, [0], SamplingParams(logprobs=0, stop=["two"]))
    d = proc.process(ids, lps)
    assert d.logprobs == lps[: len(d.token_ids)] and d.finish_reason == "stop"
    with pytest.raises(ValueError, match="logprobs"):
        OutputProcessor(tok, [0], SamplingParams(logprobs=0)).process(ids, lps[:1])


def test_prefill_done_is_not_final(tok):
    proc = OutputProcessor(tok, [0], SamplingParams())
    d = proc.process(tok.encode("Hi", add_special_tokens=False), None, "prefill_done")
    assert d.finish_reason is None and not proc.finished
