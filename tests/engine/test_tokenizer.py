"""Tokenizer: the built-in one against transformers reading the same files, and HF-dir loading."""
from __future__ import annotations

import json

import pytest
from jinja2.exceptions import SecurityError
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer

from engine.tokenizer import BUILTIN_DIR, Tokenizer

TEXTS = [
    "def main(argv: list[str]) -> int:\n    return 0\n",
    "Hello, world! Grüße aus Köln — 日本語のテキスト and emoji 🙂🚀 mixed.",
    "   leading spaces\ttabs\n\nand <|eos|> written in text",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.builtin()


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(str(BUILTIN_DIR))


def test_builtin_shape(tok):
    assert tok.vocab_size == len(tok) == 8192
    assert tok.convert_ids_to_tokens([tok.bos_token_id, tok.eos_token_id]) == ["<|bos|>", "<|eos|>"]
    assert tok.pad_token_id is not None
    assert set(tok.all_special_ids) >= {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    assert tok.bos_token_id != tok.eos_token_id


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(tok, hf, text):
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    # Special-token text in the input is parsed as the special token (as in transformers).
    assert tok.decode(ids) == text.replace("<|eos|>", "")
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_bpe_actually_merges(tok):
    # A trained BPE on Python sources encodes common code in far fewer tokens than bytes.
    text = TEXTS[0] * 4
    assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()) / 2.5


def test_chat_template_matches_transformers(tok, hf):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(msgs, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert ours.startswith("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n")
    # Chat prompts are encoded without adding special tokens: exactly one bos, from the template;
    # the chat markers are single special tokens.
    ids = tok.encode(ours, add_special_tokens=False)
    assert ids == hf.encode(ours, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids


def test_chat_template_bad_input(tok):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template("hello")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "x"}])


def _write_llama_style_dir(d, *, post_processor_bos: bool, add_bos_token: bool, template=None):
    """A small HF-style dir: WordLevel model, AddedToken dicts for bos/eos, like Llama's config."""
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "!": 5}
    t = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece(prefix="##")
    t.add_special_tokens(["<s>", "</s>", "<unk>"])
    if post_processor_bos:
        t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    d.mkdir(parents=True, exist_ok=True)
    t.save(str(d / "tokenizer.json"))
    cfg = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "add_bos_token": add_bos_token,
    }
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("post_bos,add_bos,expect_bos", [
    (False, True, True), (True, True, True), (True, False, True), (False, False, False)])
def test_from_dir_bos_handling(tmp_path, post_bos, add_bos, expect_bos):
    d = _write_llama_style_dir(tmp_path / "m", post_processor_bos=post_bos, add_bos_token=add_bos)
    t = Tokenizer.from_dir(d)
    assert (t.bos_token_id, t.eos_token_id) == (0, 1)
    ids = t.encode("hello world !")
    assert ids == ([0] if expect_bos else []) + [3, 4, 5]  # never two bos
    assert t.encode("hello world !", add_special_tokens=False) == [3, 4, 5]
    assert t.decode([0, 3, 4, 1]) == "hello world"
    assert sorted(t.all_special_ids) == [0, 1, 2]


def test_from_dir_eos_from_generation_config_and_template_file(tmp_path):
    d = _write_llama_style_dir(tmp_path / "m", post_processor_bos=False, add_bos_token=False)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}")
    t = Tokenizer.from_dir(d)
    assert t.eos_token_id == 1
    assert t.apply_chat_template([{"role": "user", "content": "hello"}]) == "<s>hello"


def test_template_is_sandboxed(tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    d = _write_llama_style_dir(tmp_path / "m", post_processor_bos=False, add_bos_token=False, template=evil)
    with pytest.raises(SecurityError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_from_dir_errors(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = _write_llama_style_dir(tmp_path / "m", post_processor_bos=False, add_bos_token=False)
    t = Tokenizer.from_dir(d)
    with pytest.raises(ValueError, match="chat_template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="text"):
        t.encode(123)  # type: ignore[arg-type]
