"""The sampler on a GPU: the step's one trip to the host waits on a blocking CUDA event (the engine thread sleeps
instead of spinning a core for the whole GPU step), and gives the tokens and logprobs the CPU sampler gives for
the same logits, greedy and seeded draws, with the wait and with torch's spinning one (``PDSERVE_CUDA_SPIN=1``).
Skipped without a GPU; benchmarks/device_session.sh's engine phase runs it."""
from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingRequest
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device_session.sh)")


@pytest.mark.parametrize("spin", ["0", "1"])
def test_cuda_sampler_waits_on_an_event_and_matches_the_cpu_sampler(spin, monkeypatch):
    monkeypatch.setenv("PDSERVE_CUDA_SPIN", spin)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=g) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, logprobs=2),
              SamplingParams(temperature=1.0, top_k=20, seed=8), SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.7, min_p=0.05, seed=9, logprobs=1)]
    reqs = [SamplingRequest(p, [1, 2, 3], [4, 5]) for p in params]
    want_tokens, want_lps = Sampler(1000).sample(logits, reqs)
    cuda = Sampler(1000)
    tokens, lps = cuda.sample(logits.cuda(), reqs)
    assert tokens == want_tokens
    for a, b in zip(lps, want_lps, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert (torch.device("cuda", torch.cuda.current_device()) in cuda._events) == (spin == "0")


def test_a_launch_never_synchronises_the_host(monkeypatch):
    """Every sampler feature but a grammar mask (which async scheduling never runs ahead) enqueues its work
    without a host synchronisation (torch's sync debug mode raises on one), so an async engine's next step is
    launched while this one runs; the result is the CPU sampler's."""
    monkeypatch.setenv("PDSERVE_CUDA_SPIN", "0")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 1000, generator=g) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, logprobs=2, frequency_penalty=0.4),
              SamplingParams(temperature=1.0, top_k=20, seed=8, presence_penalty=0.3),
              SamplingParams(temperature=0.0, min_tokens=5, logit_bias={3: 4.0, 9: -2.0}),
              SamplingParams(temperature=0.7, min_p=0.05, seed=9, logprobs=1),
              SamplingParams(temperature=0.9, typical_p=0.8, seed=10),
              SamplingParams(temperature=1.2, top_p=0.999, seed=11),  # past the CPU's 256 candidates
              SamplingParams(temperature=0.6, seed=12, logprobs=0),
              SamplingParams(temperature=0.0, allowed_token_ids=[7, 70, 700], bad_words_token_ids=[[5, 70]]),
              SamplingParams(temperature=0.8, seed=13, bad_words_token_ids=[[4], [9, 10]])]
    reqs = [SamplingRequest(p, [1, 2, 3], [4, 5], eos_token_id=2) for p in params]
    want = Sampler(1000).sample(logits, reqs)
    cuda = Sampler(1000)
    dev = logits.cuda()
    cuda.launch(dev, reqs).result()  # warm-up: kernels, the pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = cuda.launch(dev, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, lps = handle.result()
    assert tokens == want[0] and handle.tokens.device.type == "cuda"
    for a, b in zip(lps, want[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
