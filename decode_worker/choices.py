"""n > 1 on a worker: the choices of one request, decoded side by side and streamed on one RPC.

Lifecycle: a ``Decode`` (or colocated ``Generate``) call may carry the sampling params of choices
1..n-1 (``siblings``) besides the request itself (choice 0). Once choice 0's prompt KV is in this
engine (arrived from the prefill worker, or prefilled here), ``start_siblings`` adds each sibling as
its own engine request (``choice_request_id``: the one place such ids are built) with the same
prompt: the engine's prefix cache holds the prompt's full blocks by then, so a sibling recomputes
only the last, partial block and samples its own first token with its own seed. All choices share
one ``Choices`` record and their parent's stream; each chunk carries its choice's ``index``, and the
stream ends when the last choice finishes. The ``AbortChoice`` RPC (request id + choice index on the
wire, ``ChoiceRequestSet.abort_choice``) ends one choice (the router found a stop string in it)
without ending the others; aborting the request itself ends them all. Sharing needs the engine's
prefix cache (on by default); without it siblings recompute the whole prompt, with the same tokens.

Mixed versions: a router older than ``AbortChoice`` sends ``Abort`` with the choice's engine id
(``<id>#<i>``); that id is the key this set holds the sibling under, so it ends that choice alone
(never the shared stream). An older worker answers ``AbortChoice`` UNIMPLEMENTED: the router's
best-effort abort fails visibly and the choice runs to its own end, its tokens unused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

import grpc

from engine.sampling_params import SamplingParams
from proto import worker_pb2
from worker_common.request import RequestError, RequestSet, WorkerRequest, request_params

if TYPE_CHECKING:
    from engine.client import EngineCore

MAX_CHOICES = SamplingParams.MAX_N  # the router validates n against the same constant
"""Most choices (n) one request may have on a worker."""


def choice_request_id(request_id: str, index: int) -> str:
    """The engine id of choice ``index`` of ``request_id`` on this worker (choice 0 is the request itself)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return request_id if index == 0 else f"{request_id}#{index}"


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
    held: set[str] = field(default_factory=set)
    """Engine ids of the choices its set still holds."""

    def id_of(self, index: int) -> str:
        return choice_request_id(self.root, index)


@dataclass
class ChoiceRequest(WorkerRequest):
    """A record that may be one choice of several (the decode role's records)."""

    index: int = field(default=0, kw_only=True)
    """Which choice of its request this is (0: the request itself)."""
    choices: Optional[Choices] = field(default=None, kw_only=True)
    """n > 1: the record its request's choices share; None otherwise."""


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


def is_last(req: ChoiceRequest) -> Callable[[Any], bool]:
    """The stream's end for ``req``'s handler: its finish, or with choices, the chunk that finished the last."""
    def last(ch: Any) -> bool:
        if not isinstance(ch, worker_pb2.DecodeChunk) or ch.finish_reason == "":
            return False
        group = req.choices
        return group is None or ch is group.last_chunk
    return last


def finish_choice(req: ChoiceRequest, chunk: Any) -> None:
    """``req``'s choice finished with ``chunk`` (call before putting it on the stream)."""
    if req.choices is not None:
        req.choices.open -= 1
        if req.choices.open == 0:
            req.choices.last_chunk = chunk


R = TypeVar("R", bound=ChoiceRequest)


def start_request(w: Any, output_stream: str, request_id: str, start: Callable[[Any], R]) -> R:
    """Run ``start(engine)`` on worker ``w``'s loop thread (it adds or activates the request's record and returns
    it). With ``output_stream`` set the record's chunks go to that router output stream (UNAVAILABLE here if it is
    not open), bound in the same loop call, before any chunk; if ``start`` fails the binding is undone."""
    out = w.bind_output(output_stream, request_id)

    def run(eng: EngineCore) -> R:
        req = start(eng)
        if out is not None:  # this call is now the request's lifetime only
            out.is_last, req.out = is_last(req), out
        return req

    try:
        return w.loop.call(run)
    except BaseException:
        if out is not None:
            out.discard()
        raise


