"""engine.client: both engines a worker can hold have the members the workers use (the contract written down).

``LLMEngine`` (in process) and the engine-process proxy ``RemoteEngine`` are both ``KVEngine``s (the proxy maps the
child's cache: ``RemoteEngine(kv=True)``). A member
dropped from either implementation, or one the workers start using without adding it here, fails these checks
(``runtime_checkable``: each member must exist on the live object)."""
from __future__ import annotations

import torch

from engine.client import EngineCore, KVEngine, PrefixCacheEvents
from tests.roles.harness import engine_config


def _members(proto: type) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    for base in proto.__mro__:
        if base.__module__ == "engine.client":
            names |= set(getattr(base, "__annotations__", {}))
            names |= {n for n, v in vars(base).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def test_the_in_process_engine_is_a_kv_engine():
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    eng = LLMEngine(engine_config())
    assert isinstance(eng, EngineCore) and isinstance(eng, KVEngine)
    assert isinstance(eng.block_manager, PrefixCacheEvents)
    missing = [n for n in _members(KVEngine) if not hasattr(eng, n)]
    assert missing == []


def test_the_engine_process_proxy_is_a_kv_engine_and_never_shares_the_forward():
    """``RemoteEngine`` has every member (a proxy started without ``kv`` refuses the KV calls at run time:
    tests/worker_common/test_engine_process.py); no ``owner_lock``, so the worker's loop never runs ``beside`` on
    another thread with the proxy's pipe."""
    from worker_common.engine_loop import EngineLoop
    from worker_common.engine_process import RemoteEngine

    torch.set_num_threads(1)
    remote = RemoteEngine(engine_config(), "client-test", kv=True).start()
    try:
        assert isinstance(remote, EngineCore) and isinstance(remote, KVEngine)
        assert isinstance(remote.block_manager, PrefixCacheEvents)
        assert [n for n in _members(KVEngine) if not hasattr(remote, n)] == []
        assert len(remote.kv_caches) > 0
        assert not hasattr(remote, "owner_lock") and not EngineLoop(remote, "t", lambda outs: None)._shares_forward
    finally:
        remote.shutdown()


def test_the_protocols_name_what_the_workers_call():
    """Every engine member the worker code reaches (``eng.x``, ``engine.x``, ``ctx.engine.x``) is in a protocol."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    used: set[str] = set()
    pattern = re.compile(r"\b(?:eng|engine|self\.engine|ctx\.engine|w\.engine|self\.ctx\.engine)\.([a-z_]+)\b")
    for pkg in ("worker_common", "prefill_worker", "decode_worker"):
        for f in (root / pkg).glob("*.py"):
            for line in f.read_text().splitlines():
                if line.lstrip().startswith(("from ", "import ", "#")) or '"""' in line or "``" in line:
                    continue
                used |= set(pattern.findall(line))
    # (lifecycle: the worker's, whichever engine it built; owner_lock: the in-process engine's, EngineLoop asks)
    known = _members(KVEngine) | {"shutdown", "close", "owner_lock"}
    assert sorted(used - known) == [], "engine members the workers use that engine.client does not name"
    assert {"add_request", "step", "reserve_prompt", "kv_caches"} <= used  # the scan sees the workers' calls


def test_step_result_is_one_object_of_outputs_load_and_events_on_both_engines():
    """``step_result()``: the step's outputs, the load after it (what the ``num_*`` counts and ``make_stats`` say
    then) and the prefix cache's events recorded up to it, taken (a second take is empty): in process and through
    the engine process alike, and the outputs equal."""
    from engine.block_manager import STORED
    from engine.client import EngineLoad, StepResult
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from worker_common.engine_process import RemoteEngine

    torch.set_num_threads(1)
    cfg = engine_config(enable_prefix_caching=True)
    remote = RemoteEngine(cfg, "step-result").start()
    try:
        got = {}
        for name, eng in (("local", LLMEngine(cfg)), ("remote", remote)):
            eng.block_manager.enable_events()
            eng.add_request("a", list(range(5, 5 + 2 * eng.block_size + 3)),
                            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            ids, events, loads = [], [], []
            while eng.has_unfinished_requests():
                res = eng.step_result()
                assert isinstance(res, StepResult) and isinstance(res.load, EngineLoad)
                assert res.load.num_free_blocks == eng.num_free_blocks
                assert res.load.num_total_blocks == eng.num_total_blocks
                assert (res.load.num_running, res.load.num_waiting) == (eng.num_running, eng.num_waiting)
                assert res.load.stats.num_steps == eng.make_stats().num_steps
                ids += [t for o in res.outputs for t in o.new_token_ids]
                events += res.events
                if res.outputs:  # (the engine process's step_result may return before the child stepped)
                    loads.append((any(o.finish_reason for o in res.outputs), res.load.num_running))
            assert eng.block_manager.take_events() == []  # step_result took them
            assert [e[0] for e in events].count(STORED) >= 1, events
            # the load after the step that made the outputs, not before it: running until the request finished
            assert loads and all(running == (0 if finished else 1) for finished, running in loads), loads
            got[name] = ids
        assert got["local"] == got["remote"] and len(got["local"]) == 4
    finally:
        remote.shutdown()
