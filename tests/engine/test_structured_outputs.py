"""Structured outputs in the engine (engine/structured_outputs.py): constraints checked, masks applied
before sampling, matchers advanced, rolled back (speculation) and rebuilt (migration), on the real
``tiny`` model and its real tokenizer through llguidance.

The built-in model's weights are random, so whatever it writes under a constraint is the constraint's
doing: every output here is parsed/validated (``jsonschema``, ``re.fullmatch``), and speculative,
preempted and resumed runs are compared token for token with a plain constrained run.
"""
from __future__ import annotations

import json
import math
import re
from typing import Optional

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams, check_structured_outputs
from engine.speculative import NgramProposer
from engine.structured_outputs import GrammarCompiler, apply_bitmask

PROMPTS = ["Tell me about a person:", "import os\nimport sys\n", "{", "x = 1\ny = 1\nx = 1\ny = 1\n"]

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
NESTED = {"type": "object", "required": ["user", "ok"], "additionalProperties": False,
          "properties": {"user": {"type": "object", "required": ["id", "score"], "additionalProperties": False,
                                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                 "score": {"type": "number", "minimum": -1, "maximum": 1}}},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}}}
ARRAY = {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "integer", "minimum": -5, "maximum": 5}}
SCHEMAS = [PERSON, NESTED, ARRAY]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(1)


_LLMS: dict = {}


def llm(**kw) -> LLM:
    key = tuple(sorted((k, repr(v)) for k, v in kw.items()))
    if key not in _LLMS:
        _LLMS[key] = LLM("tiny", **{"num_kv_blocks": 256, **kw})
    return _LLMS[key]


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def run(engine_llm: LLM, prompts, params):
    return [(o.token_ids, o.text, o.finish_reason) for o in engine_llm.generate(prompts, params)]


# ---- parameters and the compile check ---------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({}, r"exactly one of structured_outputs\.json"),
    ({"json": {}, "regex": "a"}, r"structured_outputs\.regex: only one constraint"),
    ({"choice": ["a"], "json_object": True}, r"structured_outputs\.json_object: only one"),
    ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
    ({"json": "[1, 2]"}, r"structured_outputs\.json must be a JSON Schema object"),
    ({"regex": ""}, r"structured_outputs\.regex must not be empty"),
    ({"regex": 5}, r"structured_outputs\.regex must be a string"),
    ({"grammar": "x" * 70000}, r"structured_outputs\.grammar is 70000 characters"),
    ({"choice": []}, r"structured_outputs\.choice must not be empty"),
    ({"choice": "yes"}, r"structured_outputs\.choice must be a list"),
    ({"choice": ["a", 3]}, r"structured_outputs\.choice\[1\] must be a string"),
    ({"json_object": "yes"}, r"structured_outputs\.json_object must be a boolean"),
])
def test_params_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kw)


def test_sampling_params_take_a_dict_or_params_and_refuse_others():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == so(regex="a+")
    with pytest.raises(ValueError, match=r"structured_outputs\.pattern is not a known field"):
        SamplingParams(structured_outputs={"pattern": "a+"})
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")


@pytest.mark.parametrize("kw, match", [
    ({"json": {"type": "objekt"}}, r"structured_outputs\.json: .*objekt"),
    ({"json": {"type": "object", "if": {"required": ["a"]}}}, r"structured_outputs\.json: Unimplemented keys"),
    ({"json": {"type": "string", "minLength": 3, "maxLength": 2}}, r"structured_outputs\.json: Unsatisfiable"),
    ({"regex": "a(b"}, r"structured_outputs\.regex: .*unclosed group"),
    ({"grammar": "start: foo"}, r"structured_outputs\.grammar: .*unknown name"),
    ({"grammar": "start: ("}, r"structured_outputs\.grammar"),
    ({"regex": r"[^\x00-\x{10FFFF}]"}, r"structured_outputs\.regex: no token .* can start"),
])
def test_check_refuses_what_cannot_be_generated_naming_the_field(kw, match):
    tok = llm().get_tokenizer()
    with pytest.raises(ValueError, match=match):
        check_structured_outputs(so(**kw), tok)


