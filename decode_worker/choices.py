"""n > 1 on a worker: the choices of one request, decoded side by side and streamed on one RPC.

Lifecycle: a ``Decode`` (or colocated ``Generate``) call may carry the sampling params of choices
1..n-1 (``siblings``) besides the request itself (choice 0). Once choice 0's prompt KV is in this
engine (arrived from the prefill worker, or prefilled here), ``start_siblings`` adds each sibling as
its own engine request ``<id>#<i>`` with the same prompt: the engine's prefix cache holds the prompt's
full blocks by then, so a sibling recomputes only the last, partial block and samples its own first
token with its own seed. All choices share one ``Choices`` record and their parent's stream; each
chunk carries its choice's ``index``, and the stream ends when the last choice finishes.
``end_choice`` ends one choice (the router found a stop string in it) without ending the others;
aborting the request itself ends them all. Sharing needs the engine's prefix cache (on by default);
without it siblings recompute the whole prompt, with the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

import grpc

from proto import worker_pb2
from worker_common.request import RequestError, RequestSet, WorkerRequest, request_params

MAX_CHOICES = 16


@dataclass
class Choices:
    """The choices of one request on this worker (loop-thread state)."""

    root: str
    """Choice 0's id (the request's own)."""
    open: int = 1
    """Choices not finished yet; the stream ends at 0."""
    last_chunk: Any = None
    """The chunk that took ``open`` to 0, set on the loop thread before it is queued: the handler ends the
    stream after exactly that chunk (it cannot read ``open`` itself, which runs ahead of the queue)."""

    def id_of(self, index: int) -> str:
        return self.root if index == 0 else f"{self.root}#{index}"


def sibling_params(wires: Sequence[Any], request_id: str) -> list[Any]:
    """The siblings' engine params; INVALID_ARGUMENT naming ``siblings[i]`` on a bad one."""
    if len(wires) + 1 > MAX_CHOICES:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"siblings: at most {MAX_CHOICES - 1}, got {len(wires)} (request {request_id})")
    out = []
    for i, w in enumerate(wires):
        try:
            out.append(request_params(w, request_id))
        except RequestError as e:
            raise RequestError(e.code, f"siblings[{i}]{e.message[len('params'):]}") from None
    return out


def is_last(req: WorkerRequest) -> Callable[[Any], bool]:
    """The stream's end for ``req``'s handler: its finish, or with choices, the chunk that finished the last."""
    def last(ch: Any) -> bool:
        if not isinstance(ch, worker_pb2.DecodeChunk) or ch.finish_reason == "":
            return False
        group = req.choices
        return group is None or ch is group.last_chunk
    return last


def start_siblings(rs: RequestSet, eng: Any, root: WorkerRequest, prompt: list[int], params: Sequence[Any],
                   make: Callable[[str, Any], WorkerRequest]) -> None:
    """Add choices 1..n-1 of ``root`` to the engine and to ``rs`` (loop thread); ``make(id, params)`` builds
    a record sharing ``root``'s stream. A sibling the engine refuses fails the whole request."""
    if not params:
        return
    group = root.choices = Choices(root.request_id, open=1 + len(params))
    for i, p in enumerate(params, 1):
        cid = group.id_of(i)
        try:
            eng.add_request(cid, prompt, p)
        except ValueError as e:
            for j in range(1, i):
                rs.abort_quietly(group.id_of(j))
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"siblings[{i - 1}]: {e} "
                                                                 f"(request {root.request_id})") from None
        child = make(cid, p)
        child.out, child.index, child.choices = root.out, i, group
        rs.hold(child)


def finish_choice(req: WorkerRequest, chunk: Any) -> None:
    """``req``'s choice finished with ``chunk`` (call before putting it on the stream)."""
    if req.choices is not None:
        req.choices.open -= 1
        if req.choices.open == 0:
            req.choices.last_chunk = chunk


def one_choice(rs: RequestSet, request_id: str) -> Optional[WorkerRequest]:
    """The single choice an abort of ``request_id`` names: ``<id>#<i>`` (``<id>#0`` for the request's own
    choice) of a request with choices; None for a plain id (the whole request)."""
    base, sep, idx = request_id.rpartition("#")
    if not sep or not idx.isdigit():
        return None
    req = rs.get(base) if idx == "0" else rs.get(request_id)
    return req if req is not None and req.choices is not None else None


def end_choice(rs: RequestSet, req: WorkerRequest) -> bool:
    """Abort one choice alone (the router found a stop string in it): freed, reported finished with "abort"
    on the shared stream, the other choices go on. (Aborting the request's own id ends them all:
    ``RequestSet.abort``.)"""
    rs.abort_quietly(req.request_id)
    group = req.choices
    if group.open > 0:
        chunk = worker_pb2.DecodeChunk(index=req.index, finish_reason="abort")
        finish_choice(req, chunk)
        req.out.put(chunk)
    return True


R = TypeVar("R", bound=WorkerRequest)


class ChoiceRequestSet(RequestSet[R]):
    """A request set whose requests may have several choices: an abort naming one choice (``<id>#<i>``) ends
    only that choice; the request's own id ends them all."""

    def abort(self, request_id: str) -> bool:
        one = one_choice(self, request_id)
        if one is not None:
            return end_choice(self, one)
        return super().abort(request_id)


__all__ = ["ChoiceRequestSet", "Choices", "MAX_CHOICES", "end_choice", "finish_choice", "is_last", "one_choice",
           "sibling_params", "start_siblings"]
