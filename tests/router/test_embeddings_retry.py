"""``router.embeddings.run_embed``'s choice of status and retries, one layer alone: its workers are in-process fakes
whose ``Embed`` answers a scripted status (the real path, with real workers, is tests/roles/test_embeddings_cluster.py).

A worker that is gone (UNAVAILABLE), full (RESOURCE_EXHAUSTED) or stopping (a draining worker CANCELS what it holds)
gets the input sent to another worker; a refusal (INVALID_ARGUMENT) is answered at once with the worker's message;
a worker's bug (UNKNOWN) is never answered as UNKNOWN; tries are bounded, and every slot and load count taken is
given back.
"""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest

from proto import worker_pb2
from router.embeddings import ATTEMPTS, EmbedJob, run_embed
from router.events import FlowError
from router.selection import WorkerSelector


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Stub:
    def __init__(self, worker_id: str, script: dict, calls: list) -> None:
        self.worker_id, self.script, self.calls = worker_id, script, calls
        self.Embed = SimpleNamespace(future=self._future)

    def _future(self, req: worker_pb2.EmbedRequest, timeout: float) -> Future:
        self.calls.append(self.worker_id)
        f: Future = Future()
        code = self.script.get(self.worker_id)
        if code is None:
            f.set_result(worker_pb2.EmbedResponse(embedding=[3.0, 4.0], num_prompt_tokens=len(req.prompt_token_ids)))
        else:
            f.set_exception(_Err(code, f"{code.name.lower()} on {self.worker_id}"))
        return f


class _Bound:
    def __init__(self) -> None:
        self.held = 0

    def try_take(self) -> bool:
        self.held += 1
        return True

    def give_back(self) -> None:
        self.held -= 1


def _core(script: dict, n: int = 3):
    workers = [SimpleNamespace(worker_id=f"p{i}", grpc_address=f"p{i}", ready=True, queued_prompt_tokens=0,
                               updated_at=0.0) for i in range(n)]
    calls: list = []
    suspects: list = []
    view = SimpleNamespace(list=lambda role: workers if role == "prefill" else [], suspect=suspects.append)
    core = SimpleNamespace(limits=object(), draining=False, bound=_Bound(), cfg=SimpleNamespace(max_num_requests=8),
                           view=view, selector=WorkerSelector(), metrics=None,
                           clients=SimpleNamespace(prefill=lambda addr: _Stub(addr, script, calls)))
    return core, calls, suspects


def _job(n: int = 1) -> EmbedJob:
    return EmbedJob("r", [[1, 2, 3]] * n)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.CANCELLED])
def test_a_worker_gone_full_or_stopping_hands_the_input_to_another(code):
    core, calls, suspects = _core({"p0": code})
    (got,) = run_embed(core, _job(), 1e12)
    assert calls == ["p0", "p1"] and got.embedding == [0.6, 0.8] and got.num_prompt_tokens == 3
    assert suspects == (["p0"] if code is grpc.StatusCode.UNAVAILABLE else [])
    assert core.bound.held == 0 and all(core.selector.in_flight(w) == 0 for w in ("p0", "p1", "p2"))


def test_tries_are_bounded_and_a_cancelled_worker_is_not_the_clients_cancel():
    core, calls, _ = _core({f"p{i}": grpc.StatusCode.CANCELLED for i in range(3)})
    with pytest.raises(FlowError) as e:
        run_embed(core, _job(), 1e12)
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and len(calls) == ATTEMPTS
    core, calls, _ = _core({f"p{i}": grpc.StatusCode.RESOURCE_EXHAUSTED for i in range(3)})
    with pytest.raises(FlowError) as e:
        run_embed(core, _job(), 1e12)
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and sorted(calls) == ["p0", "p1", "p2"]
    assert core.bound.held == 0


@pytest.mark.parametrize("code, answered", [(grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
                                            (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
                                            (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE),
                                            (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)])
def test_a_refusal_is_answered_at_once_and_a_workers_bug_is_never_unknown(code, answered):
    core, calls, _ = _core({f"p{i}": code for i in range(3)})
    with pytest.raises(FlowError) as e:
        run_embed(core, _job(2), 1e12)
    assert e.value.code is answered and calls.count("p0") <= 1
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert "invalid_argument on" in e.value.message
    assert core.bound.held == 0 and all(core.selector.in_flight(w) == 0 for w in ("p0", "p1", "p2"))


def test_a_passed_deadline_is_deadline_exceeded_before_any_call():
    core, calls, _ = _core({})
    with pytest.raises(FlowError) as e:
        run_embed(core, _job(), 0.0)
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and core.bound.held == 0 and calls == []
