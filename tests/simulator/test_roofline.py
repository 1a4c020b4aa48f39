"""``pdserve roofline``: a profile from a model's shape and a datasheet (simulator/roofline.py).

The expected numbers are worked out here by hand from the shapes (parameters counted layer by layer) or come from
the model publishers' parameter counts, never from the module's own output."""
from __future__ import annotations

import json

import pytest

from cluster import cli as pdserve_cli
from engine.config import ModelConfig
from simulator import cli as simulate_cli
from simulator.costs import load_profile
from simulator.roofline import HARDWARE, Efficiency, Hardware, model_config_of, roofline_profile

# a toy decoder: hidden 64, 2 layers, 4 query / 2 KV heads of 16, SwiGLU 128, vocabulary 1000, float32
TOY = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
TOY_LINEAR = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128)  # q, k, v, o, gate/up/down: 73,728
TOY_BYTES = 4 * (1000 * 64 + TOY_LINEAR + 5 * 64 + 1000 * 64)  # embedding, layers, 5 norms, LM head: 808,192
TOY_STEP = TOY_BYTES - 4 * 1000 * 64  # what a step reads: not the embedding table (it gathers its rows)
FLAT = Hardware("flat", {"float32": 1e9}, memory_bytes_per_s=1e8, memory_bytes=1e9, interconnect_bytes_per_s=1e7)
IDEAL = Efficiency(mbu=1.0, mfu=1.0, attention_mfu=1.0, step_overhead_s=0.0, chunk_overhead_s=0.0,
                   link_efficiency=1.0)


def toy(**kw):
    return roofline_profile(TOY, FLAT, model="toy", dtype="float32", eff=kw.pop("eff", IDEAL), **kw)


def test_the_toy_models_steps_are_its_roofline_by_hand():
    p = toy()
    s = p.step
    assert p.weight_bytes_per_rank == TOY_BYTES
    assert s.lin(1) == pytest.approx(TOY_STEP / 1e8)                    # the weights once: memory-bound
    assert s.lin(32) == pytest.approx(TOY_STEP / 1e8)                   # still below the ridge (~38 tokens)
    assert s.lin(64) == pytest.approx(2 * TOY_LINEAR * 64 / 1e9)        # past it: compute-bound
    assert s.lin(32768) == pytest.approx(2 * TOY_LINEAR * 32768 / 1e9)
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4                    # K and V x layers x KV heads x dim x fp32
    assert s.per_decode_ctx_s == pytest.approx(512 / 1e8)
    assert s.per_prefill_ctx_s == pytest.approx(512 / 1e8)
    assert s.per_prefill_pair_s == pytest.approx(4 * 4 * 16 * 2 / 1e9)  # QK^T and PV of 4 heads x 2 layers
    assert s.per_sampled_row_s == pytest.approx(2 * 64 * 1000 / 1e9)
    assert p.links["cuda_ipc"].bytes_per_s == p.links["nccl"].bytes_per_s == 1e7
    assert p.meta["synthetic"] == "roofline"


def test_efficiencies_and_overheads_scale_what_they_name():
    p = toy(eff=Efficiency(mbu=0.5, mfu=0.25, attention_mfu=0.5, step_overhead_s=1e-3, chunk_overhead_s=2e-4,
                           link_efficiency=0.5))
    s = p.step
    assert s.lin(1) == pytest.approx(TOY_STEP / 0.5e8 + 1e-3)
    assert s.lin(32768) == pytest.approx(2 * TOY_LINEAR * 32768 / 0.25e9 + 1e-3)
    assert s.per_prefill_pair_s == pytest.approx(4 * 4 * 16 * 2 / 0.5e9)
    assert s.per_prefill_chunk_s == pytest.approx(2e-4)
    assert p.links["cuda_ipc"].bytes_per_s == pytest.approx(0.5e7)


