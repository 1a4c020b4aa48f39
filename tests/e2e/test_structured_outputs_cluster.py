"""Structured outputs through a real cluster: the constraint crosses the prefill/decode split.

One cluster (real Ray actors, Redis, gRPC, gloo KV transfer): 1 prefill + 2 decode workers whose engines
speculate with n-grams, and conditional disaggregation on (prompts of at most 4 tokens run whole on a
decode worker, the colocated path; longer ones prefill on the prefill worker, which samples the first
token under the constraint, and decode on a decode worker, which rebuilds the matcher from the
constraint and that token). The reference is the offline engine WITHOUT speculation: greedy and seeded
constrained outputs must be token-for-token identical to it, and every output must validate. Bad
constraints get INVALID_ARGUMENT naming the field from the router's check. A
migration is played twice: at the worker level (a decode worker asked to resume a JSON answer from its
first half, ``resume_token_ids``) and for real (the decode worker streaming a long JSON answer is SIGKILLed;
the router migrates the request to the other one, which rebuilds the matcher from the tokens already
streamed); both must finish the answer exactly as the uninterrupted offline run did. The kill is the last
test of the module.
"""
from __future__ import annotations

import json
import os
import re
import signal

import grpc
import jsonschema
import pytest
import ray
import torch

from cluster.launcher import Cluster, ClusterConfig
from engine import SamplingParams, StructuredOutputsParams
from proto import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.wire import params_to_wire
from tests.e2e.helpers import metric_value, offline, run_concurrently
from tests.waiting import wait_until

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
NESTED = {"type": "object", "required": ["user", "ok"], "additionalProperties": False,
          "properties": {"user": {"type": "object", "required": ["id", "score"], "additionalProperties": False,
                                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                 "score": {"type": "number", "minimum": -1, "maximum": 1}}},
                         "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}}}
# "{" and "Q:" run whole on the decode worker (<= 4 tokens); the others go through the split
PROMPTS = ["{", "Q:", "Tell me about a person:",
           '{"name":"ab","age":1,"tags":["a","b"]}\n{"name":"ab","age":1,"tags":["a","b"]}\n']
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def cluster(ray_local, redis_url):
    torch.set_num_threads(1)
    cfg = ClusterConfig(model="tiny", num_prefill=1, num_decode=2, redis_url=redis_url, start_timeout_s=600,
                        engine_overrides=dict(num_kv_blocks=512, speculative_config=NGRAM),
                        router_overrides=dict(local_prefill_max_tokens=4))
    c = Cluster(cfg).start()
    try:
        yield c
    finally:
        c.stop()


def _proto(so: StructuredOutputsParams) -> pdserve_pb2.StructuredOutputs:
    if so.json is not None:
        return pdserve_pb2.StructuredOutputs(json=json.dumps(so.json))
    if so.choice is not None:
        return pdserve_pb2.StructuredOutputs(choice=pdserve_pb2.StructuredOutputs.Choices(choice=so.choice))
    return pdserve_pb2.StructuredOutputs(regex=so.regex)


def _stream(addr: str, **fields) -> dict[int, tuple[list[int], str, str]]:
    """One Generate: index -> (token ids, text, finish reason)."""
    out: dict[int, tuple[list[int], str, str]] = {}
    with grpc.insecure_channel(addr) as ch:
        for r in pdserve_pb2_grpc.PDServeStub(ch).Generate(pdserve_pb2.GenerateRequest(**fields), timeout=120):
            toks, text, reason = out.get(r.index, ([], "", ""))
            out[r.index] = (toks + list(r.token_ids), text + r.text, r.finish_reason or reason)
    return out


def _valid(so: StructuredOutputsParams, text: str) -> None:
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
    elif so.choice is not None:
        assert text in so.choice
    else:
        assert re.fullmatch(so.regex, text), text


CONSTRAINTS = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=NESTED),
               StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES)]


def test_constrained_output_through_the_split_equals_the_offline_engine(cluster):
    addr = cluster.router_address
    calls, refs = [], []
    for so in CONSTRAINTS:
        for p in PROMPTS:
            for seed in (None, 5):
                kw = dict(max_tokens=100, temperature=0.0 if seed is None else 0.9,
                          **({} if seed is None else {"seed": seed, "top_k": 50}))
                calls.append((p, so, kw))
                refs.append(offline([p], [SamplingParams(structured_outputs=so, **kw)])[0])
    got = run_concurrently(lambda p, so, kw: _stream(addr, prompt=p, structured_outputs=_proto(so), **kw)[0],
                           calls)
    assert [tuple(g) for g in got] == [tuple(r) for r in refs]
    for (p, so, kw), (toks, text, reason) in zip(calls, got):
        assert reason == "stop", (p, so, text)
        _valid(so, text)
    metrics = cluster.metrics_addresses()
    drafts = sum(metric_value(metrics[w], "pdserve:spec_decode_num_drafts_total") for w in cluster.worker_ids("decode"))
    assert drafts > 0  # speculation ran on constrained rows


def test_n_choices_each_follow_their_own_matcher(cluster):
    so = StructuredOutputsParams(json=PERSON)
    for prompt in (PROMPTS[0], PROMPTS[2]):  # local and split
        out = _stream(cluster.router_address, prompt=prompt, n=3, seed=11, temperature=1.0, max_tokens=100,
                      structured_outputs=_proto(so))
        assert sorted(out) == [0, 1, 2]
        refs = offline([prompt] * 3, [SamplingParams(max_tokens=100, temperature=1.0, seed=11 + i,
                                                     structured_outputs=so) for i in range(3)])
        assert [tuple(out[i]) for i in range(3)] == [tuple(r) for r in refs]
        for toks, text, reason in out.values():
            jsonschema.validate(json.loads(text), PERSON)


