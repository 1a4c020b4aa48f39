"""KV that stays where it is used (issue 47): a conversation's turns return to the decode worker that holds its
history, and each transfer ships only the new turn.

One prefill and two decode workers (real engines on ``tiny``, real gRPC, KV over gloo) publish KV events to a real
Redis and heartbeat into the real registry; a ``RouterServer`` reads both; requests go through its public gRPC API.
Expected bytes are computed from first principles: the decode worker that streamed turn k-1 computed or received the
KV of turn k-1's prompt and of every answer token but the last (which never ran through the model there), and keeps
the full blocks of it in its prefix cache; turn k ships every other position, at the bytes per token that a whole
first turn costs. Greedy output equals the offline engine's on every turn.
"""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import prefix_block_hashes
from engine.sampling_params import SamplingParams
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.helpers import registry_deployment
from tests.roles.harness import counter_values, engine_config, offline
from tests.waiting import wait_until

BS = 16
MAX_TOKENS = 8


@pytest.fixture
def cluster(redis_url, request):
    def start(common: dict) -> list:
        return [PrefillWorker(PrefillWorkerConfig("p0", engine=engine_config(), **common)).start(),
                *(DecodeWorker(DecodeWorkerConfig(f"d{i}", engine=engine_config(), **common)).start()
                  for i in range(2))]

    with registry_deployment(redis_url, "test-dhist", start, getattr(request, "param", {})) as deployment:
        yield deployment


def _sends(w) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(w.metrics.render().decode())
               if fam.name == "pdserve:kv_transfer_time_seconds" for s in fam.samples if s.name.endswith("_count"))


class Turns:
    """Runs a conversation's turns through the router and records, per turn, the KV bytes the prefill worker sent
    and which decode worker finished it."""

    def __init__(self, router, workers):
        self.router, self.p = router, workers[0]
        self.decodes = {w.cfg.worker_id: w for w in workers[1:]}
        self.done = 0

    def run(self, stub, prompt: list[int]) -> tuple[list[int], float, str]:
        before_bytes = counter_values(self.p.metrics, "pdserve:kv_transfer_bytes").get("", 0.0)
        before = {k: w.info().requests_finished_total for k, w in self.decodes.items()}
        resps = list(stub.Generate(pdserve_pb2.GenerateRequest(token_ids=prompt, max_tokens=MAX_TOKENS,
                                                               temperature=0.0), timeout=60))
        self.done += 1
        # a prefill worker records a send when its loop next polls it, which may come after the last token
        wait_until(lambda: _sends(self.p) == self.done, timeout=10, interval=0.01, message="the KV send recorded")
        sent = counter_values(self.p.metrics, "pdserve:kv_transfer_bytes").get("", 0.0) - before_bytes
        ran = [k for k, w in self.decodes.items() if w.info().requests_finished_total > before[k]]
        assert len(ran) == 1, ran
        return [t for r in resps for t in r.token_ids], sent, ran[0]

    def wait_held(self, worker_id: str, prompt: list[int], blocks: int) -> None:
        """Until the router's index shows ``worker_id`` holding the first ``blocks`` blocks of ``prompt``."""
        hashes = prefix_block_hashes(prompt, BS)
        index = self.router.core.kv_index
        wait_until(lambda: index.match([worker_id], hashes)[worker_id] >= blocks, timeout=10,
                   message=lambda: f"{worker_id} holds {blocks} blocks (index: {index.match([worker_id], hashes)})")


def _question(k: int, n: int = 12) -> list[int]:
    return [(k * 37 + j * 11) % 700 + 40 for j in range(n)]