def test_check_passes_good_constraints_and_builds_the_tokenizer_once():
    tok = llm().get_tokenizer()
    for kw in ({"json": PERSON}, {"json": json.dumps(NESTED)}, {"json_object": True}, {"regex": r"\d{3}"},
               {"choice": ["yes", "no"]}, {"grammar": 'start: "a" b\nb: "b"+'}, {"grammar": 'root ::= "x" | "y"'}):
        check_structured_outputs(so(**kw), tok)
    assert GrammarCompiler.for_tokenizer(tok) is GrammarCompiler.for_tokenizer(tok)
    check_structured_outputs(None, tok)


def test_pathological_regex_is_bounded_by_the_parser_limits():
    """llguidance's default lexer fuel let ``(a{1000}){1000}`` take 3-4 s and ~450 MB at its first mask;
    under pdserve's limits the check refuses it (in ~0.1 s), and a request that runs out of a
    limit mid-answer anyway (the offline engine does not run the check) ends with "abort" instead of going
    on unconstrained or stalling the engine. What bounds the check's time is the fuel, so that is what is
    checked (a stopwatch here would flake on a loaded machine): the refusal itself holds under the
    default fuel too, only 10-30 times slower."""
    tok = llm().get_tokenizer()
    limits = GrammarCompiler.for_tokenizer(tok).limits
    assert limits.initial_lexer_fuel <= 100_000 and limits.step_lexer_fuel <= 100_000, limits
    assert limits.step_max_items <= 20_000 and limits.max_lexer_states <= 50_000, limits
    check_structured_outputs(so(regex="(a|b)*a(a|b){40}"), tok)  # big but lazily lexed: fine
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: too complex for the parser's limits") as ei:
        check_structured_outputs(so(regex="(a{1000}){1000}"), tok)
    # ...and the matcher that refused it ran under those limits: theirs say verbose_errors=False (llguidance's
    # default limits, True, would print the parser's state here)
    assert "<non-verbose/>" in str(ei.value), ei.value
    person = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=so(json=PERSON))
    alone = run(llm(), PROMPTS[:1], person)
    out, other = llm().generate(["aaaa", PROMPTS[0]], [SamplingParams(
        max_tokens=50, temperature=0.0, structured_outputs=so(regex="(a{1000}){1000}")), person])
    assert out.finish_reason == "abort" and set(out.text) <= {"a"}
    assert [(other.token_ids, other.text, other.finish_reason)] == alone  # the batch goes on unaffected


# ---- the mask -----------------------------------------------------------------------------------------

def test_apply_bitmask_reads_bit_t_of_word_t_div_32():
    x = torch.zeros(3, 70)
    bm = torch.zeros(2, 3, dtype=torch.int32)
    bm[0, 0] = 1 - (1 << 31)      # tokens 0 and 31 (bit 31 is the sign bit of an int32)
    bm[1, 2] = 1 << 5             # token 69
    y = apply_bitmask(x, bm, [0, 2])
    assert torch.isfinite(y[0]).nonzero().flatten().tolist() == [0, 31]
    assert torch.isfinite(y[1]).all()  # an unlisted row is untouched
    assert torch.isfinite(y[2]).nonzero().flatten().tolist() == [69]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "nested", "array"])
