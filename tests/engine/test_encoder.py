"""Encoders (engine/encoder.py): BERT / XLM-R embedding models and cross-encoder rerankers against transformers.

Each model is a small random one built here with transformers and saved as a Hugging Face directory, with a
WordPiece tokenizer built with ``tokenizers`` (BERT's or RoBERTa's special-token template), so the references are
transformers' own forward over the ids and token types the tokenizer gives.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors  # noqa: E402

WORDS = "the a cat dog sat on mat what is city paris capital of france big small red blue house tree".split()
TEXTS = ["the cat sat on the mat", "what is the capital of france?", "a", "big red house, small blue tree. " * 3]
PAIRS = [("what is the capital of france?", "paris is the capital of france."),
         ("what is the capital of france?", "the cat sat on the mat"), ("a dog", "a big dog on a mat")]


def _tokenizer(style: str) -> Tokenizer:
    """A WordPiece tokenizer with BERT's ([CLS] a [SEP] b [SEP], types 0/1) or RoBERTa's template."""
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] if style == "bert" else ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = special + ["[MASK]"] + WORDS + list("abcdefghijklmnopqrstuvwxyz") + \
        ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"] + [".", ",", "?"]
    t = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token=special[1 if style == "bert" else 3]))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if style == "bert":
        t.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    else:
        t.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    t.decoder = decoders.WordPiece()
    return t


def _save(model: torch.nn.Module, tok: Tokenizer, d: Path, pooling: str | None = None, normalize: bool = False,
          extra_modules: tuple[str, ...] = ()) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    if pooling is not None:  # sentence-transformers' files
        mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        mods += [{"idx": 2 + i, "name": m, "path": m, "type": f"sentence_transformers.models.{m}"}
                 for i, m in enumerate(extra_modules + (("Normalize",) if normalize else ()))]
        (d / "modules.json").write_text(json.dumps(mods))
        (d / "1_Pooling").mkdir()
        modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **modes}))
    return d


def _bert(cls_name: str = "BertModel", **kw) -> torch.nn.Module:
    torch.manual_seed(7)
    cfg = transformers.BertConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, **kw)
    return getattr(transformers, cls_name)(cfg).eval()


def _xlmr(cls_name: str = "XLMRobertaForSequenceClassification", **kw) -> torch.nn.Module:
    torch.manual_seed(11)
    kw.setdefault("num_labels", 1)
    cfg = transformers.XLMRobertaConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=66, pad_token_id=1,
                                        bos_token_id=0, eos_token_id=2, type_vocab_size=1, **kw)
    return getattr(transformers, cls_name)(cfg).eval()


def _hidden(model: torch.nn.Module, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]),
                    token_type_ids=torch.tensor([types]) if types is not None else None)
    return out.last_hidden_state[0] if hasattr(out, "last_hidden_state") else out.logits[0]


@pytest.mark.parametrize("pooling", ["mean_tokens", "cls_token", "lasttoken", None])
def test_bert_embeddings_pool_as_sentence_transformers_says(pooling, tmp_path):
    """Each prompt alone through transformers, pooled as its sentence-transformers config says (none: CLS,
    normalised, as vLLM does for BERT); here batched, with a 16-token step budget the engine raises to the context
    (prompts whole)."""
    from engine import LLM

    model, tok = _bert(), _tokenizer("bert")
    d = _save(model, tok, tmp_path / "m", pooling, normalize=pooling == "mean_tokens")
    llm = LLM(str(d), max_num_batched_tokens=16, max_num_seqs=3)
    assert llm.llm_engine.config.max_num_batched_tokens == 64 and not llm.llm_engine.config.enable_prefix_caching
    got = llm.embed(TEXTS)
    for text, g in zip(TEXTS, got, strict=True):
        h = _hidden(model, tok.encode(text).ids)
        ref = {"mean_tokens": h.mean(0), "cls_token": h[0], "lasttoken": h[-1], None: h[0]}[pooling]
        if pooling in ("mean_tokens", None):  # (the Normalize module; none: vLLM's default, normalised)
            ref = torch.nn.functional.normalize(ref, dim=0)
        assert g.prompt_token_ids == tok.encode(text).ids
        torch.testing.assert_close(torch.tensor(g.outputs.embedding), ref, atol=2e-6, rtol=0)
    # the same prompts again, one by one: a prompt's vector does not depend on what it was batched with
    again = [llm.embed([t])[0].outputs.embedding for t in TEXTS]
    for a, g in zip(again, got, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(g.outputs.embedding), atol=1e-6, rtol=0)


def test_xlm_r_cross_encoder_scores_pairs_as_transformers(tmp_path):
    """bge-reranker's shape: XLM-R positions from pad + 1, the RoBERTa head on <s>, sigmoid of its one logit; a pad
    token inside a pair keeps transformers' position rule."""
    from engine import LLM

    model, tok = _xlmr(), _tokenizer("roberta")
    d = _save(model, tok, tmp_path / "m")
    llm = LLM(str(d))
    got = llm.score([p[0] for p in PAIRS], [p[1] for p in PAIRS])
    for (a, b), g in zip(PAIRS, got, strict=True):
        ids = tok.encode(a, b).ids
        assert g.prompt_token_ids == ids
        logit = float(_hidden(model, ids)[0])
        assert math.isclose(g.outputs.score, 1 / (1 + math.exp(-logit)), abs_tol=1e-6)
    ids = tok.encode("a dog", "a mat").ids
    ids.insert(2, 1)  # (a pad id inside the prompt: it takes position pad_token_id, the rest count on)
    out = llm.llm_engine
    out.add_request("pad", ids, __import__("engine").SamplingParams(), pooling=True)
    emb = None
    while emb is None:
        emb = next((o.embedding for o in out.step() if o.request_id == "pad"), None)
    torch.testing.assert_close(emb, _hidden(model, ids), atol=2e-6, rtol=0)
    # one query against many documents (the rerank shape), and truncation: longest text cut first, specials kept
    one = llm.score(PAIRS[0][0], [p[1] for p in PAIRS])
    assert [o.outputs.score for o in one][:2] == [g.outputs.score for g in got][:2]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    short = llm.score(PAIRS[0][0], PAIRS[0][1], truncate_prompt_tokens=9)[0]
    ref_ids = hf_tok(PAIRS[0][0], PAIRS[0][1], truncation=True, max_length=9)["input_ids"]
    assert short.prompt_token_ids == ref_ids and len(ref_ids) == 9
    logit = float(_hidden(model, ref_ids)[0])
    assert math.isclose(short.outputs.score, 1 / (1 + math.exp(-logit)), abs_tol=1e-6)


