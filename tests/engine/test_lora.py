"""LoRA adapters (engine/lora.py) against Hugging Face PEFT, the reference implementation.

A random Llama checkpoint (tests/engine/conftest.py) gets two adapters made with PEFT itself (``get_peft_model``,
random A and B: ``init_lora_weights=False``) and saved in PEFT's format: ``all`` (every projection, r=8, alpha 16)
and ``qv`` (q_proj and v_proj, r=4, rsLoRA). The engine serves both beside the base model; each request's logprobs,
prompt logprobs and greedy tokens must equal PEFT's model with that adapter (``PeftModel.from_pretrained``), with
the base model and both adapters mixed in one continuously batched run (chunked prefills, fused decode steps for
base rows), and a prefix cached under one adapter must never serve another.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.block_manager import prefix_block_hashes
from engine.kv_events import BlockStored, kv_batch_from_raw
from engine.lora import lora_key_root
from engine.sampling_params import SamplingParams

from tests.engine.conftest import hf_greedy, make_checkpoint, make_engine, prompts_of, run_engine



def _peft():
    """PEFT, imported when a test needs it, not at collection: it imports triton, which must not be imported before
    tests/engine/test_triton_kernels.py sets up Triton's interpreter (xdist workers collect every file)."""
    return pytest.importorskip("peft")

ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint dir, {adapter: dir}, {None | adapter: the transformers/PEFT reference model})."""
    import transformers

    peft = _peft()
    root = tmp_path_factory.mktemp("lora")
    ckpt, base = make_checkpoint(root / "base", "llama")
    dirs, refs = {}, {None: base}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        fresh = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
        pm = peft.get_peft_model(fresh, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kw))
        with torch.no_grad():  # B of magnitude O(0.1): the adapters change the answers, observably
            for pname, p in pm.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, 0.1)
        pm.save_pretrained(root / name)
        dirs[name] = str(root / name)
        refs[name] = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(ckpt).eval(),
                                                    root / name).eval()
    return ckpt, dirs, refs


@pytest.fixture(scope="module")
def engine(setup):
    ckpt, dirs, _ = setup
    return make_engine(ckpt, lora_modules=dirs, max_num_batched_tokens=48)


def _ref_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", [None, "all", "qv"])
def test_logprobs_and_prompt_logprobs_match_peft(setup, engine, name):
    _, _, refs = setup
    prompt = prompts_of([21], seed=11)[0]
    ref = torch.log_softmax(_ref_logits(refs[name], prompt), -1)
    engine.add_request(f"lp-{name}", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5,
                                                             prompt_logprobs=3, lora_name=name))
    (out,) = run_steps(engine)
    top = ref[-1].topk(5)
    assert [t for t, _ in out.logprobs[0].top] == top.indices.tolist()
    assert max(abs(lp - r) for (_, lp), r in zip(out.logprobs[0].top, top.values.tolist())) < 1e-4
    # every prompt position (the chunked prefill's rows, all of them adapted)
    got = [p.logprob for p in out.prompt_logprobs[1:]]
    want = [ref[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert engine.num_free_blocks == engine.num_total_blocks


def run_steps(eng: LLMEngine):
    """Step until done; the finished outputs (one per request, the last, with everything accumulated)."""
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            prev = outs.get(o.request_id)
            if prev is not None and o.prompt_logprobs is None:
                o.prompt_logprobs = prev.prompt_logprobs
            outs[o.request_id] = o
    return list(outs.values())


def assert_greedy_is_peft(eng, refs: dict, prompts: list, names: list, max_tokens: list) -> None:
    """Every prompt added at once under its adapter (``names``; None: the base model), the engine stepped to the end:
    each greedy answer equals PEFT's model under that adapter, and every block is free again."""
    for i, (p, n, m) in enumerate(zip(prompts, names, max_tokens)):
        eng.add_request(f"g{i}", p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, lora_name=n))
    got: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    for i, (p, n, m) in enumerate(zip(prompts, names, max_tokens)):
        assert got[f"g{i}"] == hf_greedy(refs[n], p, m), f"prompt {i} under {n!r} differs from PEFT"
    assert eng.num_free_blocks == eng.num_total_blocks