def test_json_schema_outputs_validate_greedy_and_seeded(schema):
    c = so(json=schema)
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=c)] + [
        SamplingParams(max_tokens=120, temperature=1.0, top_p=0.95, seed=s, structured_outputs=c)
        for s in range(3)]
    for p in params:
        for toks, text, reason in run(llm(), PROMPTS[:2], p):
            assert reason == "stop", (text, reason)
            jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_json_object():
    cases = [
        (so(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (so(choice=["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
        (so(grammar='start: "(" expr ")"\nexpr: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t)),
        (so(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for c, ok in cases:
        for p in (SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=c),
                  SamplingParams(max_tokens=60, temperature=0.8, seed=7, structured_outputs=c)):
            for toks, text, reason in run(llm(), PROMPTS, p):
                if reason == "length":  # json_object may write a long string; what was written is a prefix
                    assert c.json_object, text
                    continue
                assert reason == "stop" and ok(text), (c, text, reason)


def test_a_complete_grammar_finishes_with_stop_and_no_eos():
    eos = llm().llm_engine.eos_token_id
    [(toks, text, reason)] = run(llm(), ["Q:"], SamplingParams(max_tokens=20, temperature=0.0,
                                                               structured_outputs=so(choice=["abc"])))
    assert (text, reason) == ("abc", "stop") and eos not in toks


def test_constrained_and_free_rows_in_one_batch_do_not_leak():
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = run(llm(), PROMPTS, free)
    mixed = llm().generate(PROMPTS * 2, [free] * 4 + [SamplingParams(max_tokens=24, temperature=0.0,
                                                                      structured_outputs=so(regex="[a-c]+"))] * 4)
    assert [(o.token_ids, o.text, o.finish_reason) for o in mixed[:4]] == alone
    assert all(re.fullmatch("[a-c]+", o.text) for o in mixed[4:])


def test_logprobs_see_the_constrained_distribution_and_logit_bias_composes():
    c = so(choice=["yes", "no"])
    [out] = llm().generate(["Answer:"], SamplingParams(max_tokens=10, temperature=0.0, logprobs=5,
                                                       structured_outputs=c))
    tok = llm().get_tokenizer()
    first_ids = {t for t in range(tok.vocab_size)
                 if (d := tok.decode([t])) and ("yes".startswith(d) or "no".startswith(d))}
    lp0 = out.logprobs[0]
    assert {t for t, _ in lp0.top} <= first_ids  # forbidden tokens are not alternatives
    assert math.isclose(sum(math.exp(v) for _, v in lp0.top), 1.0, rel_tol=1e-4)  # the mass is on allowed ones
    # +100 on a forbidden token cannot force it; +100 on the allowed answer the model liked less picks it
    other = "no" if out.text == "yes" else "yes"
    banned = tok.encode(" the", add_special_tokens=False)[0]
    [biased] = llm().generate(["Answer:"], SamplingParams(
        max_tokens=10, temperature=0.0, structured_outputs=c,
        logit_bias={banned: 100.0, tok.encode(other, add_special_tokens=False)[0]: 100.0}))
    assert biased.text == other


def test_grammars_are_compiled_once_per_constraint():
    eng = llm().llm_engine
    g = eng.grammar
    before = g.cache_misses
    c = so(regex="[xyz]{2,4}")
    llm().generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=c))
    llm().generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so(regex="[xyz]{2,4}")))
    assert g.cache_misses == before + 1 and g.mask_steps > 0


# ---- speculation, preemption, prefix cache, migration ------------------------------------------------

class Oracle(NgramProposer):
    """Drafts a reference continuation; ``junk_at``: that draft position gets a token the grammar forbids."""

    def __init__(self, refs: dict[tuple, list[int]], junk: int, junk_at: Optional[int]) -> None:
        self.refs, self.junk, self.junk_at = refs, junk, junk_at

    def propose(self, token_ids, k: int) -> list[int]:
        for prompt, out in self.refs.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                drafts = list(out[len(token_ids) - len(prompt):][:k])
                if self.junk_at is not None and len(drafts) > self.junk_at:
                    drafts[self.junk_at] = self.junk
                return drafts
        raise AssertionError("unknown prompt")


SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize("junk_at", [None, 0, 2], ids=["all-right", "first-forbidden", "third-forbidden"])
def test_speculative_drafts_the_grammar_forbids_are_rejected_and_output_is_unchanged(junk_at):
    c = so(json=PERSON)
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=c),
              SamplingParams(max_tokens=80, temperature=0.9, seed=3, logprobs=2, structured_outputs=c)]
    for p in params:
        plain = llm().generate(PROMPTS, p)
        spec = LLM("tiny", num_kv_blocks=256, speculative_config=SPEC)
        tok = spec.get_tokenizer()
        refs = {tuple(tok.encode(pr)): o.token_ids for pr, o in zip(PROMPTS, plain)}
        spec.llm_engine._proposer = Oracle(refs, tok.encode("\n", add_special_tokens=False)[0], junk_at)
        got = spec.generate(PROMPTS, p)
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in plain]
        for o in got:
            jsonschema.validate(json.loads(o.text), PERSON)
        st = spec.llm_engine.spec_stats
        if junk_at == 0:  # every draft sequence starts with a forbidden token: cut before verification
            assert st.num_draft_tokens == 0
        else:
            assert st.num_accepted_tokens > 0
        assert spec.llm_engine.num_free_blocks == spec.llm_engine.num_total_blocks


def test_real_ngram_speculation_is_greedy_identical_and_valid():
    c = so(json=PERSON)
    p = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=c)
    prompts = PROMPTS + ['{"name":"ab","age":1,"tags":["a","b"]}\n{"name":"ab","age":1,"tags":["a","b"]}\n']
    spec = llm(speculative_config=SPEC)
    got = run(spec, prompts, p)
    assert got == run(llm(), prompts, p)
    assert spec.llm_engine.spec_stats.num_drafts > 0


def test_preemption_and_prefix_cache_hits_keep_the_matcher_right():
    prompts = PROMPTS * 2
    c = so(json=NESTED)
    p = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=c)
    small = llm(num_kv_blocks=12, max_num_batched_tokens=32, enable_prefix_caching=True)
    got = run(small, prompts, p)
    assert got == run(llm(), prompts, p)
    assert small.llm_engine.num_preemptions > 0 and small.llm_engine.prefix_cache_hits > 0
    for _, text, _ in got:
        jsonschema.validate(json.loads(text), NESTED)


