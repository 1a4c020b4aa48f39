"""Batched token sampling: penalties, filters and seeded draws for many requests at once.

Lifecycle: one ``Sampler`` per engine, created with the model's vocabulary size.
Each step the model runner hands it the last-position logits of every request
that needs a token (``[B, V]``) plus one ``SamplingRequest`` per row (that
request's params and token history); ``sample`` returns one token id per row
and, where asked, its ``TokenLogprob``. It keeps no per-request state: all
history comes in with the call, which is what lets a prefill worker sample
token 0 and a decode worker tokens 1.. and still agree with an offline run.

Processing order (as transformers applies its processors and warpers): the
structured-outputs mask first (``engine.structured_outputs``: forbidden tokens
become -inf in the raw logits, so every later step, logprobs included, sees
the constrained distribution; vLLM applies its grammar bitmask the same way), then
repetition penalty (over prompt + output, transformers' semantics), frequency
and presence penalties (over output only, OpenAI's semantics), logit_bias, vLLM's
allowed_token_ids and bad words (each giving way where it would leave a row no
token), min_tokens (EOS and stop_token_ids masked), a spent thinking_token_budget (the reasoning block's end
token forced, ``engine.reasoning``), then for sampled rows temperature, top-k, top-p,
min-p, typical-p, and finally the draw. Greedy rows (temperature 0) take the
argmax after the penalties. Every step is a tensor op over the whole batch with
per-row parameters; rows whose parameter is neutral pass through unchanged.

Randomness: a draw is inverse-CDF sampling with one uniform ``u`` per row
(the first token whose cumulative probability exceeds ``u``). For a seeded
request, ``u`` for output token ``i`` is computed from ``mix(seed, i)`` in plain
integer arithmetic, so it depends only on ``(seed, i)``: not on the batch, the
process, the device or torch's RNG. Unseeded rows draw ``u`` from the engine's
generator. One number per row instead of one per vocabulary entry keeps the
draw cheap on CPU.

Filters keep every token tied with the cut-off value (a threshold compare
instead of transformers' scatter of a sorted mask); with distinct logits the
kept sets are identical. Top-p looks at the 256 most likely tokens first and
sorts the whole row only when those do not reach the requested mass.

Logprobs follow vLLM's default: the log-softmax of the raw model logits, before
penalties, temperature and filters, so they describe the model, not the sampler
(under a structured-outputs mask: the masked logits, as in vLLM; alternatives
the mask forbids are left out of ``top``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from engine.outputs import TokenLogprob
from engine.reasoning import forced_token
from engine.sampling_params import SamplingParams
from engine.structured_outputs import apply_bitmask

_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that scatters nearby inputs."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seed_for_token(seed: int, index: int) -> int:
    """A 63-bit hash that depends only on (request seed, output token index).

    The seed is mixed before the index is added, so (seed, index) pairs never alias
    the way a linear combination could; neighbouring seeds and indices give unrelated values.
    """
    z = (_mix64(seed & _MASK64) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    return _mix64(z) & ((1 << 63) - 1)


def uniform_for_token(seed: int, index: int) -> float:
    """The uniform in [0, 1) that draws output token ``index`` of a request with ``seed``."""
    return (seed_for_token(seed, index) >> 10) / float(1 << 53)


@dataclass
class SamplingRequest:
    """One row of a sampling batch: a request's params and its token history."""

    params: SamplingParams
    """The request's sampling parameters."""
    prompt_token_ids: list[int]
    """Prompt tokens (repetition penalty looks at these too)."""
    output_token_ids: list[int]
    """Tokens generated so far; its length is the index of the token being sampled."""
    eos_token_id: Optional[int] = None
    """Masked while fewer than min_tokens have been generated."""
    generator: Optional[torch.Generator] = None
    """Generator for unseeded draws (the engine's); None uses the sampler's own."""
    generator_fallback: Optional[torch.Generator] = None
    """Alias of ``generator`` (the name docs/interfaces.md uses); either may be set."""


