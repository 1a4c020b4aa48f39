"""router.selection and router.worker_source: who gets the next request."""
import pytest

from proto.worker_pb2 import WorkerInfo
from router.selection import WorkerSelector
from router.worker_source import StaticWorkerSource


def d(wid, free, total=100, running=0, ready=True):
    return WorkerInfo(worker_id=wid, role="decode", num_free_blocks=free, num_total_blocks=total,
                      num_running=running, ready=ready)


def p(wid, queued, ready=True):
    return WorkerInfo(worker_id=wid, role="prefill", queued_prompt_tokens=queued, ready=ready)


def test_decode_prefers_load_then_free_blocks_and_skips_not_ready():
    s = WorkerSelector()
    ws = [d("a", 10), d("b", 90), d("c", 90, running=5), d("x", 100, ready=False)]
    # a and b are idle: b has more free blocks; c is busier than both
    assert [w.worker_id for w in s.ranked_decode(ws, needed_blocks=1)] == ["b", "a", "c"]
    # a worker that cannot fit the prompt goes last
    assert [w.worker_id for w in s.ranked_decode(ws, needed_blocks=50)] == ["b", "c", "a"]
    assert [w.worker_id for w in s.ranked_decode([d("a", 10), d("b", 5)], needed_blocks=8)] == ["a", "b"]


def test_in_flight_spreads_a_burst_before_heartbeats():
    s = WorkerSelector()
    ws = [d("a", 50), d("b", 50)]
    first = s.ranked_decode(ws, 1)[0].worker_id
    s.acquire(first)
    second = s.ranked_decode(ws, 1)[0].worker_id
    assert second != first
    s.release(first)
    assert s.in_flight(first) == 0


def test_burst_spreads_even_when_reported_free_blocks_differ():
    # the registry still reports b as emptier (its record predates the requests this router just sent it)
    s = WorkerSelector()
    ws = [d("a", 40), d("b", 60)]
    assert s.ranked_decode(ws, 1)[0].worker_id == "b"
    s.acquire("b")
    assert s.ranked_decode(ws, 1)[0].worker_id == "a"


def test_prefill_by_queued_tokens_including_ours():
    s = WorkerSelector()
    ws = [p("a", 100), p("b", 10), p("c", 0, ready=False)]
    assert [w.worker_id for w in s.ranked_prefill(ws)] == ["b", "a"]
    s.acquire("b", prompt_tokens=500)
    assert [w.worker_id for w in s.ranked_prefill(ws)] == ["a", "b"]
    s.release("b", prompt_tokens=500)
    assert [w.worker_id for w in s.ranked_prefill(ws)] == ["b", "a"]


def test_static_source_filters_roles_and_calls_live_infos():
    calls = []

    def live():
        calls.append(1)
        return d("live", 3)

    src = StaticWorkerSource([p("p0", 0), live])
    assert [w.worker_id for w in src.list("decode")] == ["live"]
    assert [w.worker_id for w in src.list("prefill")] == ["p0"]
    assert len(calls) == 2
    src.remove_where("p0")
    assert src.list("prefill") == []
    with pytest.raises(ValueError, match="role"):
        src.list("bogus")


def test_decode_ties_are_drawn_at_random_so_routers_do_not_herd():
    import random

    from router.selection import shuffle_leading_ties

    # four idle decode workers with (nearly) the same free blocks: every router sees the same view at once
    ws = [d("a", 90), d("b", 88), d("c", 95), d("e", 90)]
    rng = random.Random(7)
    firsts = [WorkerSelector().ranked_decode(ws, 1, rng)[0].worker_id for _ in range(200)]
    assert set(firsts) == {"a", "b", "c", "e"}  # tie-by-id would give "c" (most free) every time
    assert max(firsts.count(w) for w in "abce") < 90  # about 50 each
    # what is not a tie stays ordered: a busier worker, one that cannot fit, much fewer free blocks
    s = WorkerSelector()
    ws = [d("a", 90), d("b", 30), d("c", 90, running=1), d("x", 5)]
    for _ in range(30):
        assert [w.worker_id for w in s.ranked_decode(ws, 10, rng)] == ["a", "b", "c", "x"]  # load, then free blocks
    two = [d("a", 90), d("b", 90)]
    s.acquire("a")  # this router's own in-flight request breaks the tie
    assert all(s.ranked_decode(two, 1, rng)[0].worker_id == "b" for _ in range(20))
    # without an rng: by worker id, as before
    assert [w.worker_id for w in WorkerSelector().ranked_decode([d("b", 90), d("a", 90)], 1)] == ["a", "b"]
    assert shuffle_leading_ties(ws, lambda w: 0, None) is ws