def test_bert_cross_encoder_gives_the_second_text_token_type_one(tmp_path):
    """ms-marco-MiniLM's shape: BERT's pooler and classifier, token types from the pair template (the model derives
    them from the first [SEP]); the same model read with every type 0 scores differently, so the types matter."""
    from engine import LLM

    model, tok = _bert("BertForSequenceClassification", num_labels=1), _tokenizer("bert")
    with torch.no_grad():  # (transformers' 0.02 init leaves the types' effect on the logit near rounding)
        model.bert.embeddings.token_type_embeddings.weight.normal_(0, 1)
        model.classifier.weight.normal_(0, 1)
    d = _save(model, tok, tmp_path / "m")
    got = LLM(str(d)).score([p[0] for p in PAIRS], [p[1] for p in PAIRS])
    for (a, b), g in zip(PAIRS, got, strict=True):
        enc = tok.encode(a, b)
        logit = float(_hidden(model, enc.ids, enc.type_ids)[0])
        wrong = float(_hidden(model, enc.ids, [0] * len(enc.ids))[0])
        assert math.isclose(g.outputs.score, 1 / (1 + math.exp(-logit)), abs_tol=1e-6)
        assert abs(logit - wrong) > 1e-4  # (100x the tolerance the score is held to)


def test_encoders_refuse_what_they_cannot_do(tmp_path):
    from engine import LLM, SamplingParams

    tok = _tokenizer("bert")
    emb = _save(_bert(), tok, tmp_path / "emb", "mean_tokens")
    llm = LLM(str(emb))
    with pytest.raises(ValueError, match="encoder .*BertModel.*embeddings, not generation"):
        llm.generate(["the cat"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="quantization: not available for an encoder"):
        LLM(str(emb), quantization="int8")
    ce = _save(_bert("BertForSequenceClassification", num_labels=1), tok, tmp_path / "ce")
    with pytest.raises(ValueError, match="cross-encoder: it scores text pairs"):
        LLM(str(ce)).embed(["the cat"])
    with pytest.raises(ValueError, match="not a classifier"):
        llm.classify(["the cat"])
    two = LLM(str(_save(_bert("BertForSequenceClassification", num_labels=2), tok, tmp_path / "two")))
    with pytest.raises(ValueError, match="2-label classifier: it classifies texts"):
        two.score("a", "b")
    with pytest.raises(ValueError, match="classifier .LLM.classify., it has no embeddings"):
        two.embed(["a"])
    with pytest.raises(ValueError, match="serves classifications, not generation"):
        two.generate(["a"], SamplingParams(max_tokens=1))
    dense = _save(_bert(), tok, tmp_path / "dense", "mean_tokens", extra_modules=("Dense",))
    with pytest.raises(ValueError, match="Dense module"):
        LLM(str(dense))
    maxp = _save(_bert(), tok, tmp_path / "max", "max_tokens")
    with pytest.raises(ValueError, match="pooling is max_tokens"):
        LLM(str(maxp))
    rel = _save(_bert(position_embedding_type="relative_key"), tok, tmp_path / "rel")
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        LLM(str(rel))


def test_an_embedding_prompt_may_fill_the_context(tmp_path):
    """Nothing follows an embedding's prompt, so one of exactly max_model_len tokens is computed (BERT reads 512 of
    512), one more is refused; a generating request still needs room for a token."""
    from engine import LLM, SamplingParams

    model = _bert()
    llm = LLM(str(_save(model, _tokenizer("bert"), tmp_path / "m")))
    full = [2] + [5 + i % 20 for i in range(62)] + [3]
    assert len(full) == llm.llm_engine.max_model_len == 64
    got = llm.embed([full], normalize=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(got), _hidden(model, full)[0], atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="has 65 tokens; max_model_len is 64"):
        llm.embed([full + [5]])
    dec = LLM("tiny", max_model_len=32, num_kv_blocks=16)
    assert len(dec.embed([list(range(5, 37))])[0].outputs.embedding) == dec.llm_engine.model_config.hidden_size
    with pytest.raises(ValueError, match="prompt plus at least one new token"):
        dec.generate([list(range(5, 37))], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("multi", [False, True], ids=["softmax", "multi-label"])
def test_a_sequence_classifier_gives_transformers_probabilities_and_its_label(multi, tmp_path):
    """A sentiment-style RoBERTa with three named labels: the softmax of transformers' logits; a multi-label one
    (``problem_type``, toxic-bert's way): a sigmoid per label."""
    from engine import LLM

    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model = _xlmr(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()},
                  problem_type="multi_label_classification" if multi else None)
    with torch.no_grad():  # (spread the logits apart: transformers' init leaves the three near equal)
        model.classifier.out_proj.weight.normal_(0, 1)
    tok = _tokenizer("roberta")
    llm = LLM(str(_save(model, tok, tmp_path / "m")))
    got = llm.classify(TEXTS)
    for text, g in zip(TEXTS, got, strict=True):
        logits = _hidden(model, tok.encode(text).ids)
        ref = torch.sigmoid(logits) if multi else torch.softmax(logits, 0)
        torch.testing.assert_close(torch.tensor(g.outputs.probs, dtype=torch.float32), ref, atol=1e-6, rtol=0)
        assert g.label == labels[int(ref.argmax())] and g.outputs.num_classes == 3


def test_the_oldest_bert_checkpoints_layernorm_names_load(tmp_path):
    """Early BERT checkpoints (the TF port's) name a LayerNorm's weight ``gamma`` and its bias ``beta``, under a
    ``bert.`` prefix: the same model as the modern names."""
    from safetensors.torch import load_file, save_file

    from engine import LLM

    model, tok = _bert(), _tokenizer("bert")
    d = _save(model, tok, tmp_path / "m")
    want = LLM(str(d)).embed(TEXTS[:2])
    tensors = load_file(str(d / "model.safetensors"))
    old = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in tensors.items()}
    assert sum(k.endswith(".beta") for k in old) == 5  # (embeddings + two per layer)
    (d / "model.safetensors").unlink()
    save_file(old, str(d / "model.safetensors"))
    got = LLM(str(d)).embed(TEXTS[:2])
    assert [g.outputs.embedding for g in got] == [w.outputs.embedding for w in want]
