"""What a placement is: its ``Route``, the load counts it holds (``Hold``), the ``Placement`` record, and
``recovery``, the one rule for what a failed attempt leads to (fail, retry elsewhere, migrate).

Lifecycle: plain records and one pure function; the ``Placer`` (router.placement) builds placements, the flow's
``Attempt`` owns them while an attempt runs, the simulator builds them through the same ``Placer``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import grpc

from proto import worker_pb2
from proto.worker_pb2 import WorkerInfo
from router.events import FlowError
from router.scope import RequestScope
from router.worker_source import Pool

RETRIABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Worker failures worth another worker."""
DEFAULT_BLOCK_SIZE = 16
"""Blocks per prompt are counted with this when a decode worker's record has no block size yet."""


class Route(str, enum.Enum):
    """How a request runs."""

    PAIR = "pair"
    """Reserve on a decode worker, prefill on a prefill worker, KV moves between them."""
    DECODE = "decode"
    """Whole on a decode worker (conditional disaggregation; a migration of a pair's decode)."""
    COLOCATED = "colocated"
    """Whole on a colocated worker (colocated mode; no decode worker left)."""

    def __str__(self) -> str:
        return self.value

    @property
    def pool(self) -> Pool:
        """The pool whose worker runs a whole route (``PAIR``: the decode pool, where it reserves)."""
        return Pool.DECODE if self is Route.PAIR else Pool(self.value)

    @classmethod
    def whole(cls, pool: Pool) -> "Route":
        """The route that runs a request whole on a worker of ``pool``."""
        if pool is Pool.PREFILL:
            raise ValueError("pool: a prefill worker cannot run a whole request")
        return cls(pool.value)


class Hold(str, enum.Enum):
    """A load count this router holds for a placement (``WorkerSelector.acquire``)."""

    DECODE = "decode"
    """On ``Placement.decode``: the pair's decode worker, or the worker running the whole request."""
    PREFILL = "prefill"
    """On ``Placement.prefill`` (pairs only), with the prompt's tokens as its pending prefill work."""

    def __str__(self) -> str:
        return self.value


ALL_HOLDS = (Hold.DECODE, Hold.PREFILL)


@dataclass
class Placement:
    """Where one attempt of a request runs, and what this router holds there."""

    route: Route
    """``Route.PAIR``, or the whole route whose worker runs the request."""
    request_id: str = ""
    """The id the workers of this placement know the request by (``RequestScope.next_worker_request_id``)."""
    decode: Optional[WorkerInfo] = None
    """The decode worker of a pair, or the worker running the whole request."""
    prefill: Optional[WorkerInfo] = None
    """The prefill worker of a pair."""
    reservation: Optional[worker_pb2.ReserveResponse] = None
    """The blocks reserved on ``decode`` (pairs only)."""
    held: set[Hold] = field(default_factory=set)
    """Load counts this router holds."""

    def __post_init__(self) -> None:
        self.route = Route(self.route)
        self.held = {Hold(h) for h in self.held}

    def workers(self) -> list[WorkerInfo]:
        return [w for w in (self.decode, self.prefill) if w is not None]


class Recovery(enum.Enum):
    """What a failed attempt leads to."""

    FAIL = "fail"
    RETRY = "retry"
    """Nothing reached the client: run the request again, avoiding the failed worker."""
    MIGRATE = "migrate"
    """Tokens reached the client: another worker prefills prompt + those tokens and goes on."""


def recovery(err: FlowError, scope: RequestScope, streamed_tokens: int, attempts_left: int) -> Recovery:
    """The one rule for retries and migration. A request with several choices (n > 1) is retried only while
    nothing reached the client: each choice would need its own resume."""
    if err.code not in RETRIABLE or err.final or scope.cancelled or attempts_left < 1:
        return Recovery.FAIL
    if streamed_tokens and scope.n > 1:
        return Recovery.FAIL
    return Recovery.MIGRATE if streamed_tokens else Recovery.RETRY