def test_adapters_change_the_answer(setup):
    """The test's adapters are not no-ops: each one's greedy answer differs from the base model's."""
    _, _, refs = setup
    prompt = prompts_of([9], seed=5)[0]
    answers = {name: hf_greedy(m, prompt, 16) for name, m in refs.items()}
    assert answers[None] != answers["all"] and answers[None] != answers["qv"] and answers["all"] != answers["qv"]


@pytest.mark.parametrize("variant", ["kernel", "static-buffers", "torch"])
def test_mixed_batch_greedy_matches_peft(setup, engine, variant, monkeypatch):
    """Base, 'all' and 'qv' requests in one continuous batch (48-token steps: chunked prefills beside decodes;
    base-only decode steps take the fused C++ layer) each equal PEFT's greedy answer under its adapter: through
    pdserve's CPU kernel (one call a linear), through torch where it is not built, and with the decode graphs'
    static buffers (the CUDA graph path, run on CPU), where steps with an adapter's row run eagerly."""
    ckpt, dirs, refs = setup
    static = variant == "static-buffers"
    if variant == "kernel":
        from engine.kernels import cpu_kernels

        if cpu_kernels() is None:
            pytest.skip("pdserve's CPU kernels are not built here")
    if variant == "torch":
        import engine.kernels as kernels_module

        monkeypatch.setattr(kernels_module, "cpu_kernels", lambda: None)  # (read by engine/lora.py at attach)
    if variant != "kernel":
        engine = make_engine(ckpt, lora_modules=dirs, max_num_batched_tokens=48, static_decode_buffers=static)
    if variant != "static-buffers":
        assert (engine.model.layers[0].lora.kern is None) == (variant == "torch")
    prompts = prompts_of([3, 9, 17, 30, 12, 5, 26, 8, 19, 4], seed=23)
    # (the last, a base-model prompt, decodes alone at the end: base-only steps)
    assert_greedy_is_peft(engine, refs, prompts, [None, "all", "qv"] * 3 + [None], [20] * 9 + [30])
    if static:
        assert engine.graph_steps > 0  # the base-only steps at the end went through the static buffers


def test_prefix_cache_is_per_adapter(setup):
    """A prompt cached under one adapter is a miss under another and under the base model (whose answer stays the
    base model's), and a hit under the same adapter again."""
    ckpt, dirs, refs = setup
    eng = make_engine(ckpt, lora_modules=dirs)
    prompt = prompts_of([33], seed=31)[0]

    def ask(name):
        before = eng.prefix_cache_hits
        out = run_engine(eng, {"p": prompt}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                            lora_name=name))["p"]
        return out, eng.prefix_cache_hits - before

    out_all, hits = ask("all")
    assert hits == 0 and out_all == hf_greedy(refs["all"], prompt, 8)
    out_base, hits = ask(None)
    assert hits == 0 and out_base == hf_greedy(refs[None], prompt, 8)
    out_qv, hits = ask("qv")
    assert hits == 0 and out_qv == hf_greedy(refs["qv"], prompt, 8)
    out_again, hits = ask("all")
    assert hits == 32 and out_again == out_all
    assert eng.cached_prefix_tokens(prompt[:32], lora_name="all") == 32
    assert eng.cached_prefix_tokens(prompt[:32], lora_name="qv") == 32
    eng2 = make_engine(ckpt, lora_modules={"all": dirs["all"]})
    assert eng2.cached_prefix_tokens(prompt[:32], lora_name="all") == 0
    # the roots routers hash with: the base model's is 0, each adapter's its own, from its name and its files
    roots = eng.lora_adapters()
    assert lora_key_root(None) == 0 and len({0, roots["all"], roots["qv"]}) == 3
    assert roots["all"] == eng2.lora_adapters()["all"]  # the same files: the same root on every engine
    assert roots["all"] == lora_key_root("all", eng.lora.by_slot[eng.lora.slot_of["all"]].digest)


