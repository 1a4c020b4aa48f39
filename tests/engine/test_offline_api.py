"""Offline API: ``LLM("tiny").generate`` on the real engine; ``python -m engine``.

Independent references: transformers' greedy generation on the same weights
(saved with ``save_builtin``), the tokenizer's own encode/decode, and runs of
the same request alone versus batched.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, RequestOutput, SamplingParams
from engine.builtin import save_builtin

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def parse(argv):", "Hello 世界 🙂", "import os\nimport sys\n", "class Foo:\n    "]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.set_num_threads(1)
    return LLM("tiny", num_kv_blocks=128, block_size=16, num_threads=1)


def assert_engine_clean(llm: LLM) -> None:
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert eng.num_free_blocks == eng.num_total_blocks


def test_greedy_matches_transformers(llm, tmp_path):
    import transformers

    n = 10
    outs = llm.generate(PROMPTS[:2], greedy(n))
    model = transformers.AutoModelForCausalLM.from_pretrained(save_builtin("tiny", tmp_path / "tiny"),
                                                              dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for out in outs:
        with torch.inference_mode():
            ref = model.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(out.prompt_token_ids), dtype=torch.long))
        assert out.token_ids == ref[0, len(out.prompt_token_ids):].tolist()
    assert_engine_clean(llm)


def test_str_and_token_id_prompts_agree_and_keep_order(llm):
    tok = llm.get_tokenizer()
    by_text = llm.generate(PROMPTS, greedy(8))
    ids = [tok.encode(p) for p in PROMPTS]
    by_ids = llm.generate(ids, greedy(8))
    single = llm.generate(ids[2], greedy(8))  # one prompt as a flat list of ids
    assert len(by_text) == len(by_ids) == len(PROMPTS) and len(single) == 1
    for p, i, a, b in zip(PROMPTS, ids, by_text, by_ids):
        assert isinstance(a, RequestOutput)
        assert a.prompt == p and b.prompt is None
        assert a.prompt_token_ids == b.prompt_token_ids == i
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8
        assert a.text == b.text == tok.decode(a.token_ids)
        assert a.finish_reason == "length"
    assert single[0].token_ids == by_ids[2].token_ids
    # Different prompts give different continuations, so the order check above has teeth.
    assert len({tuple(o.token_ids) for o in by_text}) == len(PROMPTS)
    assert_engine_clean(llm)


def test_per_prompt_params_and_seeded_batch_independence(llm):
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=77, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded)[0]
    params = [greedy(3), seeded, SamplingParams(max_tokens=7, temperature=1.2, ignore_eos=True), greedy(5)]
    outs = llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [3, 12, 7, 5]
    assert outs[1].token_ids == alone.token_ids
    other_seed = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=78,
                                                          ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids
    assert_engine_clean(llm)


def test_stop_string_ends_request_and_frees_blocks(llm):
    full = llm.generate(PROMPTS[0], greedy(24))[0]
    text = full.text
    assert len(text) > 12
    # A stop string taken from the middle of the generated text, spanning a token boundary.
    stop = text[len(text) // 2: len(text) // 2 + 4]
    cut = text.index(stop)
    out = llm.generate(PROMPTS[0], greedy(24, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and full.stop_reason is None
    assert out.text == text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    assert stop in llm.get_tokenizer().decode(out.token_ids)
    assert_engine_clean(llm)


def test_stop_token_ids_and_logprobs(llm):
    full = llm.generate(PROMPTS[3], greedy(10, logprobs=3))[0]
    assert len(full.logprobs) == len(full.token_ids)
    for tid, lp in zip(full.token_ids, full.logprobs):
        assert lp.token_id == tid
        assert len(lp.top) == 3 and lp.top[0][0] == tid  # greedy: the chosen token is the most likely
        assert lp.logprob <= 0 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[3], greedy(10, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    assert out.stop_reason == stop_id  # vLLM's: the stop token's id
    assert out.logprobs is None
    assert_engine_clean(llm)


def test_chat_renders_template_once_with_one_bos(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Write a loop"}]
    out = llm.chat(conv, greedy(4))[0]
    assert out.prompt == "<|bos|><|im_start|>user\nWrite a loop<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1 and out.prompt_token_ids[0] == tok.bos_token_id
    assert out.token_ids == llm.generate([out.prompt_token_ids], greedy(4))[0].token_ids
    assert len(llm.chat([conv, conv + [{"role": "assistant", "content": "ok"}]], greedy(2))) == 2
    with pytest.raises(ValueError, match="messages"):
        llm.chat([])
    assert_engine_clean(llm)


def test_chat_template_kwargs_reach_the_template():
    """vLLM's ``LLM.chat(chat_template_kwargs=...)``: a template switch (Qwen3's ``enable_thinking`` style) sees
    them."""
    llm = LLM("tiny", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    tok.chat_template = tok.chat_template + "{% if enable_thinking is defined and enable_thinking is false %}" \
                                            "<think>\n\n</think>\n\n{% endif %}"
    tok._template_cache = None
    conv = [{"role": "user", "content": "hi"}]
    off = llm.chat(conv, greedy(1), chat_template_kwargs={"enable_thinking": False})[0].prompt
    on = llm.chat(conv, greedy(1))[0].prompt
    assert off == on + "<think>\n\n</think>\n\n"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(conv, greedy(1), chat_template_kwargs={"not a name": 1})


def test_bad_inputs_raise_and_leave_engine_clean(llm):
    assert llm.generate([]) == []
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([""])
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([[1, 2], 3.5])
    with pytest.raises(ValueError, match="params"):
        llm.generate(PROMPTS, [greedy(2)])
    with pytest.raises(ValueError, match="params"):
        llm.generate(PROMPTS[:1], ["greedy"])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        # The second prompt is out of vocabulary; the first, already added, must be aborted.
        llm.generate([[5, 6], [10**6]], greedy(2))
    assert_engine_clean(llm)


def test_model_dir_without_tokenizer_takes_token_ids(llm, tmp_path):
    d = save_builtin("tiny", tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink(missing_ok=True)
    bare = LLM(str(d), num_kv_blocks=32, num_threads=1)
    assert bare.get_tokenizer() is None
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = bare.generate([ids], greedy(5))[0]
    assert out.token_ids == llm.generate([ids], greedy(5))[0].token_ids  # same weights, same tokens
    assert out.text == ""
    with pytest.raises(ValueError, match="prompts"):
        bare.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="stop"):
        bare.generate([ids], greedy(5, stop=["x"]))
    assert_engine_clean(bare)


def test_cli_prints_the_offline_completion(llm):
    expected = llm.generate("import os", greedy(6))[0].text
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "engine", "--model", "tiny", "--prompt", "import os",
                           "--max-tokens", "6", "--ignore-eos", "--num-threads", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    bad = subprocess.run([sys.executable, "-m", "engine", "--prompt", "x", "--temperature", "-1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "temperature" in bad.stderr
