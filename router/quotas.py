"""Per-key quotas: requests per second, tokens per minute and requests in flight, for each API key's name.

Lifecycle: one ``QuotaBook`` per router, built over the router's key source (``transport.api_keys``) and the
number of router replicas that share the deployment's limits (``RouterConfig.quota_routers``: each router
enforces its 1/N share, since routers never write Redis and a Service spreads each key's traffic over them).
Every request that passed validation asks ``admit(key, prompt_tokens, max_tokens)`` before any worker works:
it gets a ``Lease`` or ``QuotaExceeded`` (carrying the seconds after which a retry can pass, for
``Retry-After``). ``admit`` takes one request token and charges ``prompt + max_tokens`` to the name's token
bucket (as OpenAI counts rate limits), and counts the request in flight; the lease's ``release(completion)``
(always, in a ``finally``) ends it and refunds the tokens it did not generate. Limits are read from the key on
every call, so a reloaded keys file applies to the next request; a name's state (buckets, in-flight count)
survives reloads and key rotation. Buckets start full and refill continuously.

A key without limits, or no key at all (an open router), is never refused here.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from transport.api_keys import ApiKey, KeyLimits


class QuotaExceeded(Exception):
    """A request over its key's quota: ``retry_after_s`` (None: it can never pass, e.g. larger than the bucket)."""

    def __init__(self, message: str, retry_after_s: Optional[float]) -> None:
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s

    @property
    def retry_after_header(self) -> Optional[str]:
        """Whole seconds, at least 1, as HTTP's Retry-After takes them."""
        return None if self.retry_after_s is None else str(max(1, math.ceil(self.retry_after_s)))


class _Bucket:
    """A token bucket of ``capacity`` refilling at ``rate`` per second (capacity and rate read per call)."""

    def __init__(self, capacity: float, now: float) -> None:
        self.level, self.at = capacity, now

    def refill(self, capacity: float, rate: float, now: float) -> None:
        self.level = min(capacity, self.level + (now - self.at) * rate)
        self.at = now


@dataclass
class _NameState:
    requests: Optional[_Bucket] = None
    tokens: Optional[_Bucket] = None
    in_flight: int = 0


class Lease:
    """One admitted request's hold on its key's quota; ``release`` exactly once (idempotent)."""

    def __init__(self, book: "QuotaBook", name: Optional[str], charged: int, max_tokens: int) -> None:
        self._book, self.name, self._charged, self._max_tokens = book, name, charged, max_tokens
        self._done = False

    def release(self, completion_tokens: Optional[int] = None) -> None:
        """End the request; ``completion_tokens`` (None: unknown, no refund) sets the refund of unused tokens."""
        if self._done:
            return
        self._done = True
        if self.name is not None:
            unused = 0 if completion_tokens is None else max(0, self._max_tokens - completion_tokens)
            self._book._release(self.name, self._charged, unused)


class QuotaBook:
    """The router's share of every key name's limits (see module docstring)."""

    def __init__(self, routers: int = 1, clock: Callable[[], float] = time.monotonic,
                 on_refuse: Optional[Callable[[str, str], None]] = None) -> None:
        """``on_refuse(name, limit)``: called for every refused request (the router's metrics)."""
        if not isinstance(routers, int) or routers < 1:
            raise ValueError(f"quota_routers must be an integer >= 1, got {routers!r}")
        self.routers = routers
        self._clock = clock
        self._on_refuse = on_refuse
        self._lock = threading.Lock()
        self._names: dict[str, _NameState] = {}
        self.refused: dict[tuple[str, str], int] = {}
        """(name, limit) -> requests refused, for metrics and tests."""

    def share(self, limits: KeyLimits) -> tuple[Optional[float], Optional[float], Optional[int]]:
        """(requests/s, tokens/min, in flight) this router allows a name: its 1/N of each (in flight >= 1)."""
        n = self.routers
        rps = None if limits.requests_per_s is None else limits.requests_per_s / n
        tpm = None if limits.tokens_per_min is None else limits.tokens_per_min / n
        conc = None if limits.max_concurrent is None else max(1, math.floor(limits.max_concurrent / n))
        return rps, tpm, conc

    def admit(self, key: Optional[ApiKey], prompt_tokens: int, max_tokens: int) -> Lease:
        """A lease for a request of ``key`` (None: no key), or QuotaExceeded naming the key and the limit."""
        if key is None or key.limits.unlimited:
            return Lease(self, None, 0, max_tokens)
        rps, tpm, conc = self.share(key.limits)
        cost = prompt_tokens + max_tokens
        now = self._clock()
        with self._lock:
            st = self._names.setdefault(key.name, _NameState())
            if conc is not None and st.in_flight >= conc:
                self._refuse(key.name, "max_concurrent")
                raise QuotaExceeded(f"key {key.name!r}: {st.in_flight} requests in flight, the limit here is {conc} "
                                    f"(max_concurrent); retry when one ends", 1.0)
            if rps is not None:
                cap = max(1.0, rps)
                st.requests = st.requests or _Bucket(cap, now)
                st.requests.refill(cap, rps, now)
                if st.requests.level < 1.0:
                    self._refuse(key.name, "requests_per_s")
                    raise QuotaExceeded(f"key {key.name!r}: over {rps:g} requests/s here (requests_per_s); "
                                        f"retry later", (1.0 - st.requests.level) / rps)
            if tpm is not None:
                rate = tpm / 60.0
                st.tokens = st.tokens or _Bucket(tpm, now)
                st.tokens.refill(tpm, rate, now)
                if cost > tpm:
                    self._refuse(key.name, "tokens_per_min")
                    raise QuotaExceeded(f"key {key.name!r}: this request needs {cost} tokens (prompt + max_tokens), "
                                        f"more than the {tpm:g} tokens/min allowed here (tokens_per_min); lower "
                                        f"max_tokens", None)
                if st.tokens.level < cost:
                    self._refuse(key.name, "tokens_per_min")
                    raise QuotaExceeded(f"key {key.name!r}: over {tpm:g} tokens/min here (tokens_per_min: prompt "
                                        f"+ max_tokens are charged); retry later", (cost - st.tokens.level) / rate)
                st.tokens.level -= cost
            if st.requests is not None:
                st.requests.level -= 1.0
            st.in_flight += 1
        return Lease(self, key.name, cost if tpm is not None else 0, max_tokens)

    def _refuse(self, name: str, limit: str) -> None:
        self.refused[(name, limit)] = self.refused.get((name, limit), 0) + 1
        if self._on_refuse is not None:
            self._on_refuse(name, limit)

    def _release(self, name: str, charged: int, unused: int) -> None:
        with self._lock:
            st = self._names.get(name)
            if st is None:
                return
            st.in_flight = max(0, st.in_flight - 1)
            if charged and st.tokens is not None:
                st.tokens.level += min(unused, charged)  # refill() caps it at the capacity on the next call

    def in_flight(self, name: str) -> int:
        with self._lock:
            st = self._names.get(name)
            return 0 if st is None else st.in_flight


def max_output_tokens(vreq: Any) -> int:
    """The most tokens a validated request may generate: max_tokens for each choice (or each beam)."""
    if getattr(vreq, "beam", None) is not None:
        return vreq.beam.max_tokens * vreq.beam.beam_width
    return vreq.params.max_tokens * vreq.n