def test_kv_events_name_the_adapter_and_match_the_routers_hashes(setup):
    """The blocks a request stores under an adapter are the hashes a router computes for it
    (``prefix_block_hashes`` with the adapter's root), reported as vLLM does: the chain's first block without a
    parent, with the adapter's ``lora_id`` (its slot)."""
    ckpt, dirs, _ = setup
    eng = make_engine(ckpt, lora_modules=dirs)
    eng.block_manager.enable_events()
    prompt = prompts_of([21], seed=51)[0]
    run_engine(eng, {"a": prompt}, SamplingParams(max_tokens=2, temperature=0.0, lora_name="qv"))
    roots = eng.lora_event_ids()  # what a worker's publisher is given
    (stored,) = [e for e in kv_batch_from_raw(eng.block_manager.take_events(), 4, lora_roots=roots).events
                 if isinstance(e, BlockStored)]
    assert stored.block_hashes == prefix_block_hashes(prompt, 4, eng.lora_adapters()["qv"])
    assert stored.parent_block_hash is None and stored.lora_id == eng.lora.slot_of["qv"] == 2
    assert not set(stored.block_hashes) & set(prefix_block_hashes(prompt, 4))


def test_reserved_blocks_are_per_adapter(setup):
    """A decode worker's reservation reuses cached blocks of the request's own adapter only, and its prefilled
    request must name the adapter it reserved under."""
    ckpt, dirs, _ = setup
    eng = make_engine(ckpt, lora_modules=dirs)
    prompt = prompts_of([25], seed=41)[0]
    run_engine(eng, {"warm": prompt}, SamplingParams(max_tokens=2, temperature=0.0, lora_name="qv"))
    _, cached = eng.reserve_prompt("r1", len(prompt), prompt, lora_name="all")
    assert cached == 0
    _, cached = eng.reserve_prompt("r2", len(prompt), prompt, lora_name="qv")
    assert cached == 24
    with pytest.raises(ValueError, match="lora_name"):
        eng.add_prefilled_request("r2", prompt, 5, SamplingParams(max_tokens=4, lora_name="all"))
    eng.add_prefilled_request("r2", prompt, 5, SamplingParams(max_tokens=4, temperature=0.0, lora_name="qv"))
    eng.abort_request("r1")
    eng.abort_request("r2")
    assert eng.num_free_blocks == eng.num_total_blocks


def test_bad_requests_and_configs(setup, tmp_path):
    ckpt, dirs, _ = setup
    eng = make_engine(ckpt, lora_modules=dirs)
    with pytest.raises(ValueError, match=r"lora_name: this engine serves no LoRA adapter 'nope' \(adapters: 'all', 'qv'\)"):
        eng.add_request("x", [5, 6], SamplingParams(lora_name="nope"))
    with pytest.raises(ValueError, match="lora_name"):
        eng.reserve_prompt("y", 2, [5, 6], lora_name="nope")
    assert not eng.has_request("x") and not eng.has_request("y")
    plain = make_engine(ckpt)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.add_request("x", [5, 6], SamplingParams(lora_name="all"))
    with pytest.raises(ValueError, match="lora_name: adapter name"):
        SamplingParams(lora_name="")
    with pytest.raises(ValueError, match="lora_modules do not work with device 'cuda'"):
        EngineConfig(model=str(ckpt), lora_modules=dirs, device="cuda")
    with pytest.raises(ValueError, match="'name=path'"):
        EngineConfig(model=str(ckpt), lora_modules=["all"])
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig(model=str(ckpt), lora_modules=[f"a={dirs['all']}", f"a={dirs['qv']}"])
    # a directory that is not an adapter, and adapters that do not fit: refused at start, naming the adapter
    with pytest.raises(ValueError, match=r"adapter 'none' .*no adapter_config.json"):
        make_engine(ckpt, lora_modules={"none": str(tmp_path)})
    bad = tmp_path / "dora"
    bad.mkdir()
    cfg = json.loads(open(f"{dirs['qv']}/adapter_config.json").read())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes(open(f"{dirs['qv']}/adapter_model.safetensors", "rb").read())
    with pytest.raises(ValueError, match="adapter 'dora'.*use_dora=true is not supported"):
        make_engine(ckpt, lora_modules={"dora": str(bad)})
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    with pytest.raises(ValueError, match=r"q_proj: lora_A \(4, 64\) / lora_B \(64, 4\) do not fit r=8"):
        make_engine(ckpt, lora_modules={"dora": str(bad)})
    other, _ = make_checkpoint(tmp_path / "wide", "llama", hidden_size=96)
    with pytest.raises(ValueError, match="adapter 'qv'.*do not fit"):
        make_engine(other, lora_modules={"qv": dirs["qv"]})


