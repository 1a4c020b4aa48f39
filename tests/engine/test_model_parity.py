"""The engine's model matches Hugging Face transformers on the same checkpoint.

Reference: transformers' own LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM / Qwen3ForCausalLM / ... / Gemma3ForCausalLM, random-initialised and saved with save_pretrained. We check
float32 logits for every prompt position and for 20 decode steps through the
paged cache (1e-4 max-abs), and greedy continuations token for token, both as
one continuous batch and one prompt at a time.
"""
from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager  # noqa: F401  (import check)
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput, Sequence

from .conftest import greedy, hf_greedy, make_checkpoint, make_engine, prompts_of, run_engine

CASES = {
    "llama_gqa": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                              "rope_theta": 500000.0}),
    "mistral_window": ("mistral", {"sliding_window": 8}),
    "qwen2_bias": ("qwen2", {}),
    # q/k norms before RoPE, a head width that is not hidden / heads (q_proj 128 wide over a 64 hidden), tied
    "qwen3_qk_norm": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # YaRN (Qwen3's long-context setting): blended frequencies and tables scaled by its attention factor; and with
    # DeepSeek's mscale pair
    "qwen3_yarn": ("qwen3", {"head_dim": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 16}}),
    # mixture of experts: Qwen3-MoE (top-2 of 4, weights not renormalised, layer 1 dense by mlp_only_layers) and
    # Mixtral (top-2 of 4, renormalised)
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "norm_topk_prob": False, "mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Qwen2-MoE: a shared expert beside the routed ones, gated by a sigmoid; q/k/v biases; renormalised top-2
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "norm_topk_prob": True}),
    # Granite: embedding, residual and attention multipliers and logits scaling (folded into the weights), tied and not
    "granite_tied": ("granite", {"embedding_multiplier": 1.5, "residual_multiplier": 1.2, "attention_multiplier": 0.3,
                                 "logits_scaling": 1.5, "tie_word_embeddings": True}),
    "granite": ("granite", {"embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
                            "logits_scaling": 2.0}),
    # Phi-3: q/k/v and gate/up stored fused, a sliding window
    "phi3_fused_window": ("phi3", {"sliding_window": 8}),
    # Gemma 3: (1 + w) norms in float32, four a layer; GeGLU; sqrt(hidden)-scaled embeddings; query/key norms and a
    # query_pre_attn_scalar that is not head_dim; local (sliding, base 10k) and global (linear-scaled) layers
    "gemma3": ("gemma3", {"head_dim": 32, "num_hidden_layers": 3, "sliding_window": 8, "query_pre_attn_scalar": 20,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1000000.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    # and its final logit soft-capping, untied
    "gemma3_softcap": ("gemma3", {"final_logit_softcapping": 2.0, "tie_word_embeddings": False,
                                  "sliding_window": 6}),
    "llama_yarn_mscale": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.8,
                                                     "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                                                     "original_max_position_embeddings": 32}}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, over = CASES[request.param]
    d, model = make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **over)
    return request.param, d, model


def engine_logits(eng, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Engine logits for positions 0..len-2: the prompt in one prefill, then one decode step per token."""
    seq = Sequence("x", tokens[:prompt_len], SamplingParams())
    bm = eng.block_manager
    rows = []
    with torch.inference_mode():
        for step in range(len(tokens) - prompt_len + 1):
            n = prompt_len if step == 0 else 1
            assert bm.ensure(seq.block_table, seq.num_computed + n)
            sched = SchedulerOutput(prefills=[(seq, n)]) if n > 1 else SchedulerOutput(decodes=[seq])
            ids, pos, meta, _, _, _ = eng.runner._prepare(sched)
            meta.keep = None  # logits for every prompt row, not only the sampling one
            hidden = eng.model(ids, pos, meta, eng.kv_caches)
            rows.append(eng.model.compute_logits(hidden))
            seq.num_computed += n
            if seq.num_tokens < len(tokens):
                seq.append(tokens[seq.num_tokens])
    bm.free(seq.block_table)
    return torch.cat(rows)


def test_logits_match_transformers(case):
    name, d, hf = case
    eng = make_engine(d)
    prompt = prompts_of([13], seed=7)[0]
    cont = hf_greedy(hf, prompt, 20)
    tokens = prompt + cont
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    got = engine_logits(eng, tokens, len(prompt))
    assert got.shape == (len(tokens), ref.shape[1])
    diff = (got - ref).abs().max().item()
    assert diff < 1e-4, f"{name}: max-abs logits diff {diff}"
    # a real check that the tolerance is meaningful: logits have O(1) spread
    assert ref.std().item() > 0.1
    # the engine's own step (last layer pruned to the sampling row) gives the same distribution
    eng.add_request("lp", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    (out,) = eng.step()
    ref_lp = torch.log_softmax(ref[len(prompt) - 1], -1)
    top = ref_lp.topk(5)
    assert [t for t, _ in out.logprobs[0].top] == top.indices.tolist()
    assert max(abs(lp - r) for (_, lp), r in zip(out.logprobs[0].top, top.values.tolist())) < 1e-4
    assert eng.num_free_blocks == eng.num_total_blocks


def test_greedy_batch_and_single_match_transformers(case):
    name, d, hf = case
    lengths = [1, 5, 9, 16, 17, 23, 31, 40]
    prompts = prompts_of(lengths, seed=3)
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    # continuous batch: all 8 at once, with a token budget that forces mixed prefill/decode steps
    eng = make_engine(d, max_num_batched_tokens=64)
    got = run_engine(eng, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(32))
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == expected[i], f"{name}: batched prompt {i} (len {len(p)}) differs"
    # one prompt at a time
    for i, p in enumerate(prompts[::3]):
        single = run_engine(eng, {"s": p}, greedy(32))["s"]
        assert single == expected[i * 3], f"{name}: single prompt {i * 3} differs"
    assert eng.num_free_blocks == eng.num_total_blocks
    # the continuation must not be degenerate, or token equality would prove little
    assert len(set(expected[-1])) > 4


def test_sharded_checkpoint_loads_identically(tmp_path):
    d1, hf = make_checkpoint(tmp_path / "single", "llama", seed=5)
    d2, _ = make_checkpoint(tmp_path / "sharded", "llama", seed=5, max_shard_size="50KB")
    assert (d2 / "model.safetensors.index.json").is_file()
    assert len(list(d2.glob("*.safetensors"))) > 2
    prompts = prompts_of([6, 11], seed=11)
    a = run_engine(make_engine(d1), {"a": prompts[0], "b": prompts[1]}, greedy(12))
    b = run_engine(make_engine(d2), {"a": prompts[0], "b": prompts[1]}, greedy(12))
    assert a == b
    assert a["a"] == hf_greedy(hf, prompts[0], 12)


def test_bad_checkpoints_raise_value_error(tmp_path):
    d, _ = make_checkpoint(tmp_path / "ok", "llama")
    with pytest.raises(ValueError, match="model"):
        make_engine(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        make_engine(tmp_path / "empty")
    import json
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures"):
        make_engine(d)
    with pytest.raises(ValueError, match="dtype"):
        make_engine(tmp_path / "ok", dtype="int8")


@pytest.mark.parametrize("over, match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "'longrope'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
])
def test_rope_the_engine_cannot_compute_is_refused_not_approximated(over, match):
    """A checkpoint whose RoPE the engine does not implement is refused by name at load: silently running it with
    default frequencies would give another model's numbers."""
    from engine.config import ModelConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64, **over}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)


