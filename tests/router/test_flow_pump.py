"""The flow pump (router/flow_pump.py) and the output stream sinks' waiters it relies on.

Unit tests of the two layers with plain Python producers; the cluster tests (tests/roles, tests/e2e) drive the
real thing through gRPC clients, and ``test_pushed_flows_stream_on_the_reader_thread`` below checks that the
router's streaming really runs on the output streams' reader threads."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from router.flow_pump import END, HANDOFF, FlowPump, LoopInbox, Wait
from router.output_streams import _Sink
from transport.errors import StatusRpcError


class _Stream:
    """A stream a flow waits on: a real ``_Sink`` and the putting side."""

    def __init__(self) -> None:
        self.sink = _Sink()

    def wait(self, waiter) -> bool:
        return self.sink.wait(waiter)

    def take(self):
        return self.sink.q.get_nowait()


def _flow(stream: _Stream, n: int, threads: list, blocking_at_end: bool = True):
    """A pushed flow: n chunks, each processed where it is resumed; HANDOFF before its (blocking) end."""
    got = 0
    while got < n:
        if stream.sink.q.empty():
            yield Wait(stream)
            continue
        item = stream.take()
        if isinstance(item, grpc.RpcError):
            yield HANDOFF
            threads.append(("error", threading.current_thread().name))
            raise item
        threads.append((item, threading.current_thread().name))
        got += 1
        yield f"ev{item}"
    if blocking_at_end:
        yield HANDOFF
    threads.append(("end", threading.current_thread().name))


def _run_pump(gen, pool):
    out, done = [], threading.Event()

    def emit(item):
        out.append(item)
        if item is END or isinstance(item, BaseException):
            done.set()

    FlowPump(gen, pool, emit).start()
    return out, done


def test_plain_items_resume_the_flow_on_the_putting_thread_and_handoff_moves_it_to_the_pool():
    stream, threads = _Stream(), []
    with ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:
        out, done = _run_pump(_flow(stream, 3, threads), pool)
        for i in range(3):
            def reader(i=i):
                stream.sink.put(i, plain=True)
            t = threading.Thread(target=reader, name=f"reader-{i}")
            t.start()
            t.join()
        assert done.wait(5)
    assert out == ["ev0", "ev1", "ev2", END]
    # the chunks were processed by the threads that put them (each put after the flow waited, or found queued)
    names = dict(threads)
    assert all(names[i].startswith(("reader-", "pool")) for i in range(3))
    assert sum(names[i].startswith("reader-") for i in range(3)) >= 2, threads
    assert names["end"].startswith("pool"), threads  # the blocking end never runs on a reader


def test_a_status_item_resumes_the_flow_on_the_pool_and_its_failure_is_emitted():
    stream, threads = _Stream(), []
    with ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:
        out, done = _run_pump(_flow(stream, 5, threads), pool)
        stream.sink.put(0, plain=True)
        err = StatusRpcError(grpc.StatusCode.UNAVAILABLE, "stream broke")
        t = threading.Thread(target=lambda: stream.sink.put(err), name="reader-x")
        t.start()
        t.join()
        assert done.wait(5)
    assert out[-1] is err and out[0] == "ev0"
    assert dict(threads)["error"].startswith("pool"), threads


def test_a_waiter_is_never_lost_and_never_runs_twice():
    """Puts racing the flow's Wait: every item is processed exactly once, in order, by one thread at a time. The
    producer puts the next item as soon as the last one's event is out, while the flow goes back to waiting: a
    lost wakeup stops the flow for good."""
    stream, threads = _Stream(), []
    n = 3000
    running = threading.Lock()
    overlaps = []
    emitted = threading.Semaphore(0)

    def flow():
        for ev in _flow(stream, n, threads, blocking_at_end=False):
            if not running.acquire(blocking=False):
                overlaps.append(ev)
            else:
                running.release()
            yield ev

    with ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
        out = []
        done = threading.Event()

        def emit(item):
            out.append(item)
            emitted.release()
            if item is END:
                done.set()

        FlowPump(flow(), pool, emit).start()
        for i in range(n):
            stream.sink.put(i, plain=(i % 7 != 0))
            assert emitted.acquire(timeout=5), f"item {i} was never processed: a wakeup was lost"
        assert done.wait(5)
    assert out[-1] is END and out[:-1] == [f"ev{i}" for i in range(n)]
    assert not overlaps


def test_the_sink_refuses_a_waiter_when_an_item_is_queued_and_runs_a_kept_one_once():
    sink = _Sink()
    calls = []
    assert sink.wait(calls.append) is True
    sink.put("a", plain=True)
    sink.put("b", plain=False)  # the waiter was used up by "a"
    assert calls == [True]
    assert sink.wait(calls.append) is False  # items queued: go on at once
    sink.held = sink.q.get_nowait()
    sink.q.get_nowait()
    assert sink.wait(calls.append) is False  # an item held back by poll counts as queued


class _CountedInbox(LoopInbox):
    """A LoopInbox that records each drain in ``drains``."""

    __slots__ = ("drains",)

    def __init__(self, loop, drains: list) -> None:
        super().__init__(loop)
        self.drains = drains

    def _drain(self) -> None:
        self.drains.append(1)
        super()._drain()


def test_loop_inbox_wakes_the_loop_once_per_burst_and_keeps_order():
    loop = asyncio.new_event_loop()
    drains = []
    try:
        inbox = _CountedInbox(loop, drains)
        q: asyncio.Queue = asyncio.Queue()
        for i in range(100):  # the loop is not running: one burst
            inbox.put(q, i)
        loop.run_until_complete(asyncio.sleep(0.01))
        assert len(drains) == 1
        assert [q.get_nowait() for _ in range(100)] == list(range(100))
        inbox.put(q, "next")  # a new burst after the drain schedules a new one
        loop.run_until_complete(asyncio.sleep(0.01))
        assert len(drains) == 2 and q.get_nowait() == "next"
    finally:
        loop.close()
    inbox.put(q, "late")  # a closed loop: dropped, no error


def test_loop_inbox_puts_straight_in_on_the_loop_thread_behind_what_waits_to_be_drained():
    """On the loop's own thread (a flow run by an output stream read on the loop, ``RouterConfig.one_loop``) a put
    goes into its queue at once, no drain scheduled; but never ahead of items from other threads not drained yet."""
    loop = asyncio.new_event_loop()
    drains = []
    try:
        inbox = _CountedInbox(loop, drains)
        q: asyncio.Queue = asyncio.Queue()
        inbox.put(q, "first")  # the loop is not running (this thread runs no loop): queued, one drain
        loop.run_until_complete(asyncio.sleep(0.01))
        assert len(drains) == 1 and q.get_nowait() == "first"

        async def on_loop() -> list:
            inbox.put(q, "direct")
            got = [q.get_nowait()]  # already there: no drain ran
            t = threading.Thread(target=inbox.put, args=(q, "from a thread"))
            t.start()
            t.join()
            inbox.put(q, "after it")  # behind the other thread's item, which waits for its drain
            assert q.empty()
            await asyncio.sleep(0.01)
            return got + [q.get_nowait(), q.get_nowait()]

        assert loop.run_until_complete(on_loop()) == ["direct", "from a thread", "after it"]
        assert len(drains) == 2
    finally:
        loop.close()


def _grpc_streams(roles, n: int, tokens: int) -> list[int]:
    from proto import pdserve_pb2

    calls = [roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=[5, 6, 7], max_tokens=tokens, ignore_eos=True),
                                 timeout=120) for _ in range(n)]
    return [sum(len(r.token_ids) for r in c) for c in calls]


def _http_streams(roles, n: int, tokens: int) -> list[int]:
    """``n`` streamed completions at once through the OpenAI client; each one's usage.completion_tokens."""
    import openai

    client = openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="none", max_retries=0)
    got: list[int] = []

    def one() -> None:
        stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=tokens, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                           timeout=120)
        got.extend(ch.usage.completion_tokens for ch in stream if ch.usage is not None)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    client.close()
    return got


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_pushed_flows_stream_on_the_reader_thread(api):
    """Through a real router and colocated worker with output streams, over gRPC and over the OpenAI HTTP API:
    the flows' chunks are processed on the output stream's reader thread, each request costs the flow pool a few
    tasks, not one per token, and no request gets a thread of its own."""
    from tests.roles.harness import start_colocated

    roles = start_colocated(n=1, tag="pump-", router={"http_port": 0} if api == "http" else None)
    try:
        router = roles.router
        submitted = []
        pool = router._pool
        orig_submit = pool.submit

        def counting_submit(fn, *a, **k):
            submitted.append(1)
            return orig_submit(fn, *a, **k)

        pool.submit = counting_submit  # type: ignore[method-assign]
        seen_threads = []
        from router import request_flow

        orig_emit = request_flow.RequestFlow._emit

        def recording_emit(self, *a, **k):
            seen_threads.append(threading.current_thread().name)
            return orig_emit(self, *a, **k)

        request_flow.RequestFlow._emit = recording_emit  # type: ignore[method-assign]
        try:
            got = (_grpc_streams if api == "grpc" else _http_streams)(roles, 4, 48)
        finally:
            request_flow.RequestFlow._emit = orig_emit  # type: ignore[method-assign]
            pool.submit = orig_submit  # type: ignore[method-assign]
        assert got == [48] * 4
        # something was recorded: every token passed through a flow's _emit (4 x 48, a few per call when steps
        # batch them), and each request took the flow pool at least once (its validation, its pump)
        assert len(seen_threads) >= 4 * 48 // 8, seen_threads
        assert len(submitted) >= 4, len(submitted)
        on_reader = sum(n.startswith("out-stream-") for n in seen_threads)
        assert on_reader >= 0.7 * len(seen_threads), seen_threads
        assert not [n for n in seen_threads if n.startswith("http-")], seen_threads
        assert len(submitted) <= 4 * 12, len(submitted)  # 4 requests x 48 tokens would be 192 with a task each
    finally:
        roles.close()


def test_a_router_bug_reaches_the_client_as_unavailable_not_unknown(monkeypatch):
    """A bug in the front end's own code (here: rendering an event) is logged and answered UNAVAILABLE with a
    plain message; the router keeps serving."""
    from proto import pdserve_pb2
    from router import server as router_server
    from tests.roles.harness import start_colocated

    roles = start_colocated(n=1, tag="bug-")
    try:
        def broken(ev):
            raise RuntimeError("render bug")

        monkeypatch.setattr(router_server, "render", broken)
        with pytest.raises(grpc.RpcError) as err:
            list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=[5, 6], max_tokens=4), timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "render bug" not in err.value.details()
        monkeypatch.undo()
        got = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=[5, 6], max_tokens=4), timeout=60))
        assert sum(len(r.token_ids) for r in got) == 4
        assert roles.wait_idle(10.0)
    finally:
        roles.close()