def test_speculative_verification_runs_under_the_adapter(setup):
    """n-gram drafts verified under each request's adapter: the greedy answers are PEFT's, drafts were made."""
    ckpt, dirs, refs = setup
    eng = make_engine(ckpt, lora_modules=dirs, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                      "prompt_lookup_max": 2})
    prompts = [p * 3 for p in prompts_of([4, 5, 6], seed=61)]  # repeats: the proposer finds n-grams
    assert_greedy_is_peft(eng, refs, prompts, ["all", None, "qv"], [16] * 3)
    assert eng.spec_stats.num_draft_tokens > 0


def test_the_kernel_adds_what_torch_adds():
    """engine/csrc/lora.cpp against the torch path on the same pieces: widths that are not multiples of 16, ranks 1-9,
    rows of three adapters, the base model's and none of one adapter's, a slot with no row."""
    from engine.kernels import cpu_kernels
    from engine.lora import LayerLoRA, StepLoRA, _Piece

    kern = cpu_kernels()
    if kern is None:
        pytest.skip("pdserve's CPU kernels are not built here")
    g = torch.Generator().manual_seed(5)
    K, N = 37, 53
    pieces = [_Piece(1, 0, 20, torch.randn(3, K, generator=g), torch.randn(3, 20, generator=g)),
              _Piece(1, 20, 53, torch.randn(3, K, generator=g), torch.randn(3, 33, generator=g)),
              _Piece(2, 5, 45, torch.randn(9, K, generator=g), torch.randn(9, 40, generator=g)),
              _Piece(3, 0, 53, torch.randn(1, K, generator=g), torch.randn(1, 53, generator=g)),
              _Piece(4, 0, 16, torch.randn(2, K, generator=g), torch.randn(2, 16, generator=g))]
    with_kern, with_torch = LayerLoRA(kern), LayerLoRA(None)
    for p in pieces:
        with_kern.add("o_proj", p)
        with_torch.add("o_proj", p)
    # (every batch here mixes adapters: one adapter alone runs torch on both sides, so it would test nothing)
    for slots in ([2, 0, 1, 3, 2, 1, 0], [4, 2, 2, 4, 1], [0, 3, 1]):
        x = torch.randn(len(slots), K, generator=g)
        y = torch.randn(len(slots), N, generator=g)
        step = StepLoRA.of(slots, torch.device("cpu"))
        got = with_kern.apply("o_proj", x, y.clone(), step)
        want = with_torch.apply("o_proj", x, y.clone(), step)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
        assert not torch.equal(got, y)
        base_rows = [i for i, s in enumerate(slots) if s == 0]
        assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows: untouched, to the bit


def test_tensor_parallel_ranks_serve_their_shard_of_each_adapter(setup):
    """Two ranks (a follower process, gloo): each holds its heads' and MLP columns' share of every adapter (B of q,
    k, v, gate, up by output rows; A of o, down by input columns, whose partial deltas are all-reduced with the base
    product's); base and both adapters mixed in one batch give PEFT's greedy answers."""
    ckpt, dirs, refs = setup
    eng = make_engine(ckpt, lora_modules=dirs, tensor_parallel_size=2, num_threads=1, max_num_batched_tokens=48)
    try:
        assert_greedy_is_peft(eng, refs, prompts_of([7, 19, 12, 26], seed=71), ["all", None, "qv", "all"], [12] * 4)
    finally:
        eng.close()


