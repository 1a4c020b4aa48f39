"""Embeddings from the engine (engine/pooling.py) match transformers' hidden states on the same weights.

Reference: transformers' own model, random-initialised and saved with save_pretrained, read with
``output_hidden_states`` (its last entry is after the final norm): a prompt's embedding is its last token's row,
L2-normalised as sentence-transformers normalises it. Checked for an embedding model saved as its base model
(``Qwen3Model``: no ``model.`` prefix, no LM head, as Qwen3-Embedding-8B and e5-mistral are saved) and for a causal
LM, alone and batched with generation, chunked, from the prefix cache, through the async scheduler and the static
decode buffers; a pooling the engine does not compute, and ``dimensions`` a model was not trained for, are refused
by name.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine import LLM, SamplingParams

from .conftest import hf_config, make_checkpoint, prompts_of

PROMPT_LENGTHS = [1, 6, 13, 30]


def _unit(v) -> list[float]:
    v = [float(x) for x in v]
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def _close(a, b, tol: float = 2e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A Qwen3 embedding model saved as ``Qwen3Model`` (untied: no LM head in the checkpoint), with
    sentence-transformers' last-token Pooling and Normalize modules beside it."""
    import transformers

    d = tmp_path_factory.mktemp("qwen3_embed")
    torch.manual_seed(1)
    model = transformers.Qwen3Model(hf_config("qwen3", head_dim=32, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    model.save_pretrained(d)
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                            "pooling_mode_lasttoken": True,
                                                            "pooling_mode_mean_tokens": False}))
    return d, model


def _hf_last(model, prompt: list[int]) -> list[float]:
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1].tolist()


def test_a_base_model_checkpoint_embeds_as_transformers_and_does_not_generate(base_model):
    d, hf = base_model
    names = json.loads((d / "config.json").read_text())["architectures"]
    assert names == ["Qwen3Model"]
    llm = LLM(str(d), num_kv_blocks=64, block_size=4)
    assert not llm.llm_engine.model.has_lm_head and llm.llm_engine.pooling.normalize
    prompts = prompts_of(PROMPT_LENGTHS, seed=4)
    got = llm.embed(prompts)
    for p, o in zip(prompts, got):
        assert o.prompt_token_ids == p
        assert _close(o.outputs.embedding, _unit(_hf_last(hf, p)))
    raw = llm.embed(prompts[2:3], normalize=False)[0].outputs.embedding
    assert _close(raw, _hf_last(hf, prompts[2]), 1e-4) and abs(math.fsum(x * x for x in raw) - 1) > 0.1
    with pytest.raises(ValueError, match="no LM head .* embeddings only"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_total_blocks


def test_a_pooling_the_engine_does_not_compute_is_refused_by_name(base_model, tmp_path):
    import shutil

    d = tmp_path / "mean"
    shutil.copytree(base_model[0], d)
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": False,
                                                            "pooling_mode_mean_tokens": True}))
    llm = LLM(str(d), num_kv_blocks=16)
    with pytest.raises(ValueError, match="pooling is mean_tokens; the engine computes last-token pooling only"):
        llm.embed([[5, 6, 7]])
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_sentence_transformers_model_without_a_normalize_module_gives_raw_vectors(base_model, tmp_path):
    import shutil

    d, hf = base_model
    raw_dir = tmp_path / "raw"
    shutil.copytree(d, raw_dir)
    modules = json.loads((raw_dir / "modules.json").read_text())
    (raw_dir / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    llm = LLM(str(raw_dir), num_kv_blocks=16)
    assert not llm.llm_engine.pooling.normalize
    p = prompts_of([7], seed=2)[0]
    assert _close(llm.embed([p])[0].outputs.embedding, _hf_last(hf, p), 1e-4)
    assert _close(llm.embed([p], normalize=True)[0].outputs.embedding, _unit(_hf_last(hf, p)))


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    d, hf = make_checkpoint(tmp_path_factory.mktemp("llama_embed"), "llama", seed=2)
    cfg = json.loads((d / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [16, 32]
    (d / "config.json").write_text(json.dumps(cfg))
    return d, hf


@pytest.mark.parametrize("over", [dict(), dict(max_num_batched_tokens=8),
                                  dict(async_scheduling=True, static_decode_buffers=True)],
                         ids=["plain", "chunked", "async-static"])
def test_embeddings_batched_with_generation_equal_transformers_and_the_answers_are_unchanged(causal, over):
    """Embedding requests share steps with generating ones (the engine's scheduler batches them): each vector is
    transformers' and every generated answer is what the engine gives without them; a repeated prompt is served
    from the prefix cache with the same vector."""
    from engine import finish_embedding

    d, hf = causal
    prompts = prompts_of(PROMPT_LENGTHS, seed=6)
    gen = prompts_of([9, 17], seed=8)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = LLM(str(d), num_kv_blocks=128, block_size=4, **over).generate(gen, greedy)
    llm = LLM(str(d), num_kv_blocks=128, block_size=4, **over)
    eng = llm.llm_engine
    for i, p in enumerate(gen):
        eng.add_request(f"g{i}", p, greedy)
    tokens: dict = {f"g{i}": [] for i in range(len(gen))}
    vectors: dict = {}
    for out in eng.step():  # (the generating requests are running when the embedding requests come)
        tokens[out.request_id] += out.new_token_ids
    for i, p in enumerate(prompts):
        eng.add_request(f"e{i}", p, SamplingParams(), pooling=True)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id.startswith("e"):
                assert out.new_token_ids == [] and out.finish_reason == "stop"
                vectors[out.request_id] = finish_embedding(out.embedding)
            else:
                tokens[out.request_id] += out.new_token_ids
    assert [tokens[f"g{i}"] for i in range(len(gen))] == [o.token_ids for o in alone]
    for i, p in enumerate(prompts):
        assert _close(vectors[f"e{i}"], _unit(_hf_last(hf, p))), i
    hits = eng.prefix_cache_hits
    (again,) = llm.embed(prompts[3:])
    assert eng.prefix_cache_hits > hits
    assert _close(again.outputs.embedding, vectors["e3"], 1e-6)
    assert eng.num_free_blocks == eng.num_total_blocks


def test_matryoshka_dimensions_cut_then_normalise_and_others_are_refused(causal, base_model):
    d, hf = causal
    llm = LLM(str(d), num_kv_blocks=32)
    p = prompts_of([11], seed=9)[0]
    full = _hf_last(hf, p)
    (o,) = llm.embed([p], dimensions=16)
    assert _close(o.outputs.embedding, _unit(full[:16]))
    with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32\], got 20"):
        llm.embed([p], dimensions=20)
    with pytest.raises(ValueError, match="dimensions: this model is not a Matryoshka embedding model"):
        LLM(str(base_model[0]), num_kv_blocks=16).embed([p], dimensions=16)
    assert not llm.llm_engine.has_unfinished_requests()