def to_device(values: Any, dtype: Optional[torch.dtype], device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) on ``device``: on CUDA through pinned memory and a non-blocking copy (a copy from
    pageable memory synchronises the host with the stream, so the sampler would wait for the step's forward)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SampleHandle:
    """A launched draw (``Sampler.launch``): ``tokens`` on the device, ``result()`` the host lists once the device
    is done (on CUDA the wait on the launch's event; elsewhere everything already ran)."""

    def __init__(self, tokens: torch.Tensor, lp: Optional[tuple], params: list[SamplingParams],
                 event: Optional[Any], host_tokens: Optional[torch.Tensor] = None) -> None:
        self.tokens = tokens
        """[rows] long on the logits' device: the sampled ids, readable by later device work without a wait."""
        self._lp = lp
        self._params = params
        self._event = event
        self._host_tokens = host_tokens if host_tokens is not None else tokens
        self._result: Optional[tuple[list[int], list[Optional[TokenLogprob]]]] = None

    def result(self) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        """(token id per row, TokenLogprob or None per row); waits once, then returns the same lists."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = (self._host_tokens.tolist(), Sampler._logprob_lists(self._lp, self._params))
        return self._result


class Sampler:
    """Picks the next token for each row of a logits batch (see the module docstring)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self._events: dict[torch.device, list] = {}
        """CUDA: per device, two events (blocking waits) the draws end with, used in turn: an async engine waits for
        step N's after it launched step N + 1, so N + 1 must not re-record N's."""
        self._spin_events: dict[torch.device, list] = {}
        self._allowed_cache: dict[int, tuple[SamplingParams, torch.Tensor]] = {}
        """id(params) -> (params, its allowed_token_ids on the device): ``_allowed_ids``."""

    # -- public ---------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, reqs: list[SamplingRequest],
               masks: Optional[Any] = None) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        """Next token id per row and, for rows whose params ask for logprobs, a TokenLogprob (``launch`` then
        ``SampleHandle.result``).

        ``masks``: the step's structured-outputs masks (``engine.structured_outputs.MaskBatch``: ``rows`` and
        an int32 ``bitmask``, one row each), applied to the raw logits before anything else."""
        return self.launch(logits, reqs, masks).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, reqs: list[SamplingRequest],
               masks: Optional[Any] = None) -> "SampleHandle":
        """The draw enqueued on the logits' device, nothing read back yet: on CUDA no host synchronisation (the
        per-row parameters go up by pinned, non-blocking copies; no branch reads a device value), then the tokens
        and logprob tensors are copied to pinned host memory without blocking and an event marks the end. The
        handle's ``tokens`` stay on the device (an async engine feeds them to the next step's inputs);
        ``result()`` waits for the event and returns the lists."""
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits must be [len(reqs)={len(reqs)}, V], got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}")
        B = len(reqs)
        params = [r.params for r in reqs]
        if B == 0:
            return SampleHandle(logits.new_zeros(0, dtype=torch.long), None, params, None)
        # Padded model vocabularies have columns no tokenizer id maps to; never sample them.
        raw = logits[:, : self.vocab_size].float()
        if masks:
            raw = apply_bitmask(raw, masks.bitmask, masks.rows)
        want_lp = [p.logprobs is not None for p in params]
        need_penalty = any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                           or p.presence_penalty != 0.0 for p in params)
        need_min = any(len(r.output_token_ids) < r.params.min_tokens for r in reqs)
        need_bias = any(p.logit_bias for p in params)
        need_ban = any(p.allowed_token_ids is not None or p.bad_words_token_ids for p in params)
        need_force = any(p.thinking_token_budget is not None for p in params)

        # Fast path: plain greedy batch, the common case for evals and load tests.
        if all(p.greedy for p in params) and not (need_penalty or need_min or need_bias or need_ban or need_force):
            return self._to_host(raw, raw.argmax(dim=-1), params, want_lp)

        x = self._process(raw, reqs, need_penalty, need_min, need_bias, need_ban, need_force)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled_rows) == B:  # all sampled: no row shuffling
            tokens = self._draw(torch.softmax(x, dim=-1), reqs)
        else:
            tokens = x.argmax(dim=-1)
            if sampled_rows:
                idx = to_device(sampled_rows, torch.long, x.device)
                probs = torch.softmax(x.index_select(0, idx), dim=-1)
                drawn = self._draw(probs, [reqs[i] for i in sampled_rows])
                tokens = tokens.index_copy(0, idx, drawn)
        return self._to_host(raw, tokens, params, want_lp)

    def _to_host(self, raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams],
                 want: list[bool]) -> "SampleHandle":
        """The step's one trip to the host, enqueued: the logprob tensors, then (on CUDA) non-blocking copies of
        everything the host reads into pinned memory and one event after them. The event is made with
        ``blocking=True``, so ``SampleHandle.result`` sleeps until the GPU is done instead of spinning a core
        (the engine's CPU per token would otherwise be the whole GPU step); ``PDSERVE_CUDA_SPIN=1`` keeps a
        spinning wait."""
        lp = self._logprob_tensors(raw, tokens, params, want)
        if tokens.device.type != "cuda":
            return SampleHandle(tokens, lp, params, None, host_tokens=tokens)
        host_tokens = tokens.to("cpu", non_blocking=True)
        if lp is not None:
            lp = (lp[0], *(t.to("cpu", non_blocking=True) if t is not None else None for t in lp[1:]))
        spin = os.environ.get("PDSERVE_CUDA_SPIN", "0") == "1"
        events = self._spin_events if spin else self._events
        pair = events.get(tokens.device)
        if pair is None:
            pair = events[tokens.device] = [torch.cuda.Event(blocking=not spin), torch.cuda.Event(blocking=not spin)]
        pair.reverse()
        ev = pair[0]
        ev.record(torch.cuda.current_stream(tokens.device))
        return SampleHandle(tokens, lp, params, ev, host_tokens=host_tokens)

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        """The logits each row's token is picked from: argmax for greedy rows, softmax draw otherwise.

        Filtered tokens are -inf. Exposed so tests and tools can check the
        distribution itself rather than samples of it.
        """
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits must be [len(reqs)={len(reqs)}, V], got {tuple(logits.shape)}")
        return self._process(logits[:, : self.vocab_size].float(), reqs, True, True, True, True, True)

    def _process(self, raw: torch.Tensor, reqs: list[SamplingRequest], need_penalty: bool,
                 need_min: bool, need_bias: bool = False, need_ban: bool = False,
                 need_force: bool = False) -> torch.Tensor:
        x = raw.clone()
        if need_penalty:
            x = self._apply_penalties(x, reqs)
        if need_bias:
            x = self._apply_logit_bias(x, reqs)
        if need_ban:
            x = self._apply_allowed(x, reqs)
            x = self._apply_bad_words(x, reqs)
        if need_min:
            x = self._apply_min_tokens(x, reqs)
        if need_force:
            x = self._apply_thinking_budget(x, reqs)
        sampled_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(sampled_rows) == len(reqs):
            x = self._warp(x, [r.params for r in reqs])
        elif sampled_rows:
            idx = to_device(sampled_rows, torch.long, x.device)
            warped = self._warp(x.index_select(0, idx), [reqs[i].params for i in sampled_rows])
            x = x.index_copy(0, idx, warped)
        return x

    # -- processors -----------------------------------------------------------------------------

    def _apply_penalties(self, x: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        B, V = x.shape
        dev = x.device
        rep = to_device([r.params.repetition_penalty for r in reqs], torch.float32, dev).unsqueeze(1)
        freq = to_device([r.params.frequency_penalty for r in reqs], torch.float32, dev).unsqueeze(1)
        pres = to_device([r.params.presence_penalty for r in reqs], torch.float32, dev).unsqueeze(1)
        out_counts = self._counts([r.output_token_ids for r in reqs], B, V, dev)
        if any(r.params.repetition_penalty != 1.0 for r in reqs):
            seen = self._counts([r.prompt_token_ids for r in reqs], B, V, dev) + out_counts > 0
            # transformers: shrink a seen token's logit toward "less likely" whatever its sign.
            penalised = torch.where(x < 0, x * rep, x / rep)
            x = torch.where(seen, penalised, x)
        # OpenAI: logit -= count * frequency_penalty + (count > 0) * presence_penalty.
        x = x - out_counts * freq - (out_counts > 0).float() * pres
        return x

    def _apply_logit_bias(self, x: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, r in enumerate(reqs):
            for t, b in (r.params.logit_bias or {}).items():
                if 0 <= t < self.vocab_size:
                    rows.append(i)
                    cols.append(t)
                    vals.append(b)
        if rows:
            dev = x.device
            x = x.index_put((to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)),
                            to_device(vals, x.dtype, dev), accumulate=True)
        return x

    def _allowed_ids(self, p: SamplingParams, device: torch.device) -> torch.Tensor:
        """A request's ``allowed_token_ids`` (those in the vocabulary) as a device tensor, made once per request
        (a list of thousands is not rebuilt every step): cached by its params object, which is held with it so its
        id cannot be reused meanwhile; the cache is emptied when it outgrows a batch's worth of requests."""
        hit = self._allowed_cache.get(id(p))
        if hit is not None and hit[0] is p and hit[1].device == device:
            return hit[1]
        if len(self._allowed_cache) >= 1024:
            self._allowed_cache.clear()
        ids = to_device([t for t in p.allowed_token_ids if t < self.vocab_size], torch.long, device)
        self._allowed_cache[id(p)] = (p, ids)
        return ids

    def _apply_allowed(self, x: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        """vLLM's allowed_token_ids: every other logit of such a row is -inf. A row the structured-outputs mask
        (applied before) and its list leave empty keeps the mask's logits: the constraint wins."""
        rows = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids is not None]
        if not rows:
            return x
        keep = torch.ones_like(x, dtype=torch.bool)
        for i in rows:
            keep[i].fill_(False).index_fill_(0, self._allowed_ids(reqs[i].params, x.device), True)
        banned = x.masked_fill(~keep, float("-inf"))
        return torch.where(torch.isneginf(banned).all(dim=-1, keepdim=True), x, banned)

    def _apply_bad_words(self, x: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        """vLLM's bad words: a word's last token is -inf where the output so far ends with the tokens before it
        (a one-token word: everywhere). A row this would leave with nothing to pick keeps its logits (the ban
        gives way to allowed_token_ids or a constraint that leave only banned tokens)."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            words = r.params.bad_words_token_ids
            if not words:
                continue
            out = r.output_token_ids
            for word in words:
                k = len(word) - 1
                if k > len(out) or (k and out[-k:] != word[:-1]):
                    continue
                if word[-1] < self.vocab_size:
                    rows.append(i)
                    cols.append(word[-1])
        if not rows:
            return x
        dev = x.device
        banned = x.index_put((to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)),
                             x.new_full((), float("-inf")))
        return torch.where(torch.isneginf(banned).all(dim=-1, keepdim=True), x, banned)

    def _apply_thinking_budget(self, x: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        """vLLM's thinking_token_budget: a row whose reasoning block has used its budget gets the block's end
        sequence, one forced token a position (``engine.reasoning.forced_token``): every other logit -inf, over
        every other restriction (the block must close for the answer to come)."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            p = r.params
            if p.thinking_token_budget is None:
                continue
            t = forced_token(r.output_token_ids, p.reasoning_end_token_ids, p.reasoning_start_token_ids,
                             p.thinking_token_budget)
            if t is not None and t < self.vocab_size:
                rows.append(i)
                cols.append(t)
        if not rows:
            return x
        dev = x.device
        r_idx, c_idx = to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)
        x = x.index_fill(0, r_idx, float("-inf"))
        return x.index_put((r_idx, c_idx), x.new_zeros(len(rows)))

    def _apply_min_tokens(self, x: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            if len(r.output_token_ids) >= r.params.min_tokens:
                continue
            banned = set(r.params.stop_token_ids)
            if r.eos_token_id is not None:
                banned.add(r.eos_token_id)
            for t in banned:
                if 0 <= t < self.vocab_size:
                    rows.append(i)
                    cols.append(t)
        if rows:
            before = x
            x = x.clone()
            # the value as a device tensor: a Python scalar would be copied from pageable host memory, which
            # synchronises the host with the stream (torch's sync debug mode caught it on an H200)
            x.index_put_((to_device(rows, torch.long, x.device), to_device(cols, torch.long, x.device)),
                         x.new_full((), float("-inf")))
            # a grammar that allows only EOS here: the constraint wins over min_tokens (a select, not a branch on
            # a device value: no host synchronisation)
            dead = torch.isneginf(x).all(dim=-1)
            x = torch.where(dead.unsqueeze(1), before, x)
        return x

    def _warp(self, x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, typical-p over the sampled rows (transformers' maths)."""
        B, V = x.shape
        dev = x.device
        neg_inf = float("-inf")
        temp = to_device([p.temperature for p in params], torch.float32, dev).unsqueeze(1)
        x = x / temp
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        if any(k < V for k in top_k):
            # k-th largest value per row from one topk; ties with it are kept, as in TopKLogitsWarper.
            vals = torch.topk(x, max(k for k in top_k if k < V), dim=-1).values
            pos = to_device([min(k, vals.shape[1]) - 1 for k in top_k], torch.long, dev).unsqueeze(1)
            kth = torch.where(to_device(top_k, torch.long, dev).unsqueeze(1) < V, vals.gather(1, pos),
                              torch.full_like(pos, neg_inf, dtype=x.dtype))
            x = x.masked_fill(x < kth, neg_inf)
        if any(p.top_p < 1.0 for p in params):
            x = self._top_p(x, to_device([p.top_p for p in params], torch.float32, dev).unsqueeze(1))
        if any(p.min_p > 0.0 for p in params):
            probs = torch.softmax(x, dim=-1)
            mp = to_device([p.min_p for p in params], torch.float32, dev).unsqueeze(1)
            remove = probs < mp * probs.amax(dim=-1, keepdim=True)
            remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
            x = x.masked_fill(remove, neg_inf)
        typical_rows = [i for i, p in enumerate(params) if p.typical_p < 1.0]
        if typical_rows:
            idx = to_device(typical_rows, torch.long, dev)
            mass = to_device([params[i].typical_p for i in typical_rows], torch.float32, dev).unsqueeze(1)
            x = x.index_copy(0, idx, self._typical(x.index_select(0, idx), mass))
        return x

    @staticmethod
    def _top_p(x: torch.Tensor, top_p: torch.Tensor, candidates: int = 256) -> torch.Tensor:
        """TopPLogitsWarper: drop a token when the mass of the tokens above it reaches top_p."""
        V = x.shape[1]
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        # off the CPU every row is sorted whole: whether the candidates reach the mass is a device value, and a
        # branch on it would synchronise the host with the step (a GPU sorts a vocabulary row in microseconds)
        k = min(candidates, V) if x.device.type == "cpu" else V
        vals = torch.topk(x, k, dim=-1).values          # sorted, most likely first
        probs = (vals - lse).exp()
        above = probs.cumsum(dim=-1) - probs             # mass strictly above each candidate
        keep = above < top_p
        # Resolved: the cut falls inside the candidates (or they are the whole row).
        resolved = (~keep).any(dim=-1) | (k == V)
        n_keep = keep.sum(dim=-1, keepdim=True).clamp_(min=1)
        cut = vals.gather(1, n_keep - 1)
        if k < V and not bool(resolved.all()):
            rows = (~resolved).nonzero().squeeze(1)
            full = torch.sort(x.index_select(0, rows), dim=-1, descending=True).values
            fp = (full - lse.index_select(0, rows)).exp()
            fkeep = (fp.cumsum(dim=-1) - fp) < top_p.index_select(0, rows)
            fn = fkeep.sum(dim=-1, keepdim=True).clamp_(min=1)
            cut = cut.index_copy(0, rows, full.gather(1, fn - 1))
        return x.masked_fill(x < cut, float("-inf"))

    @staticmethod
    def _typical(x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """TypicalLogitsWarper on rows that use it (it needs a full sort by surprise distance)."""
        normalized = torch.log_softmax(x, dim=-1)
        p = normalized.exp()
        ent = -(normalized * p).nansum(-1, keepdim=True)
        shifted = (-normalized - ent).abs()
        sorted_scores, sorted_idx = torch.sort(shifted, dim=-1, descending=False)
        cum = x.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
        last_ind = (cum < mass).sum(dim=1).clamp_(max=x.shape[-1] - 1)
        cut = sorted_scores.gather(1, last_ind.view(-1, 1))
        # The most typical token always stays (it is <= cut by construction).
        return x.masked_fill(shifted > cut, float("-inf"))

    # -- randomness and logprobs ----------------------------------------------------------------

    def _draw(self, probs: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
        """Inverse-CDF draw, one uniform per row (seeded rows: a function of (seed, index) only)."""
        n = probs.shape[0]
        u = [0.0] * n
        unseeded = [i for i, r in enumerate(reqs) if r.params.seed is None]
        if unseeded:
            gen = reqs[unseeded[0]].generator or reqs[unseeded[0]].generator_fallback or self.generator
            draws = torch.rand(len(unseeded), generator=gen, device=gen.device, dtype=torch.float64).tolist()
            for i, v in zip(unseeded, draws):
                u[i] = v
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                u[i] = uniform_for_token(r.params.seed, len(r.output_token_ids))
        # float64 cumsum: boundaries within 1e-12 of where exact arithmetic puts them, so
        # the same u picks the same token on any device.
        cdf = probs.double().cumsum(dim=-1)
        target = to_device(u, torch.float64, probs.device).unsqueeze(1) * cdf[:, -1:]
        # right=True: first index whose cdf exceeds target, which always has p > 0.
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)

    @staticmethod
    def _counts(seqs: list[list[int]], B: int, V: int, dev: torch.device) -> torch.Tensor:
        """[B, V] float counts of each token id in each row's sequence (one accumulate)."""
        counts = torch.zeros((B, V), device=dev)
        lens = [len(q) for q in seqs]
        if sum(lens) == 0:
            return counts
        flat = torch.tensor([t for q in seqs for t in q], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(B), torch.tensor(lens))
        valid = (flat >= 0) & (flat < V)  # ids outside the vocabulary can't be penalised
        flat, rows = flat[valid], rows[valid]
        counts.index_put_((to_device(rows, torch.long, dev), to_device(flat, torch.long, dev)),
                          torch.ones(len(flat), device=dev), accumulate=True)
        return counts

    @staticmethod
    def _logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams],
                         want: list[bool]) -> Optional[tuple[list[int], torch.Tensor, torch.Tensor,
                                                             Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """(rows, chosen ids, their logprobs, top values, top ids) of the rows that want logprobs, on the device."""
        if not any(want):
            return None
        rows = [i for i, w in enumerate(want) if w]
        idx = to_device(rows, torch.long, raw.device)
        lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)
        chosen = tokens.index_select(0, idx)
        chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
        n_top = max(params[i].logprobs for i in rows)
        top_vals, top_ids = (lp.topk(n_top, dim=-1) if n_top > 0 else (None, None))
        return rows, chosen, chosen_lp, top_vals, top_ids

    @staticmethod
    def _logprob_lists(lp: Optional[tuple], params: list[SamplingParams]) -> list[Optional[TokenLogprob]]:
        """``_logprob_tensors``' result as each row's TokenLogprob (None for rows that did not ask)."""
        out: list[Optional[TokenLogprob]] = [None] * len(params)
        if lp is None:
            return out
        rows, chosen, chosen_lp, top_vals, top_ids = lp
        chosen_l, chosen_lp_l = chosen.tolist(), chosen_lp.tolist()
        tv = top_vals.tolist() if top_vals is not None else None
        ti = top_ids.tolist() if top_ids is not None else None
        for j, i in enumerate(rows):
            k = params[i].logprobs
            top = [(t, v) for t, v in zip(ti[j][:k], tv[j][:k]) if v != float("-inf")] if k else []
            out[i] = TokenLogprob(token_id=chosen_l[j], logprob=chosen_lp_l[j], top=top)
        return out