def test_an_adapter_loaded_at_run_time_serves_peft_answers(setup):
    """``add_lora`` on an engine started without adapters (vLLM's /v1/load_lora_adapter): from the next step the
    adapter answers as PEFT's model does, mixed with the base model and an adapter loaded after it; its root is the
    one an engine given it at start computes (same files, same root: workers agree)."""
    ckpt, dirs, refs = setup
    eng = make_engine(ckpt, max_num_batched_tokens=48)
    assert eng.lora_adapters() == {} and not eng.runner.serves_lora
    prompts = prompts_of([13, 22, 9], seed=81)
    assert_greedy_is_peft(eng, refs, prompts[:1], [None], [8])
    root = eng.add_lora("all", dirs["all"])
    assert eng.lora_adapters() == {"all": root} and eng.runner.serves_lora
    assert root == make_engine(ckpt, lora_modules={"all": dirs["all"]}).lora_adapters()["all"]
    eng.add_lora("qv", dirs["qv"])
    assert_greedy_is_peft(eng, refs, prompts, ["all", None, "qv"], [10, 10, 10])


def test_an_unloaded_adapter_finishes_its_requests_then_lets_go(setup):
    """``remove_lora``: a new request under the adapter is refused at once (ValueError naming lora_name), one
    already running finishes under it with PEFT's answer, and its weights leave every layer after its last
    request."""
    ckpt, dirs, refs = setup
    eng = make_engine(ckpt)
    eng.add_lora("all", dirs["all"])
    prompt = prompts_of([17], seed=91)[0]
    eng.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, lora_name="all"))
    got = []
    for _ in range(3):
        got += [t for o in eng.step() for t in o.new_token_ids]
    assert eng.remove_lora("all") == 1
    with pytest.raises(ValueError, match="lora_name"):
        eng.add_request("late", prompt, SamplingParams(max_tokens=2, lora_name="all"))
    with pytest.raises(ValueError, match="lora_name"):
        eng.remove_lora("all")
    assert eng.lora_adapters() == {}
    while eng.has_unfinished_requests():
        got += [t for o in eng.step() for t in o.new_token_ids]
    assert got == hf_greedy(refs["all"], prompt, 12)
    assert eng.lora.by_slot == {} and not eng.runner.serves_lora
    assert all(layer.lora is None or not layer.lora.by_linear for layer in eng.runner.model.layers)
    assert run_engine(eng, {"b": prompt}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))["b"] == \
        hf_greedy(refs[None], prompt, 6)


def test_a_name_reloaded_with_other_weights_reuses_none_of_its_old_kv(setup):
    """The same name loaded again from other files starts a prefix-cache chain of its own (the root hashes the
    files): no block computed under the old weights serves the new ones, whose answers are the new adapter's. The
    same files loaded again share the old blocks (equal weights, equal K/V)."""
    ckpt, dirs, refs = setup
    eng = make_engine(ckpt)
    prompt = prompts_of([33], seed=93)[0]

    def ask():
        before = eng.prefix_cache_hits
        out = run_engine(eng, {"p": prompt}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                            lora_name="x"))["p"]
        return out, eng.prefix_cache_hits - before

    first = eng.add_lora("x", dirs["all"])
    assert ask() == (hf_greedy(refs["all"], prompt, 8), 0)
    eng.remove_lora("x")
    assert eng.add_lora("x", dirs["qv"]) != first
    assert ask() == (hf_greedy(refs["qv"], prompt, 8), 0)
    eng.remove_lora("x")
    assert eng.add_lora("x", dirs["all"]) == first
    out, hits = ask()
    assert out == hf_greedy(refs["all"], prompt, 8) and hits == 32