def test_what_moe_models_do_not_support_yet_is_refused_by_name(tmp_path):
    """No quantized expert format, no tensor-parallel split of experts and no LoRA on MoE models yet: each is a
    ValueError naming it at load, not a model that runs with part of it ignored."""
    from engine.config import ModelConfig
    from engine.lora import load_adapter
    from engine.tensor_parallel import check_tensor_parallel

    d, _ = make_checkpoint(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="quantization 'int8': a mixture-of-experts"):
        make_engine(d, quantization="int8")
    import json
    mc = ModelConfig.from_hf_dict(json.loads((d / "config.json").read_text()))
    with pytest.raises(ValueError, match="tensor_parallel_size=2: tensor parallelism does not split mixture"):
        check_tensor_parallel(mc, 2)
    with pytest.raises(ValueError, match="LoRA adapters on a mixture-of-experts model"):
        load_adapter("a", str(tmp_path), mc)
    # decode graphs (static buffers here) are off: the steps run eagerly and still match
    eng = make_engine(d, static_decode_buffers=True)
    assert eng.runner.graphs is None


def test_a_yarn_config_built_by_hand_needs_its_original_context():
    from engine.config import ModelConfig

    with pytest.raises(ValueError, match="yarn needs original_max_position_embeddings"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    ModelConfig(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 512})  # factor derived


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3 from 4B up ships as ``Gemma3ForConditionalGeneration`` (a vision tower, a projector and the language
    model under ``language_model.``, the text config nested): the engine loads the language model alone and its
    greedy text continuations equal transformers' multimodal model's on the same text."""
    import json

    import transformers

    from tests.engine.conftest import VOCAB, hf_config

    text = hf_config("gemma3", head_dim=32, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=20).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    # (image and boundary tokens outside this vocabulary: a text-only prompt never holds one)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_id=VOCAB + 10, boi_token_id=VOCAB + 11, eoi_token_id=VOCAB + 12)
    torch.manual_seed(2)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in saved
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith(("vision_tower.", "model.vision_tower.")) for n in names)  # (skipped, not a mismatch)
    eng = make_engine(tmp_path)
    assert eng.model.config.architecture == "Gemma3ForCausalLM" and eng.model.config.num_hidden_layers == 3
    prompts = prompts_of([4, 11, 19], seed=5)
    got = run_engine(eng, {str(i): p for i, p in enumerate(prompts)}, greedy(16))
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(hf, p, 16), i
    assert len(set(got["2"])) > 4


def test_gemma3_bfloat16_norms_and_embeddings_round_as_transformers(tmp_path):
    """In bfloat16 Gemma scales a norm's row by (1 + weight) before rounding (Llama rounds first) and multiplies the
    embeddings by sqrt(hidden) rounded to bfloat16 (sqrt(48) is not a bfloat16 number): the engine's rows equal
    transformers' to the bit."""
    import transformers

    d, _ = make_checkpoint(tmp_path, "gemma3", hidden_size=48, head_dim=16)
    hf = transformers.Gemma3ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    eng = make_engine(d, dtype="bfloat16")
    ids = torch.arange(3, 200)
    with torch.inference_mode():
        assert torch.equal(eng.model.embed_tokens(ids), hf.model.embed_tokens(ids))
        x = hf.model.embed_tokens(ids)
        hl, el = hf.model.layers[1], eng.model.layers[1]
        assert el.post_attention_layernorm.weight.abs().max() > 0.5  # (HF's pre_feedforward_layernorm, loaded)
        for ours, theirs in ((el.input_layernorm, hl.input_layernorm),
                             (el.attn_out_norm, hl.post_attention_layernorm),
                             (el.post_attention_layernorm, hl.pre_feedforward_layernorm),
                             (el.mlp_out_norm, hl.post_feedforward_layernorm), (eng.model.norm, hf.model.norm)):
            assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("cfg, match", [
    ({"architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM soft-caps its attention scores"),
    ({"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding_attention: rope_type 'linear'"),
])
def test_gemma_variants_the_engine_cannot_compute_are_refused_by_name(cfg, match):
    from engine.config import ModelConfig

    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, **cfg})


