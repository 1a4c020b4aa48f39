"""GPTQ and compressed-tensors int4 checkpoints loaded as they are (engine/prequantized.py).

The checkpoint is written here in the published layout, GPTQ's (AutoGPTQ / GPTQModel: ``qweight`` packed along the
inputs, ``qzeros`` along the outputs and stored as zero - 1 in v1, float16 ``scales``, ``g_idx``) or
compressed-tensors' ``pack-quantized`` (``weight_packed`` [out, in / 8] of level + 8, ``weight_scale``,
``weight_shape``), from integer levels and scales drawn here; the reference is transformers' float model holding
w = (level - 8) x scale, the dequantization both formats define. pdserve must give its greedy tokens (and logits to float rounding) while running its
own int4 kernels on the checkpoint's integers.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

GROUP = 32
PROMPTS = [[5, 17, 300, 42, 9], [1000, 2000, 3000], list(range(100, 140))]


def _pack(levels: torch.Tensor, axis: int) -> torch.Tensor:
    """Values 0..15 -> int32 words of eight (lowest bits first) along ``axis``."""
    v = levels.to(torch.int64)
    if axis == 0:
        v = v.reshape(-1, 8, v.shape[1])
        words = sum(v[:, j, :] << (4 * j) for j in range(8))
    else:
        v = v.reshape(v.shape[0], -1, 8)
        words = sum(v[:, :, j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_checkpoint(d: Path, v2: bool = False, layout: str = "gptq", group: int = GROUP,
                     **qc) -> transformers.PreTrainedModel:
    """A small Llama whose every decoder linear is GPTQ int4 (symmetric, group 32), saved in GPTQ's layout in
    ``d``; returns transformers' float model with the dequantized weights (the reference)."""
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    tensors = {}
    g = torch.Generator().manual_seed(9)
    for name, lin in model.named_modules():
        if not isinstance(lin, torch.nn.Linear) or name == "lm_head":
            continue
        N, K = lin.weight.shape
        G = group or K  # (0: one scale per output channel)
        levels = torch.randint(0, 16, (K, N), generator=g)
        # (float16 scales as GPTQ stores them; compressed-tensors' in bfloat16, as llm-compressor saves them)
        scales = (torch.rand(K // G, N, generator=g) * 0.04 + 0.01).to(
            torch.bfloat16 if layout != "gptq" and group else torch.float16)
        with torch.no_grad():  # the dequantization: (level - zero) x scale, zero 8 for symmetric
            lin.weight.copy_(((levels.float() - 8) * scales.float().repeat_interleave(G, 0)).t())
        if layout == "gptq":
            tensors[f"{name}.qweight"] = _pack(levels, 0)
            tensors[f"{name}.qzeros"] = _pack(torch.full((K // G, N), 8 if v2 else 7), 1)
            tensors[f"{name}.scales"] = scales
            tensors[f"{name}.g_idx"] = (torch.arange(K) // G).to(torch.int32)
        else:  # compressed-tensors: [out, in / 8] words of level + 8 (our levels are stored values already)
            tensors[f"{name}.weight_packed"] = _pack(levels.t().contiguous(), 1)
            tensors[f"{name}.weight_scale"] = scales.t().contiguous()
            tensors[f"{name}.weight_shape"] = torch.tensor([N, K], dtype=torch.int32)
    quantized = {k.rsplit(".", 1)[0] for k in tensors}
    for name, p in model.named_parameters():
        if not name.endswith(".weight") or name[:-7] not in quantized:
            tensors[name] = p.detach().clone()
    d.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    if layout == "gptq":
        raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                      "desc_act": False, **({"checkpoint_format": "gptq_v2"} if v2 else {}), **qc}
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group" if group else "channel",
                   "group_size": group or None, "actorder": None, "dynamic": False, **qc}
        raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                    "input_activations": None}},
                                      "ignore": ["lm_head"], "quantization_status": "compressed"}
    (d / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(d / "model.safetensors"))
    return model


def _same_greedy_tokens(llm, ref, n: int) -> None:
    from engine import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for prompt, o in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert o.token_ids == hf


@pytest.mark.parametrize("kw", [{}, {"v2": True}, {"layout": "ct"}, {"layout": "ct", "group": 0}],
                         ids=["gptq", "gptq_v2", "compressed-tensors", "compressed-tensors-channel"])