def test_run_time_loads_refused_by_name_change_nothing(setup, tmp_path):
    ckpt, dirs, _ = setup
    eng = make_engine(ckpt, lora_modules={"all": dirs["all"]})
    before = eng.lora_adapters()
    for name, path, match in [("bad name", dirs["qv"], "lora_name"), ("all", dirs["qv"], "already loaded"),
                              ("new", str(tmp_path / "nowhere"), "adapter_config.json"), ("new", "", "lora_path")]:
        with pytest.raises(ValueError, match=match):
            eng.add_lora(name, path)
    with pytest.raises(ValueError, match="lora_name"):
        eng.remove_lora("qv")
    assert eng.lora_adapters() == before and sorted(eng.lora.by_slot) == [1]


def test_tensor_parallel_ranks_load_and_unload_at_run_time(setup):
    """A two-rank engine loads an adapter at run time on both ranks (each its shard, in rank 0's slot) and answers
    as PEFT; unloaded, both ranks let it go and the base model's answer is the base model's."""
    ckpt, dirs, refs = setup
    eng = make_engine(ckpt, tensor_parallel_size=2, num_threads=1, max_num_batched_tokens=48)
    try:
        eng.add_lora("qv", dirs["qv"])
        prompts = prompts_of([11, 20], seed=97)
        assert_greedy_is_peft(eng, refs, prompts, ["qv", None], [10, 10])
        assert eng.remove_lora("qv") == 0 and eng.lora.by_slot == {}
        assert_greedy_is_peft(eng, refs, prompts[:1], [None], [10])
        with pytest.raises(ValueError, match="adapter_config.json"):
            eng.add_lora("gone", dirs["qv"] + "-missing")
        eng.add_lora("all", dirs["all"])
        assert_greedy_is_peft(eng, refs, prompts[1:], ["all"], [10])
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["all", "qv"])
def test_beam_search_under_an_adapter_matches_peft(setup, name):
    """``LLM.beam_search(..., lora_name=)`` (vLLM's ``lora_request``): every beam scored under the adapter, the ranked
    sequences and scores PEFT's model's own ``generate(num_beams=W)`` gives; the base model's search differs."""
    from engine import LLM, BeamSearchParams
    from tests.engine.test_beam_search import hf_search

    ckpt, dirs, refs = setup
    llm = LLM(str(ckpt), num_kv_blocks=128, block_size=4, lora_modules=dirs)
    prompts = prompts_of([6, 11], seed=101)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outs = llm.beam_search(prompts, params, lora_name=name)
    for p, out in zip(prompts, outs):
        ref = hf_search(refs[name], p, 3, 1.0, False, None, 6)
        assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
        assert max(abs(s.score - r) for s, (_, r) in zip(out.sequences, ref)) < 1e-4
    base = llm.beam_search(prompts, params)
    assert [s.tokens for s in base[0].sequences] != [s.tokens for s in outs[0].sequences]
    with pytest.raises(ValueError, match="lora_name"):
        llm.beam_search(prompts, params, lora_name="nope")
    eng = llm.llm_engine
    assert eng.num_free_blocks == eng.num_total_blocks and not eng.has_unfinished_requests()


def test_stats_name_the_adapters_of_running_and_waiting_requests(setup):
    """``make_stats()`` carries what vLLM's ``lora_requests_info`` shows: the adapters of the running requests and
    of the waiting ones (one batch slot: the second request waits), and how many adapters the engine holds; an
    engine without adapters counts nothing."""
    ckpt, dirs, _ = setup
    eng = make_engine(ckpt, lora_modules=dirs, max_num_seqs=1)
    prompt = prompts_of([9], seed=5)[0]
    eng.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, lora_name="qv"))
    eng.add_request("b", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, lora_name="all"))
    eng.add_request("c", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng.step()
    s = eng.make_stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters, s.num_lora_adapters) == (("qv",), ("all",), 2)
    while eng.has_unfinished_requests():
        eng.step()
    s = eng.make_stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters, s.num_lora_adapters) == ((), (), 2)
    plain = make_engine(ckpt).make_stats()
    assert (plain.running_lora_adapters, plain.waiting_lora_adapters, plain.num_lora_adapters) == ((), (), 0)