def _worker_address(cluster, role: str) -> str:
    return [w for w in cluster.registry.list() if w.role == role][0].grpc_address


def test_a_migrated_json_answer_resumes_on_another_worker_and_stays_valid(cluster):
    so = StructuredOutputsParams(json=NESTED)
    params = SamplingParams(max_tokens=100, temperature=0.0, structured_outputs=so)
    prompt = PROMPTS[2]
    [(ref_toks, ref_text, _)] = offline([prompt], [params])
    from engine import Tokenizer

    ids = Tokenizer.builtin().encode(prompt)
    half = ref_toks[:len(ref_toks) // 2]
    req = worker_pb2.ColocatedRequest(request_id="migrated-1", prompt_token_ids=ids, params=params_to_wire(params),
                                      resume_token_ids=half)
    with grpc.insecure_channel(_worker_address(cluster, "decode")) as ch:
        md = (("authorization", f"Bearer {cluster.config.cluster_secret}"),)  # the cluster plane's secret
        chunks = list(worker_pb2_grpc.ColocatedWorkerStub(ch).Generate(req, timeout=60, metadata=md))
    rest = [t for c in chunks for t in c.token_ids]
    assert half + rest == ref_toks and chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(ref_text), NESTED)


@pytest.mark.parametrize("so, extra, field", [
    (pdserve_pb2.StructuredOutputs(json='{"type": "objekt"}'), {}, "structured_outputs.json"),
    (pdserve_pb2.StructuredOutputs(json='{"type": "object", "if": {}}'), {}, "structured_outputs.json"),
    (pdserve_pb2.StructuredOutputs(json='{"type": '), {}, "structured_outputs.json"),
    (pdserve_pb2.StructuredOutputs(regex="a(b"), {}, "structured_outputs.regex"),
    (pdserve_pb2.StructuredOutputs(grammar="start: foo"), {}, "structured_outputs.grammar"),
    (pdserve_pb2.StructuredOutputs(choice=pdserve_pb2.StructuredOutputs.Choices()), {}, "structured_outputs.choice"),
    (pdserve_pb2.StructuredOutputs(), {}, "structured_outputs"),
    (pdserve_pb2.StructuredOutputs(json_object=False), {}, "structured_outputs.json_object"),
    (pdserve_pb2.StructuredOutputs(regex=r"[^\x00-\x{10FFFF}]"), {}, "structured_outputs.regex"),
    (pdserve_pb2.StructuredOutputs(regex="[a-z]+"), {"beam_width": 2}, "structured_outputs"),
], ids=["bad-type", "unsupported-if", "not-json", "bad-regex", "bad-grammar", "empty-choice", "none-set",
        "json-object-false", "unsatisfiable", "with-beams"])
def test_bad_constraints_are_invalid_argument_naming_the_field(cluster, so, extra, field):
    """The router's check answers (tests/router/test_structured_outputs_validation.py shows it is the router's)."""
    with pytest.raises(grpc.RpcError) as ei:
        _stream(cluster.router_address, prompt="Tell me about a person:", max_tokens=8, structured_outputs=so,
                **extra)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in ei.value.details()


# ~100 objects of ~10 tokens: a stream long enough to lose its decode worker in the middle of
LONG = {"type": "array", "minItems": 100, "maxItems": 100,
        "items": {"type": "object", "required": ["id", "kind"], "additionalProperties": False,
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                 "kind": {"enum": ["file", "dir"]}}}}


def test_zz_decode_worker_lost_mid_json_answer_migrates_and_the_answer_stays_valid(cluster):
    """Last in the module: it kills a decode worker."""
    so = StructuredOutputsParams(json=LONG)
    prompt = PROMPTS[2]  # through the split
    [(ref_toks, ref_text, ref_reason)] = offline([prompt], [SamplingParams(max_tokens=1500, temperature=0.0,
                                                                             structured_outputs=so)])
    assert ref_reason == "stop" and len(ref_toks) > 500
    router_metrics = cluster.metrics_addresses()["router"]
    migrations = metric_value(router_metrics, "pdserve:request_migrations_total")
    metrics = cluster.metrics_addresses()
    decode = dict(cluster.members("decode"))
    with grpc.insecure_channel(cluster.router_address) as ch:
        stream = pdserve_pb2_grpc.PDServeStub(ch).Generate(pdserve_pb2.GenerateRequest(
            prompt=prompt, max_tokens=1500, temperature=0.0, structured_outputs=_proto(so)), timeout=120)
        got = list(next(stream).token_ids)
        victim = wait_until(lambda: next((w for w in decode if metric_value(
            metrics[w], "pdserve:num_requests_running") >= 1), None), timeout=30, interval=0.02,
            message="no decode worker reports the request running")
        os.kill(ray.get(decode[victim].pid.remote(), timeout=30), signal.SIGKILL)
        reason = ""
        for r in stream:
            got += list(r.token_ids)
            reason = r.finish_reason or reason
    assert metric_value(router_metrics, "pdserve:request_migrations_total") == migrations + 1
    assert len(got) == len(ref_toks) and got == ref_toks and reason == "stop"
    jsonschema.validate(json.loads(ref_text), LONG)
