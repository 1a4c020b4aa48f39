"""EngineLoop around a real tiny engine: commands on its thread, errors to the caller, outputs, stop, death."""
from __future__ import annotations

import threading

import pytest

from engine.sampling_params import SamplingParams
from tests.waiting import wait_until
from worker_common.engine_loop import EngineLoop

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _offline(engine, prompt: list[int]) -> list[int]:
    engine.add_request("ref", prompt, GREEDY)
    got: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.extend(o.new_token_ids)
    return got


def test_call_runs_on_the_loop_thread_and_returns_its_result(tiny_engine):
    loop = EngineLoop(tiny_engine, "t1", on_outputs=lambda outs: None)
    loop.start()
    try:
        name, eng = loop.call(lambda e: (threading.current_thread().name, e))
        assert name == "t1-engine" and eng is tiny_engine
        assert loop.call(lambda e: e.num_free_blocks) == 16
    finally:
        loop.stop()
    assert not loop.alive


def test_call_raises_the_commands_exception_and_the_loop_goes_on(tiny_engine):
    loop = EngineLoop(tiny_engine, "t2", on_outputs=lambda outs: None)
    loop.start()
    try:
        with pytest.raises(ValueError, match="prompt"):  # the engine's own check, raised in the caller
            loop.call(lambda e: e.add_request("bad", [], GREEDY))
        loop.post(lambda e: 1 / 0)  # a failing posted command is logged, not fatal
        assert loop.call(lambda e: "still here") == "still here"
        assert loop.alive and loop.error is None
    finally:
        loop.stop()


def test_posted_commands_run_in_order_before_a_later_call(tiny_engine):
    seen: list[int] = []
    loop = EngineLoop(tiny_engine, "t3", on_outputs=lambda outs: None)
    loop.start()
    try:
        for i in range(5):
            loop.post(lambda e, i=i: seen.append(i))
        loop.call(lambda e: None)
        assert seen == [0, 1, 2, 3, 4]
    finally:
        loop.stop()


def test_step_outputs_reach_on_outputs_and_equal_the_offline_run(tiny_engine):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    prompt = [5, 17, 42, 7, 99]
    want = _offline(LLMEngine(EngineConfig(model="tiny", num_kv_blocks=16, num_threads=1)), prompt)
    got: list[int] = []
    done = threading.Event()
    polls: list[int] = []

    def on_outputs(outs) -> None:
        for o in outs:
            got.extend(o.new_token_ids)
            if o.finish_reason:
                done.set()

    loop = EngineLoop(tiny_engine, "t4", on_outputs=on_outputs, poll=lambda: polls.append(1) or False)
    loop.start()
    try:
        loop.call(lambda e: e.add_request("r", prompt, GREEDY))
        assert done.wait(30)
        assert got == want and len(want) == 6
        assert polls  # the role's poll runs every pass
    finally:
        loop.stop()


def test_stop_fails_commands_still_queued(tiny_engine):
    loop = EngineLoop(tiny_engine, "t5", on_outputs=lambda outs: None)
    loop.start()
    busy, release = threading.Event(), threading.Event()
    loop.post(lambda e: (busy.set(), release.wait(60)))  # hold the loop thread inside a command
    assert busy.wait(30)
    result: list = []

    def caller() -> None:
        try:
            result.append(loop.call(lambda e: "ran", timeout_s=60))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result.append(e)

    t = threading.Thread(target=caller)
    t.start()
    # the call is queued behind the blocked command (the loop took the blocker off the queue: it is empty till then)
    wait_until(lambda: loop._cmds.qsize() == 1, timeout=30.0, interval=0.005, message="the call queued")
    loop.stop(timeout_s=0.1)   # the thread is still inside the blocker: the join gives up, the queue is failed
    release.set()   # unstopped, the loop would now run the queued call ("ran")
    t.join(30)
    assert len(result) == 1 and isinstance(result[0], RuntimeError), result
    assert "stopped" in str(result[0])
    # the released command returns, then the thread ends
    wait_until(lambda: not loop.alive, timeout=30.0, interval=0.01, message="the loop thread ended")
    with pytest.raises(RuntimeError, match="not running"):
        loop.call(lambda e: 1)