def test_migration_resumes_mid_answer_and_rebuilds_the_matcher():
    """A request resumed elsewhere with the tokens it already produced (resume_token_ids) continues the
    same JSON answer: the new engine's matcher is rebuilt from the constraint plus those tokens."""
    c = so(json=PERSON)
    p = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=c)
    [ref] = llm().generate([PROMPTS[0]], p)
    eng = LLM("tiny", num_kv_blocks=256).llm_engine
    prompt = eng.tokenizer.encode(PROMPTS[0])
    half = ref.token_ids[:len(ref.token_ids) // 2]
    eng.add_request("r", prompt, p, resume_token_ids=half)
    rest = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            rest += o.new_token_ids
    assert half + rest == ref.token_ids
    jsonschema.validate(json.loads(ref.text), PERSON)
    # tokens the constraint never allows are refused at admission, naming the constraint
    with pytest.raises(ValueError, match="resume_token_ids do not follow"):
        eng.add_request("bad", prompt, p, resume_token_ids=eng.tokenizer.encode("hello", add_special_tokens=False))
    assert not eng.has_unfinished_requests()


def test_masks_computed_on_the_mask_thread_give_the_same_tokens():
    """The CPU engine computes masks inline (its kernels hold the GIL through the forward); CUDA's default is
    the mask thread during the forward. Both must give the same tokens, drafts included."""
    c = so(json=PERSON)
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=c)
    prompts = PROMPTS + ['{"name":"ab","age":1,"tags":["a","b"]}\n{"name":"ab","age":1,"tags":["a","b"]}\n']
    inline = run(llm(), prompts, params)
    spec = LLM("tiny", num_kv_blocks=256, speculative_config=SPEC)
    assert spec.llm_engine.grammar.overlap_masks is False  # CPU default
    spec.llm_engine.grammar.overlap_masks = True
    assert run(spec, prompts, params) == inline
    g = spec.llm_engine.grammar
    assert g.mask_steps > 0 and g.mask_compute_s > 0 and spec.llm_engine.spec_stats.num_drafts > 0


def test_sampler_keeps_the_grammar_over_min_tokens_when_only_eos_is_left():
    """A row whose mask allows only EOS (a matcher out of its limits) while min_tokens bans EOS: the sampler
    picks EOS rather than drawing from an all -inf row."""
    import numpy as np
    from types import SimpleNamespace

    from engine.sampler import Sampler, SamplingRequest

    V, eos = 64, 1
    bm = np.zeros((2, 2), dtype=np.int32)
    bm[:, 0] = 1 << eos
    masks = SimpleNamespace(rows=[0, 1], bitmask=bm)
    reqs = [SamplingRequest(SamplingParams(temperature=t, min_tokens=5, seed=1), [5, 6], [], eos_token_id=eos)
            for t in (0.0, 1.0)]
    logits = torch.randn(2, V)
    logits[:, eos] = -50.0
    tokens, _ = Sampler(V).sample(logits, reqs, masks)
    assert tokens == [eos, eos]


def test_a_refused_constraint_is_not_kept_in_the_cache():
    comp = GrammarCompiler(llm().get_tokenizer(), 8192)
    with pytest.raises(ValueError, match="too complex"):
        comp.check(so(regex="(a{1000}){1000}"))
    comp.check(so(regex="[ab]+"))
    assert [k for k, _ in comp._cache] == ["regex"] and comp.cache_misses == 2
