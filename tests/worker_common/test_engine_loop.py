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
