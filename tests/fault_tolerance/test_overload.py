"""Overload answers RESOURCE_EXHAUSTED, fast: three times the router's admission bound at once gives only OK
and RESOURCE_EXHAUSTED (never UNKNOWN or INTERNAL), every admitted request equals the offline engine's
output, the rejections are counted by code, and every KV block is free afterwards. Real router, workers, gloo."""
from __future__ import annotations

import concurrent.futures as cf
from collections import Counter

import grpc
import torch

from engine import SamplingParams
from tests.roles.harness import collect, counter_values, joined, offline, start_roles

BOUND = 4
KW = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


def _errors_by_code(roles) -> dict[str, float]:
    return counter_values(roles.router.metrics, "pdserve:request_errors", "code")


def test_three_times_the_bound_gives_only_ok_and_resource_exhausted():
    torch.set_num_threads(1)
    prompts = [f"def load_{i}(x):" for i in range(3 * BOUND)]
    want = offline(prompts, [SamplingParams(**KW)] * len(prompts))
    roles = start_roles(tag="ovl-", router=dict(max_num_requests=BOUND))

    def one(i: int):
        try:
            return "OK", joined(collect(roles.stub, timeout=120, prompt=prompts[i], **KW)), i
        except grpc.RpcError as e:
            return e.code().name, e.details(), i

    try:
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            results = list(ex.map(one, range(len(prompts))))
        codes = Counter(r[0] for r in results)
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert codes["OK"] >= 1 and codes["RESOURCE_EXHAUSTED"] >= 1, codes
        for code, out, i in results:
            if code == "OK":
                assert out == want[i][:3]
            else:
                assert f"router queue is full ({BOUND} requests in flight" in out
        assert _errors_by_code(roles).get("RESOURCE_EXHAUSTED") == codes["RESOURCE_EXHAUSTED"]
        assert roles.wait_idle(10.0) and roles.router.num_in_flight == 0
        # the excess is refused, not lost: retried once the burst is over, it is served
        assert joined(collect(roles.stub, prompt=prompts[0], **KW)) == want[0][:3]
    finally:
        roles.close()


def test_oversized_requests_are_refused_while_normal_ones_are_served():
    """Callers flooding the router with 3.9 MB prompts and 10,000 stop strings get INVALID_ARGUMENT (refused
    before any tokenizing or stop matching, tests/router/test_limits.py), while a normal request beside them
    is served equal to the offline engine."""
    import threading

    torch.set_num_threads(1)
    want = offline(["def ok():"], [SamplingParams(**KW)])[0]
    roles = start_roles(tag="big-")
    huge = ("x = 1\n" * 700_000)[:3_900_000]
    codes: list[str] = []
    stop = threading.Event()

    def flood(kind: str) -> None:
        kw = dict(prompt=huge, max_tokens=4) if kind == "prompt" else dict(prompt="a", stop=["s" * 390] * 10_000)
        while not stop.is_set():
            try:
                collect(roles.stub, timeout=60, **kw)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)

    floods = [threading.Thread(target=flood, args=(k,), daemon=True) for k in ("prompt", "prompt", "stops")]
    try:
        for t in floods:
            t.start()
        got = [joined(collect(roles.stub, timeout=60, prompt="def ok():", **KW)) for _ in range(3)]
        assert got == [want[:3]] * 3
    finally:
        stop.set()
        for t in floods:
            t.join(60)
        roles.close()
    assert codes and set(codes) == {"INVALID_ARGUMENT"}, Counter(codes)