class ChoiceRequestSet(RequestSet[R]):
    """A request set whose requests may have several choices: it knows each request's ``Choices`` by the
    request's id, so the request stays known here while any choice of it runs; ``abort_choice`` ends one
    choice, ``abort`` of the request's id ends them all."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._groups: dict[str, Choices] = {}  # a request's id -> its choices, while any is held

    def __contains__(self, request_id: object) -> bool:
        # a request whose own choice finished is still here while another of its choices runs
        return super().__contains__(request_id) or request_id in self._groups

    def hold(self, req: R) -> None:
        super().hold(req)
        if req.choices is not None:
            self._groups.setdefault(req.choices.root, req.choices).held.add(req.request_id)

    def _take(self, request_id: str, error: Optional[str] = None) -> Optional[R]:
        req = super()._take(request_id, error)
        if req is not None and req.choices is not None:
            group = self._groups.get(req.choices.root)
            if group is not None:
                group.held.discard(request_id)
                if not group.held:
                    del self._groups[req.choices.root]
        return req

    def ends_request(self, req: R) -> bool:
        return req.index == 0  # a request with n choices finishes once

    def start_siblings(self, eng: EngineCore, root: R, prompt: list[int], params: Sequence[Any],
                       make: Callable[[str, Any], R]) -> None:
        """Add choices 1..n-1 of ``root`` to the engine and hold them (loop thread); ``make(id, params)`` builds
        a record, which then shares ``root``'s stream. A sibling the engine refuses fails the whole request."""
        if not params:
            return
        group = root.choices = Choices(root.request_id, open=1 + len(params))
        self._groups[group.root] = group
        group.held.add(root.request_id)
        for i, p in enumerate(params, 1):
            cid = group.id_of(i)
            try:
                eng.add_request(cid, prompt, p)
            except ValueError as e:
                for j in range(1, i):
                    self.abort_quietly(group.id_of(j))
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"siblings[{i - 1}]: {e} "
                                                                     f"(request {root.request_id})") from None
            child = make(cid, p)
            child.out, child.index, child.choices = root.out, i, group
            self.hold(child)

    def end_choice(self, req: R) -> bool:
        """Abort one choice alone: freed, reported finished with "abort" on the shared stream, the other choices
        go on."""
        self.abort_quietly(req.request_id)
        group = req.choices
        if group is not None and group.open > 0:
            chunk = worker_pb2.DecodeChunk(index=req.index, finish_reason="abort")
            finish_choice(req, chunk)
            req.out.put(chunk)
        return True

    def abort_choice(self, request_id: str, index: int) -> bool:
        """End choice ``index`` of ``request_id`` alone (the ``AbortChoice`` RPC); False if this set holds no such
        running choice (not started yet, finished, or a request without choices: nothing else is touched)."""
        group = self._groups.get(request_id)
        if group is None or not 0 <= index < MAX_CHOICES:
            return False
        req = self.get(group.id_of(index))
        return req is not None and self.end_choice(req)

    def abort(self, request_id: str) -> bool:
        """Drop the request with every choice of it still held and end the shared stream as CANCELLED; True if
        held. An id that names a sibling (an older router's per-choice abort) ends that choice alone."""
        req = self.get(request_id)
        if req is not None and req.index > 0:
            return self.end_choice(req)
        group = self._groups.get(request_id)
        if group is None:
            return super().abort(request_id)
        records = [r for r in (self.get(i) for i in sorted(group.held)) if r is not None]
        for r in records:
            self.abort_quietly(r.request_id)
        if records:
            records[0].cancel()  # the choices share one stream: one CANCELLED ends it
        return bool(records)


class AbortChoiceServicer:
    """The ``AbortChoice`` RPC, for a ``WorkerBase`` whose request sets may hold choices (decode, colocated)."""

    def AbortChoice(self, request: worker_pb2.AbortChoiceRequest,
                    context: grpc.ServicerContext) -> worker_pb2.AbortResponse:
        rid, index = request.request_id, request.choice_index
        if not rid or not 0 <= index < MAX_CHOICES:
            field_name = "request_id" if not rid else "choice_index"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{field_name}: AbortChoice needs a request id and a choice index in [0, {MAX_CHOICES}), "
                          f"got {rid!r}, {index}")
        loop = self.loop  # type: ignore[attr-defined]
        if loop is None or not loop.alive:
            return worker_pb2.AbortResponse(found=False)

        def abort(eng: EngineCore) -> bool:
            rs = self.holder(rid)  # type: ignore[attr-defined]
            found = isinstance(rs, ChoiceRequestSet) and rs.abort_choice(rid, index)
            self.refresh_load()  # type: ignore[attr-defined]
            return found

        return worker_pb2.AbortResponse(found=bool(loop.call(abort)))


__all__ = ["AbortChoiceServicer", "ChoiceRequest", "ChoiceRequestSet", "Choices", "MAX_CHOICES",
           "choice_request_id", "finish_choice", "is_last", "sibling_params", "start_request"]
