"""Beam search through the cluster: the router runs the search, the workers score the beams.

Lifecycle: ``RouterCore.generate`` builds a ``BeamFlow`` instead of a ``RequestFlow`` for a validated request
whose ``beam`` is set (gRPC ``beam_width``, HTTP ``use_beam_search``); the front end registers ``cancel`` with
its transport and iterates ``run()``. As vLLM's OpenAI server does it, the search runs in the router over the
engine's own per-prompt algorithm (``engine.PromptBeamSearch``, one iteration of transformers' beam search per
step), and the workers only score:

1. Each step, every live beam (prompt + its tokens so far) is one **sub-request** with max_tokens 1, greedy, and
   the top 2W log-probs of its next token (W = beam_width). The sub-requests of a step run concurrently, each a
   full ``RequestFlow``: placement, admission for KV capacity, retries, deadlines and cancellation are the
   normal path's. The first step (the prompt) takes the request's normal route (a prefill/decode pair in
   disaggregated mode); later steps run whole on a decode worker (colocated: on a colocated worker), whose
   prefix cache holds the beam's history, so each step computes only the tokens it has not seen.
2. The W rows go to the search as each row's top 2W (token, log-prob) pairs, the rest of the row taken as -inf
   (``PromptBeamSearch.step_top``, which merges them in plain Python: the router never loads torch). That is
   exact: the 2W best continuations over all beams are each within their own beam's top 2W (a token outside
   it is beaten by 2W tokens of the same beam).
3. When the search is done, ``run()`` yields the W best sequences, one ``FlowEvent`` each, ``index`` = rank,
   with ``score`` and ``cum_logprob``; the last one also has usage and timings. Nothing streams before that:
   a beam's tokens are not final until the search ends.

A sub-request that fails (after its own retries) fails the search with its status; a cancel or the deadline
cancels the running sub-requests at once. Cost: about max_tokens x W single-token sub-requests, each a round
trip to a worker; that is the price of running the search over the cluster's stateless requests.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import grpc

from engine import PromptBeamSearch, SamplingParams
from router.events import FlowError, FlowEvent, Timings, Usage
from router.placement_records import Route
from router.request_flow import FlowDeps, RequestFlow
from router.validation import ValidatedRequest

log = logging.getLogger(__name__)


@dataclass
class _Beam:
    tokens: list[int]
    """Prompt + generated so far."""


class BeamFlow:
    """One beam search request through the cluster (see the module docstring)."""

    def __init__(self, deps: FlowDeps, vreq: ValidatedRequest, t0: float, deadline: float,
                 next_seq: Callable[[], int], vocab_size: int, eos_token_id: Optional[int]) -> None:
        if vreq.beam is None:
            raise ValueError("a BeamFlow needs a beam search request (vreq.beam)")
        self.deps, self.vreq, self.rid = deps, vreq, vreq.request_id
        self.t0, self.deadline = t0, deadline
        self._next_seq = next_seq
        self._vocab = vocab_size
        self.params = vreq.beam
        self.search = PromptBeamSearch(list(vreq.prompt_token_ids), self.params.max_tokens, self.params,
                                       eos_token_id)
        self._sub_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width,
                                          ignore_eos=True, lora_name=vreq.params.lora_name,  # (its adapter's scores)
                                          priority=vreq.params.priority, cache_salt=vreq.params.cache_salt)
        self._lock = threading.Lock()
        self._live: list[RequestFlow] = []
        self._cancelled = False
        self.steps = 0
        self.cached_tokens = 0
        """Prompt tokens of the first step whose KV came from a prefix cache."""

    def cancel(self) -> None:
        """Client cancel or deadline (any thread): cancel the running sub-requests; no new ones start."""
        with self._lock:
            self._cancelled = True
            live = list(self._live)
        for f in live:
            f.cancel()

    def run(self) -> Iterator[FlowEvent]:
        W = self.params.beam_width
        parents: list[_Beam] = [_Beam(list(self.vreq.prompt_token_ids))]
        with ThreadPoolExecutor(max_workers=W, thread_name_prefix=f"beam-{self.rid[:32]}") as pool:
            while True:
                tops = self._score(pool, parents)
                if self.steps == 1:  # the prompt's one row, as W identical parents (the engine does the same)
                    tops, parents = tops * W, parents * W
                nxt = self.search.step_top(tops, parents)
                if self.search.done:
                    break
                parents = [_Beam(p.tokens + [tok]) for p, tok in nxt]
        yield from self._results()

    # ---- one step: every live beam scored by a worker ------------------------------------------------
    def _score(self, pool: ThreadPoolExecutor, beams: list[_Beam]) -> list[list[tuple[int, float]]]:
        """Per beam, its top 2W (token, log-prob) from a worker (the rest of its row is -inf)."""
        self.steps += 1
        step = self.steps
        route = None if step == 1 else (Route.COLOCATED if self.deps.cfg.mode == "colocated" else Route.DECODE)
        futures = [pool.submit(self._top, beam, f"{self.rid}/beam{step}.{j}", route) for j, beam in enumerate(beams)]
        tops: list[list[tuple[int, float]]] = []
        failure: Optional[BaseException] = None
        for fut in futures:
            try:
                tops.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - the first failure ends the search, the others are cancelled
                if failure is None:
                    failure = e
                    self.cancel()
        if failure is not None:
            raise failure
        return tops

    def _top(self, beam: _Beam, sub_id: str, route: Optional[Route]) -> list[tuple[int, float]]:
        """The top 2W (token, log-prob) of the token after ``beam``, from one sub-request."""
        sub = ValidatedRequest(request_id=sub_id, prompt=None, prompt_token_ids=beam.tokens, params=self._sub_params,
                               lora_root=self.vreq.lora_root)
        flow = RequestFlow(FlowDeps(self.deps.cfg, self.deps.placer, self.deps.calls, None, None), sub, self.t0,
                           self.deadline,
                           self._next_seq(), route=route)
        with self._lock:
            if self._cancelled:
                raise FlowError(grpc.StatusCode.CANCELLED, f"request {self.rid}: cancelled")
            self._live.append(flow)
        try:
            top: Optional[list[tuple[int, float]]] = None
            for ev in flow.run():
                if ev.logprobs and top is None:
                    top = list(ev.logprobs[0].top)
            if self.steps == 1:
                self.cached_tokens = flow.cached_tokens
        finally:
            with self._lock:
                self._live.remove(flow)
        want = 2 * self.params.beam_width
        if top is None or len(top) != min(want, self._vocab):
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: a worker sent "
                                                         f"{0 if top is None else len(top)} top log-probs, not {want}")
        toks = [t for t, _ in top]
        if len(set(toks)) != len(toks) or not all(0 <= t < self._vocab for t in toks) \
                or any(math.isnan(lp) for _, lp in top):
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: a worker sent top log-probs that are "
                                                         f"not distinct token ids in [0, {self._vocab}) with log-probs")
        return top

    # ---- the answer --------------------------------------------------------------------------------
    def _results(self) -> Iterator[FlowEvent]:
        tok = self.deps.tokenizer
        seqs = self.search.results(tok, self.vreq.params.skip_special_tokens)
        n_prompt = len(self.vreq.prompt_token_ids)
        total = time.monotonic() - self.t0
        usage = Usage(prompt_tokens=n_prompt, completion_tokens=sum(len(s.tokens) - n_prompt for s in seqs),
                      cached_tokens=self.cached_tokens)
        for rank, s in enumerate(seqs):
            ev = FlowEvent(self.rid, s.tokens[n_prompt:], s.text, finish_reason=s.finish_reason, index=rank,
                           score=s.score, cum_logprob=s.cum_logprob)
            if rank == len(seqs) - 1:
                ev.usage = usage
                ev.timings = Timings(ttft_s=total, total_s=total)
            yield ev
        log.debug("request %s: beam search done in %d steps", self.rid, self.steps)