def test_a_failing_step_kills_the_loop_and_reports_once(tiny_engine):
    def boom():
        raise RuntimeError("device lost")

    tiny_engine.step = boom  # fault injection on the real engine: its next step fails
    died: list[BaseException] = []
    loop = EngineLoop(tiny_engine, "t6", on_outputs=lambda outs: None, on_death=died.append)
    loop.start()
    loop.call(lambda e: e.add_request("r", [5, 6], GREEDY))  # the step after the add raises
    wait_until(lambda: not loop.alive, timeout=30.0, interval=0.01, message="the loop died")
    assert not loop.alive and isinstance(loop.error, RuntimeError) and died == [loop.error]
    with pytest.raises(RuntimeError, match="not running"):
        loop.call(lambda e: 1)


def _blocking_forward(engine):
    """Wrap the runner so each forward waits for ``release``; ``entered`` is set while one waits."""
    entered, release = threading.Event(), threading.Event()
    inner = engine.runner.execute

    def execute(sched, hook=None):
        entered.set()
        assert release.wait(60), "the test never released the forward"
        return inner(sched, hook)

    engine.runner.execute = execute
    return entered, release


def test_beside_reserves_blocks_while_a_step_runs_its_forward_and_tokens_stay_equal(tiny_engine):
    prompt = list(range(3, 40))
    want = _offline(tiny_engine, prompt)
    entered, release = _blocking_forward(tiny_engine)
    got: list[int] = []
    loop = EngineLoop(tiny_engine, "tb", on_outputs=lambda outs: got.extend(
        t for o in outs if o.request_id == "r" for t in o.new_token_ids))
    loop.start()
    try:
        loop.call(lambda e: e.add_request("r", prompt, GREEDY))
        assert entered.wait(60)
        # the step is inside its forward: a call would wait for it, beside does not
        blocks, cached = loop.beside(lambda e: e.reserve_prompt("held", 20), timeout_s=30)
        assert len(blocks) == tiny_engine.block_manager.blocks_for(20) and cached == 0
        assert not release.is_set()
        with pytest.raises(TimeoutError):
            loop.call(lambda e: None, timeout_s=0.2)  # (what Reserve did before: stuck behind the forward)
        release.set()
        wait_until(lambda: len(got) == len(want), timeout=60, message="the request to finish")
        assert got == want  # what ran beside changed no token
        loop.beside(lambda e: e.abort_request("held"))
        assert loop.call(lambda e: e.num_free_blocks) == 16
    finally:
        release.set()
        loop.stop()
    assert tiny_engine.owner_lock is None  # a stopped loop hands the engine back unlocked


def test_beside_waits_while_the_loop_thread_works_outside_a_forward(tiny_engine):
    loop = EngineLoop(tiny_engine, "tw", on_outputs=lambda outs: None)
    loop.start()
    inside, leave = threading.Event(), threading.Event()
    try:
        loop.post(lambda e: (inside.set(), leave.wait(60)))
        assert inside.wait(60)
        with pytest.raises(TimeoutError):  # a command is engine work: beside must not run inside it
            loop.beside(lambda e: e.reserve_prompt("x", 4), timeout_s=0.2)
        leave.set()
        assert loop.beside(lambda e: e.reserve_prompt("x", 4), timeout_s=30)[1] == 0
    finally:
        leave.set()
        loop.stop()


def test_beside_on_an_engine_that_cannot_share_its_forward_is_a_call():
    class Remote:  # (an engine in its own process has no owner_lock)
        def has_unfinished_requests(self) -> bool:
            return False

    loop = EngineLoop(Remote(), "tr", on_outputs=lambda outs: None)
    loop.start()
    try:
        assert loop.beside(lambda e: threading.current_thread().name) == "tr-engine"
    finally:
        loop.stop()
