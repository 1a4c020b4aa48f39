"""Speculative decoding in a cluster: decode workers verify drafts, and nothing the client sees changes.

A 1 prefill + 1 decode cluster (real Ray actors, Redis, gRPC, gloo) whose decode worker speculates, once
with n-gram drafts (``engine_overrides={"speculative_config": {"method": "ngram", ...}}``, what ``pdserve up
--speculative-method ngram`` sets) and once with the trained ``tiny-draft`` model (``--speculative-model
tiny-draft``; the decode worker prefills the draft's own cache itself, the prefill worker loads no draft). The reference is the offline engine WITHOUT speculation: greedy and
seeded sampled completions through the cluster must be identical to it, while the decode worker's
``pdserve:spec_decode_*`` counters show that drafts were made and verified.
"""
from __future__ import annotations

import pytest
import torch

from cluster.launcher import Cluster, ClusterConfig
from engine.sampling_params import SamplingParams
from tests.e2e.helpers import generate, metric_value, mixed_prompts, offline, run_concurrently

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 3}
# prompts that repeat themselves, so the proposer finds n-grams to continue
PROMPTS = [p * 2 for p in mixed_prompts(6)] + ["a b a b a b a b a b a b", "x = 1\ny = 1\nx = 1\ny = 1\n"]


@pytest.fixture(scope="module", params=[NGRAM, DRAFT], ids=["ngram", "draft_model"])
def cluster(request, ray_local, redis_url):
    torch.set_num_threads(1)
    cfg = ClusterConfig(model="tiny", num_prefill=1, num_decode=1, redis_url=redis_url, start_timeout_s=600,
                        engine_overrides=dict(num_kv_blocks=512, speculative_config=request.param))
    c = Cluster(cfg).start()
    try:
        yield c
    finally:
        c.stop()


def test_greedy_and_seeded_output_through_a_speculating_cluster_equal_plain_offline(cluster):
    addr = cluster.router_address
    greedy = offline(PROMPTS, [SamplingParams(max_tokens=24, temperature=0.0)] * len(PROMPTS))
    got = run_concurrently(lambda p: generate(addr, prompt=p, max_tokens=24, temperature=0.0), [(p,) for p in PROMPTS])
    assert [g[:3] for g in got] == greedy
    seeds = list(range(len(PROMPTS)))
    sampled = offline(PROMPTS, [SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=s) for s in seeds])
    got = run_concurrently(lambda p, s: generate(addr, prompt=p, max_tokens=24, temperature=0.9, top_k=50, seed=s),
                           list(zip(PROMPTS, seeds)))
    assert [g[:3] for g in got] == sampled
    decode_metrics = cluster.metrics_addresses()["decode-0"]
    assert metric_value(decode_metrics, "pdserve:spec_decode_num_drafts_total") > 0
    assert metric_value(decode_metrics, "pdserve:spec_decode_num_draft_tokens_total") > 0
    assert metric_value(decode_metrics, "pdserve:spec_decode_num_accepted_tokens_total") > 0