def test_tensor_parallel_ranks_hold_half_and_pay_two_all_reduces_a_layer():
    p = toy(tensor_parallel_size=2)
    rank_bytes = 4 * (500 * 64 + TOY_LINEAR // 2 + 5 * 64 + 500 * 64)
    assert p.weight_bytes_per_rank == rank_bytes
    assert p.rank_kv_bytes_per_token == 256 and p.kv_bytes_per_token == 512  # one KV head a rank
    allreduce = 20e-6 + 2 * (2 - 1) / 2 * 1 * 64 * 4 / 1e7  # one row of hidden 64 in fp32
    assert p.step.lin(1) == pytest.approx((rank_bytes - 4 * 500 * 64) / 1e8 + 2 * 2 * allreduce)
    assert p.step.per_prefill_pair_s == pytest.approx(4 * 2 * 16 * 2 / 1e9)  # two query heads a rank


@pytest.mark.parametrize("name, params", [
    ("llama-3.2-1b", 1.23e9),    # Meta's model card: 1.23B
    ("llama-3.1-8b", 8.03e9),    # 8.03B
    ("llama-3.1-70b", 70.6e9),   # 70.6B
])
def test_named_shapes_weigh_what_their_publishers_count(name, params):
    p = roofline_profile(model_config_of(name, "bfloat16"), HARDWARE["h200"], model=name, tensor_parallel_size=1
                         if name != "llama-3.1-70b" else 2)
    total = p.weight_bytes_per_rank * (2 if name == "llama-3.1-70b" else 1)
    assert total == pytest.approx(2 * params, rel=0.01)


def test_quantized_weights_shrink_the_decode_step_and_fp8_doubles_the_math():
    mc = model_config_of("llama-3.1-8b", "bfloat16")
    bf16 = roofline_profile(mc, HARDWARE["h100-sxm"], model="8b", eff=IDEAL)
    int4 = roofline_profile(mc, HARDWARE["h100-sxm"], model="8b", quantization="int4", eff=IDEAL)
    fp8 = roofline_profile(mc, HARDWARE["h100-sxm"], model="8b", quantization="fp8", eff=IDEAL)
    embed_and_head = 2 * 2 * 128256 * 4096  # both stay bfloat16
    layers = bf16.weight_bytes_per_rank - embed_and_head
    assert int4.weight_bytes_per_rank == pytest.approx(embed_and_head + layers / 4, rel=1e-4)  # norms aside
    assert int4.step.lin(1) == pytest.approx((int4.weight_bytes_per_rank - 2 * 128256 * 4096) / 3.35e12)
    assert bf16.step.lin(32768) / fp8.step.lin(32768) == pytest.approx(1978.9 / 989.4)  # the datasheet's peaks
    assert int4.step.lin(32768) == pytest.approx(bf16.step.lin(32768))         # weight-only: bf16 math


def test_what_the_device_cannot_do_is_refused():
    a100 = HARDWARE["a100-80gb"]
    with pytest.raises(ValueError, match="--quantization fp8.*no fp8"):
        roofline_profile(TOY, a100, model="toy", dtype="bfloat16", quantization="fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8"):
        roofline_profile(TOY, a100, model="toy", dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"141\.1 GB.*--tensor-parallel-size 1.*80 GB"):
        roofline_profile(model_config_of("llama-3.1-70b", "bfloat16"), HARDWARE["h100-sxm"], model="70b")
    with pytest.raises(ValueError, match="--mbu"):
        toy(eff=Efficiency(mbu=0.0))


def test_cli_writes_a_profile_simulate_runs_on(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = pdserve_cli.main(["roofline", "--model", "bench", "--hardware", "l40s", "--dtype", "float32",
                           "--tensor-parallel-size", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "synthetic, not measured" in printed and "decode step" in printed
    prof = load_profile(out)
    assert prof.tensor_parallel_size == 2 and prof.meta["synthetic"] == "roofline"
    assert prof.meta["command"].startswith("pdserve roofline --model bench")
    res = tmp_path / "r.json"
    rc = simulate_cli.main(["--profile", str(out), "--trace", "tests/data/azure_llm_2023_conv_first400.csv",
                            "--num-prompts", "30", "--length-scale", "0.1", "--request-rate", "8", "--kv-link",
                            "cuda_ipc", "--tensor-parallel-size", "2", "--save-result", str(res)])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(res.read_text())["completed"] == 30


def test_router_costs_come_from_a_measured_profile(tmp_path):
    measured = tmp_path / "m.json"
    src = roofline_profile(TOY, FLAT, model="toy", dtype="float32")
    src.router_per_request_s, src.router_per_token_s, src.router_per_step_s = 0.004, 0.0002, 0.0003
    measured.write_text(json.dumps(src.to_dict()))
    out = tmp_path / "p.json"
    assert pdserve_cli.main(["roofline", "--model", "tiny", "--hardware", "h200", "--router-from", str(measured),
                             "--out", str(out)]) == 0
    p = load_profile(out)
    assert (p.router_per_request_s, p.router_per_token_s, p.router_per_step_s) == (0.004, 0.0002, 0.0003)


@pytest.mark.parametrize("args, needle", [
    (["--hardware", "tpu"], "--hardware must be one of"),
    (["--hardware", "custom", "--peak-tflops", "10"], "--memory-gbps, --interconnect-gbps, --memory-gib"),
    (["--hardware", "h200", "--mfu", "1.5"], "--mfu must be in (0, 1]"),
    (["--hardware", "h200", "--step-overhead-ms", "-1"], "--step-overhead-ms must be >= 0"),
    (["--hardware", "h200", "--memory-gbps", "0"], "--memory-gbps must be > 0"),
    (["--hardware", "h200", "--dtype", "int8"], "--dtype must be"),
    (["--hardware", "h200", "--quantization", "nf4"], "--quantization must be"),
    (["--hardware", "h200", "--tensor-parallel-size", "3"], "--tensor-parallel-size=3 must divide"),
    (["--hardware", "a100-80gb", "--quantization", "fp8"], "no fp8"),
    (["--hardware", "h200", "--model", "/nonexistent/model"], "model"),
])
def test_cli_bad_input_exits_2_naming_the_flag_and_writes_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "p.json"
    argv = ["roofline", *(args if "--model" in args else ["--model", "llama-3.1-8b", *args]), "--out", str(out)]
    assert pdserve_cli.main(argv) == 2
    assert needle in capsys.readouterr().err and not out.exists()


def test_a_70b_on_h100s_is_planned_from_roofline_profiles_one_per_tp(tmp_path, capsys):
    """The question a platform team asks first (issue 44): Llama-3.1-70B on 8 H100s, which TP per pool and which
    split. TP 1 does not fit a rank and is refused; TP 2, 4 and 8 profiles feed `pdserve plan` as measured ones do."""
    from simulator import plan

    assert pdserve_cli.main(["roofline", "--model", "llama-3.1-70b", "--hardware", "h100-sxm",
                             "--out", str(tmp_path / "tp1.json")]) == 2
    assert "raise --tensor-parallel-size" in capsys.readouterr().err
    paths = []
    for tp in (2, 4, 8):
        paths.append(str(tmp_path / f"tp{tp}.json"))
        assert pdserve_cli.main(["roofline", "--model", "llama-3.1-70b", "--hardware", "h100-sxm",
                                 "--tensor-parallel-size", str(tp), "--out", paths[-1]]) == 0
    out = tmp_path / "plan.json"
    rc = plan.main([*(a for p in paths for a in ("--profile", p)), "--dataset-name", "random", "--input-len", "500",
                    "--output-len", "50", "--num-prompts", "40", "--chunk-sizes", "2048", "--local-prefill", "0",
                    "--workers", "8", "--rank-memory-bytes", str(72 * 10 ** 9), "--kv-link", "nccl",
                    "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100", "--save-result", str(out)])
    assert rc == 0, capsys.readouterr().err
    d = json.loads(out.read_text())
    assert d["tp_sizes"] == [2, 4, 8] and all(c["ranks"] == 8 for c in d["candidates"])
    assert all(c["goodput_rps"] > 0 for c in d["best"].values())


@pytest.mark.parametrize("name, shape", [("h200-llama-1b-shape-bf16", "cuda-bench-1b"),
                                         ("h200-llama-8b-shape-bf16", "cuda-bench-8b")])
def test_no_step_measured_on_the_h200_beats_its_roofline_floor(tmp_path, capsys, name, shape):
    """Physics, not a number from the code: at 100% of the datasheet's bandwidth and peak and no overhead, the
    roofline is a floor no measured step can go under. This catches gross errors only (three times the FLOPs puts
    the 8B's largest prefills under it; the weights' bytes would have to be off ~5x, the launch-bound engine being
    that far from its floor): the hand-worked tests above catch the small ones."""
    from benchmarks import roofline_check

    out = tmp_path / "check.json"
    assert roofline_check.main(["--profile", f"docs/profiles/{name}.json", "--hardware", "h200", "--model", shape,
                                "--json", str(out)]) == 0
    kinds = json.loads(out.read_text())["kinds"]
    assert {"decode", "prefill", "mixed"} <= set(kinds)
    assert all(k["min_ratio"] > 1.0 for k in kinds.values()), kinds
    assert "of the step is the roofline's" in capsys.readouterr().out