def test_a_conversation_returns_to_its_decode_worker_and_ships_only_the_new_turn(cluster):
    router, workers = cluster
    turns = Turns(router, workers)
    prompt = [(i * 13) % 800 + 30 for i in range(5 * BS)] + _question(0)  # a system prompt and a first question
    prompts, outs, sent, ran, cached = [], [], [], [], []
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        for k in range(4):
            if k:
                # the decode worker of the last turn holds its prompt and its answer but the last token
                held = (len(prompts[-1]) + len(outs[-1]) - 1) // BS
                prompt = prompts[-1] + outs[-1] + _question(k)
                cached.append(min(held, (len(prompt) - 1) // BS) * BS)
                turns.wait_held(ran[-1], prompt, held)
            else:
                cached.append(0)
            out, nbytes, worker = turns.run(stub, prompt)
            prompts.append(prompt)
            outs.append(out)
            sent.append(nbytes)
            ran.append(worker)
    per_token = sent[0] / len(prompts[0])
    assert per_token == 4 * 2 * 2 * 64 * 4  # tiny: 4 layers x (K, V) x 2 KV heads x 64 dims x float32
    assert ran == [ran[0]] * 4, ran  # every turn back on the worker that holds the history
    assert [s / per_token for s in sent] == [len(p) - c for p, c in zip(prompts, cached)]
    assert sum(sent[1:]) < 0.5 * per_token * sum(len(p) for p in prompts[1:])  # issue 47's goal, for this chat
    holder = next(w for w in workers[1:] if w.cfg.worker_id == ran[0])
    assert counter_values(holder.metrics, "pdserve:kv_transfer_cached_tokens") == {"": float(sum(cached))}
    decisions = counter_values(router.core.metrics, "pdserve:decode_routing_decisions", "reason")
    assert decisions == {"load": 1.0, "history": 3.0}
    ref = offline(prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * len(prompts))
    assert outs == [r[0] for r in ref]


def test_a_decode_worker_that_lost_the_history_gets_the_whole_prompt_and_the_router_counts_it(cluster):
    """The router's index still names the history on the decode worker (its cache was emptied without an event, as
    a restart whose stream the router has not caught up with looks): the reservation finds nothing cached, the whole
    prompt is shipped, the answer is right, and the router counts the stale belief."""
    router, workers = cluster
    turns = Turns(router, workers)
    first = [(i * 17) % 800 + 30 for i in range(4 * BS)] + _question(9)
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        out1, sent1, holder_id = turns.run(stub, first)
        second = first + out1 + _question(10)
        held = (len(first) + len(out1) - 1) // BS
        turns.wait_held(holder_id, second, held)
        holder = turns.decodes[holder_id]

        def forget_silently(eng) -> None:
            bm = eng.block_manager
            events, bm._events = bm._events, None  # no CLEARED event: the router keeps believing
            try:
                assert bm.reset_prefix_cache()
            finally:
                bm._events = events

        holder.loop.call(forget_silently)
        out2, sent2, ran2 = turns.run(stub, second)
    assert ran2 == holder_id  # the router still believed it
    assert sent2 == sent1 / len(first) * len(second)  # the whole prompt
    assert counter_values(router.core.metrics, "pdserve:decode_prefix_stale") == {"": 1.0}
    assert counter_values(holder.metrics, "pdserve:kv_transfer_cached_tokens") in ({}, {"": 0.0})
    ref = offline([first, second], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 2)
    assert [out1, out2] == [r[0] for r in ref]


@pytest.mark.parametrize("cluster", [{"local_prefill_max_tokens": BS}], indirect=True)
def test_a_short_next_turn_whose_history_the_decode_worker_holds_is_prefilled_there(cluster):
    """Conditional disaggregation weighs what a local prefill would compute: the second turn's prompt is far longer
    than ``local_prefill_max_tokens``, but the decode worker holding the first turn lacks only its last block, so it
    prefills the rest itself (no prefill request, no KV byte moved); a long new turn still goes through the pool."""
    router, workers = cluster
    turns = Turns(router, workers)
    first = [(i * 19) % 800 + 30 for i in range(4 * BS)] + _question(20, 9)  # 73 tokens: above the threshold
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        out1, sent1, holder_id = turns.run(stub, first)
        assert sent1 == len(first) * 4 * 2 * 2 * 64 * 4
        # 85 tokens; the holder computed the KV of the first 80 (the first turn's answer but its last token): 5 full
        # blocks, so only 5 tokens are left to compute
        second = first + out1 + _question(21, 4)
        turns.wait_held(holder_id, second, (len(first) + len(out1) - 1) // BS)
        holder = turns.decodes[holder_id]
        p_requests = workers[0].info().requests_total
        local_before = holder.info().requests_total
        resps = list(stub.Generate(pdserve_pb2.GenerateRequest(token_ids=second, max_tokens=MAX_TOKENS,
                                                               temperature=0.0), timeout=60))
        out2 = [t for r in resps for t in r.token_ids]
        assert workers[0].info().requests_total == p_requests  # the prefill pool never saw it
        assert holder.info().requests_total == local_before + 1
        assert resps[-1].usage.cached_tokens == 5 * BS  # the history came from the holder's cache
        third = second + out2 + _question(22, 3 * BS)  # a long new question: through the prefill pool again
        out3, sent3, _ran = turns.run(stub, third)
        assert workers[0].info().requests_total == p_requests + 1
        assert 0 < sent3 < len(third) * 4 * 2 * 2 * 64 * 4
    assert counter_values(router.core.metrics, "pdserve:local_prefill_requests") == {"": 1.0}
    ref = offline([first, second, third], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 3)
    assert [out1, out2, out3] == [r[0] for r in ref]


def _forget_prefill_history(p) -> None:
    """The prefill worker loses its prefix cache (as a restarted one has none): it publishes the loss."""
    def forget(eng) -> None:
        assert eng.block_manager.reset_prefix_cache()

    wait_until(lambda: p.info().num_free_blocks == p.engine.block_manager.num_blocks, timeout=10,
               message="the prefill worker holds no block")
    p.loop.call(forget)


def _first_turn(turns: Turns, stub, seed: int) -> tuple[list[int], list[int], list[int], float, Any]:
    """Turn 1 (73 tokens) of a conversation, then turn 2 (93 tokens) once the router's index shows the decode worker
    that streamed turn 1 holding its first 80 (5 blocks): (turn 1, its answer, turn 2, the KV bytes turn 1 shipped,
    that decode worker)."""
    first = [(i * seed) % 800 + 30 for i in range(4 * BS)] + _question(seed, 9)
    out1, sent1, holder_id = turns.run(stub, first)
    second = first + out1 + _question(seed + 1)
    turns.wait_held(holder_id, second, (len(first) + len(out1) - 1) // BS)
    return first, out1, second, sent1, turns.decodes[holder_id]


@pytest.mark.parametrize("cluster", [{"kv_prefix_fetch_min_tokens": BS}], indirect=True)
def test_a_prefill_worker_that_lacks_the_history_fetches_it_from_the_decode_worker_and_computes_only_the_rest(
        cluster):
    """Issue 47: the decode worker holds more of the prompt than the prefill worker, so the prefill worker receives
    those blocks from it (decode -> prefill) and computes only what neither has; the KV it then ships is the new turn
    alone, every byte between workers is counted where it was sent, the answer equals the offline engine's, and the
    fetched blocks stay in the prefill worker's cache (its KV events name them)."""
    router, workers = cluster
    turns = Turns(router, workers)
    p = workers[0]
    per_token = 4 * 2 * 2 * 64 * 4
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        first, out1, second, sent1, holder = _first_turn(turns, stub, 23)
        held = (len(first) + len(out1) - 1) // BS * BS
        _forget_prefill_history(p)
        holder_sent = counter_values(holder.metrics, "pdserve:kv_transfer_bytes").get("", 0.0)
        hits = counter_values(p.metrics, "pdserve:prefix_cache_hits").get("", 0.0)
        resps = list(stub.Generate(pdserve_pb2.GenerateRequest(token_ids=second, max_tokens=MAX_TOKENS,
                                                               temperature=0.0), timeout=60))
        out2 = [t for r in resps for t in r.token_ids]
        turns.done += 1
        wait_until(lambda: _sends(p) == turns.done, timeout=10, interval=0.01, message="the KV send recorded")
        assert resps[-1].usage.cached_tokens == held  # the prefill worker computed only the last 13 tokens
        assert counter_values(p.metrics, "pdserve:prefix_cache_hits").get("", 0.0) - hits == held
        assert counter_values(p.metrics, "pdserve:kv_prefix_fetches", "outcome") == {"done": 1.0}
        assert counter_values(p.metrics, "pdserve:kv_prefix_fetch_tokens") == {"": float(held)}
        wait_until(lambda: counter_values(holder.metrics, "pdserve:kv_transfer_bytes").get("", 0.0) - holder_sent
                   == held * per_token, timeout=10, message="the decode worker counted the prefix it sent back")
        sent2 = counter_values(p.metrics, "pdserve:kv_transfer_bytes")[""] - sent1
        assert sent2 == (len(second) - held) * per_token  # then only the new turn went to the holder
        turns.wait_held(p.cfg.worker_id, second, held // BS)  # the fetched history is the prefill worker's now
    ref = offline([first, second], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 2)
    assert [out1, out2] == [r[0] for r in ref]


@pytest.mark.parametrize("cluster", [{"kv_prefix_fetch_min_tokens": BS}], indirect=True)
def test_a_prefix_fetch_that_fails_is_computed_instead_and_the_answer_is_unchanged(cluster):
    """The decode worker's send of the history does not fit what the prefill worker posted (here: it sends from a
    different first position, as a worker that disagrees on the cut would): the prefill worker's receive is refused,
    it computes the history itself, counts the fallback, and the answer equals the offline engine's."""
    router, workers = cluster
    turns = Turns(router, workers)
    p = workers[0]
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        first, out1, second, _sent1, holder = _first_turn(turns, stub, 29)
        inner = holder.disagg.send_prefix

        def misplaced(eng, rid, dest, first_token, num, dest_tp, timeout_s):
            return inner(eng, rid, dest, first_token + BS, num, dest_tp, timeout_s)

        holder.disagg.send_prefix = misplaced
        _forget_prefill_history(p)
        resps = list(stub.Generate(pdserve_pb2.GenerateRequest(token_ids=second, max_tokens=MAX_TOKENS,
                                                               temperature=0.0), timeout=60))
        out2 = [t for r in resps for t in r.token_ids]
        assert resps[-1].usage.cached_tokens == 0  # computed whole on the prefill worker
        wait_until(lambda: counter_values(p.metrics, "pdserve:kv_prefix_fetches", "outcome") == {"fallback": 1.0},
                   timeout=10, message="the fallback counted")
        wait_until(lambda: p.info().num_free_blocks == p.engine.block_manager.num_blocks, timeout=10,
                   message="the prefill worker holds no block")
    ref = offline([first, second], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 2)
    assert [out1, out2] == [r[0] for r in ref]


@pytest.mark.parametrize("cluster", [{"kv_prefix_fetch_min_tokens": BS}], indirect=True)
def test_a_prefill_worker_that_computes_faster_than_it_receives_skips_the_fetch(cluster):
    """The prefill worker's measurements say receiving the history (5 ms a token on the wire, as its last fetch
    went) is slower than computing it (1 us a token): it computes the history itself, counts the skip, nothing moves
    decode -> prefill, and the answer equals the offline engine's."""
    router, workers = cluster
    turns = Turns(router, workers)
    p = workers[0]
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        first, out1, second, _sent1, holder = _first_turn(turns, stub, 31)

        def slow_link(_eng) -> None:
            cost = p.prefills.fetch_cost
            cost.alpha = 1.0
            cost.observe_fetch(100, 1.0, 0.5)
            cost.observe_prefill(10**6, 1.0)

        p.loop.call(slow_link)
        _forget_prefill_history(p)
        out2, _sent2, _ran = turns.run(stub, second)
    assert counter_values(p.metrics, "pdserve:kv_prefix_fetches", "outcome") == {"skipped": 1.0}
    assert counter_values(holder.metrics, "pdserve:kv_transfer_bytes") in ({}, {"": 0.0})
    ref = offline([first, second], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 2)
    assert [out1, out2] == [r[0] for r in ref]