def test_gemma3_config_follows_transformers_defaults_and_both_rope_layouts():
    """The Hub's Gemma 3 configs leave fields to transformers' defaults and write RoPE in 4.x's layout
    (rope_theta, rope_local_base_freq, rope_scaling for the global layers) or 5.x's (per layer type): the engine
    reads what transformers reads."""
    import transformers

    from engine.config import ModelConfig

    v4 = {"architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": {"hidden_size": 2560, "num_hidden_layers": 34, "intermediate_size": 10240,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024,
                          "model_type": "gemma3_text"}}
    mc = ModelConfig.from_hf_dict(v4)
    ref = transformers.Gemma3TextConfig(**v4["text_config"])
    assert (mc.vocab_size, mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads) == (
        ref.vocab_size, ref.head_dim, ref.num_attention_heads, ref.num_key_value_heads)
    assert mc.sliding_windows == [1024 if t == "sliding_attention" else None for t in ref.layer_types]
    assert mc.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert mc.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert mc.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert mc.hidden_act == ref.hidden_activation and mc.tie_word_embeddings and mc.gemma_norms
    assert mc.attention_multiplier is None  # (query_pre_attn_scalar 256 = head_dim)
    v5 = ref.to_dict()
    v5["architectures"] = ["Gemma3ForCausalLM"]
    mc5 = ModelConfig.from_hf_dict(v5)
    assert (mc5.rope_theta, mc5.rope_scaling, mc5.rope_local_theta, mc5.sliding_windows) == (
        mc.rope_theta, mc.rope_scaling, mc.rope_local_theta, mc.sliding_windows)