def test_a_prequantized_checkpoint_runs_its_own_integers_and_gives_the_float_models_tokens(kw, tmp_path):
    from engine import LLM
    from engine.quant_formats import Int4, Int4Panels

    ref = _gptq_checkpoint(tmp_path / "m", **kw)
    llm = LLM(str(tmp_path / "m"), num_kv_blocks=64)
    model = llm.llm_engine.runner.model
    fmts = {name: type(m.fmt) for name, m in model.named_modules() if hasattr(m, "fmt") and m.fmt is not None}
    assert all(issubclass(f, Int4) for n, f in fmts.items() if n != "lm_head") and len(fmts) == 9, fmts
    assert not issubclass(fmts["lm_head"], Int4)  # (the checkpoint kept it in float: so does the engine)
    # every stored integer and scale came back: the int4 weights equal the float reference's, bit for bit
    q = model.layers[0].qkv_proj.fmt
    want = torch.cat([ref.model.layers[0].self_attn.q_proj.weight, ref.model.layers[0].self_attn.k_proj.weight,
                      ref.model.layers[0].self_attn.v_proj.weight])
    assert torch.equal(q.dense(), want.float())
    assert isinstance(q, Int4Panels) or not llm.llm_engine.config.device == "cpu"
    _same_greedy_tokens(llm, ref, 12)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq"}, "quant_method 'awq' checkpoints are not loaded"),
    ({"bits": 8}, "bits=8 is not loaded"),
    ({"sym": False}, "asymmetric GPTQ"),
    ({"desc_act": True}, "activation order"),
    ({"group_size": 48}, "group_size 48"),
    ({"layout": "ct", "symmetric": False}, "asymmetric compressed-tensors"),
    ({"layout": "ct", "num_bits": 8}, "weights of 8 bits"),
    ({"layout": "ct", "actorder": "group"}, "actorder 'group'"),
])
def test_quantized_checkpoints_the_engine_cannot_load_are_refused_by_name(qc, match, tmp_path):
    from engine import LLM

    _gptq_checkpoint(tmp_path / "m", **qc)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "m"), num_kv_blocks=64)


def test_a_prequantized_checkpoint_is_not_quantized_again(tmp_path):
    from engine import LLM

    _gptq_checkpoint(tmp_path / "m")
    with pytest.raises(ValueError, match="quantization: not available with a gptq int4 g32 checkpoint"):
        LLM(str(tmp_path / "m"), num_kv_blocks=64, quantization="int8")
    _gptq_checkpoint(tmp_path / "g64", group=64)  # (o_proj's 64 inputs split 32 a rank: a group would straddle)
    with pytest.raises(ValueError, match="each rank's .* not a multiple of quantization_group_size .64."):
        LLM(str(tmp_path / "g64"), num_kv_blocks=64, tensor_parallel_size=2)


@pytest.mark.parametrize("kw", [{}, {"layout": "ct", "group": 0}], ids=["gptq", "compressed-tensors-channel"])
def test_two_ranks_split_a_prequantized_checkpoint_with_its_scales(kw, tmp_path):
    """Each rank holds its rows (q/k/v, gate/up) or its whole groups of inputs (o_proj, down_proj) of the
    checkpoint's integers and scales, still int4: the greedy tokens of the float model."""
    from engine import LLM

    ref = _gptq_checkpoint(tmp_path / "m", **kw)
    llm = LLM(str(tmp_path / "m"), num_kv_blocks=64, tensor_parallel_size=2)
    _same_greedy_tokens(llm, ref, 8)
    # rank 0's shards hold the checkpoint's values exactly: its first half of o_proj's and down_proj's inputs
    layer, want = llm.llm_engine.runner.model.layers[0], ref.model.layers[0]
    assert torch.equal(layer.o_proj.fmt.dense(), want.self_attn.o_proj.weight[:, :32].float())
    assert torch.equal(layer.down_proj.fmt.dense(), want.mlp.down_proj.weight[:, :64].float())


def test_a_bfloat16_engine_keeps_the_checkpoints_exact_integers(tmp_path):
    """In a 16-bit model the dequantized weight is rounded to bfloat16 on its way in; the integers and scales
    still come back exactly, so the int4 layers hold the checkpoint's values, not the rounded ones."""
    from engine import LLM
    from engine.quant_formats import Int4

    ref = _gptq_checkpoint(tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), num_kv_blocks=64, dtype="bfloat16")
    layer = llm.llm_engine.runner.model.layers[1]
    assert isinstance(layer.down_proj.fmt, Int4)
    assert torch.equal(layer.down_proj.fmt.dense(), ref.model.layers[1].mlp.down_proj.weight.float())
