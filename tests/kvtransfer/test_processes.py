"""KV transfer between real processes over gloo: bit-exact delivery, peers dying, bad headers.

Every agent is a spawned process with its own KVEndpoint; rendezvous is a
TCPStore this test process serves on a free port (``store_url``, conftest.py). Each test stops or kills
every agent it started in a finally block.
"""
import random

from tests.kvtransfer.agent import Agent, CacheSpec, wait_state
from tests.waiting import wait_until


def _start(*agents: Agent) -> list[Agent]:
    for a in agents:
        a.ready()
    return list(agents)


def _stop(agents: list[Agent]) -> None:
    for a in agents:
        a.stop()


# How long a test waits in an agent for a transfer to end: far past every transfer deadline here (<= 6 s). A wait
# that returns before it was ended by the transfer itself (its done event), not by the wait's own timeout (after
# which the agent's poll would expire an overdue transfer too, and report "deadline exceeded" all the same).
WAIT_S = 30.0


def test_three_processes_interleaved_per_layer_bit_identical(store_url):
    """A->C, B->C and A->B at once; block sizes 16, 4 and 8; layers interleaved across requests."""
    L = 3
    a = Agent("A", store_url, CacheSpec(num_layers=L, num_blocks=64, block_size=16, seed=1))
    b = Agent("B", store_url, CacheSpec(num_layers=L, num_blocks=256, block_size=4, seed=2))
    c = Agent("C", store_url, CacheSpec(num_layers=L, num_blocks=160, block_size=8))
    agents = [a, b, c]
    try:
        _start(*agents)
        rng = random.Random(0)
        # receiver-side block pools: B receives only into blocks 128.. (its own KV lives below)
        free = {"B": list(range(128, 256)), "C": list(range(160))}
        src_free = {"A": list(range(64)), "B": list(range(128))}
        for pool in (*free.values(), *src_free.values()):
            rng.shuffle(pool)
        plan = []  # (sender, receiver, rid, src_blocks, dst_blocks, tokens)
        for k in range(12):
            s, r = [("A", "C"), ("B", "C"), ("A", "B")][k % 3]
            n = rng.randint(1, 60)
            sbs = {"A": 16, "B": 4}[s]
            dbs = {"B": 4, "C": 8}[r]
            sb = [src_free[s].pop() for _ in range(-(-n // sbs))]
            db = [free[r].pop() for _ in range(-(-n // dbs))]
            plan.append((s, r, f"req{k}", sb, db, n))
        by = {"A": a, "B": b, "C": c}
        for s, r, rid, sb, db, n in reversed(plan):  # receives posted in the opposite order
            by[r].call("recv", rid, s, rid, db, n, 20.0)
        for s, r, rid, sb, db, n in plan:
            by[s].call("send", rid, r, rid, sb, n, [], 20.0)
        for layer in range(L):
            for s, r, rid, *_ in plan:
                by[s].call("layer", rid, layer)
        for s, r, rid, sb, db, n in plan:
            assert wait_state(by[s], rid, 20)[:2] == ("done", None)
            assert wait_state(by[r], rid, 20)[:2] == ("done", None)
            assert by[s].call("checksum", sb, n) == by[r].call("checksum", db, n), rid
        assert c.call("untouched", [(db, n) for s, r, rid, sb, db, n in plan if r == "C"])
        stats = {x[0]: x for x in a.call("stats")}
        row = 2 * 16 * 4
        assert stats["req0"][1] == "done" and stats["req0"][2] == L * 2 * plan[0][5] * row
    finally:
        _stop(agents)


def test_receiver_killed_mid_transfer_then_restarted(store_url):
    spec_p = CacheSpec(num_layers=3, num_blocks=32, block_size=16, seed=3)
    spec_d = CacheSpec(num_layers=3, num_blocks=64, block_size=8)
    p, d = Agent("P", store_url, spec_p), Agent("D", store_url, spec_d)
    agents = [p, d]
    try:
        _start(p, d)
        d.call("recv", "r1", "P", "r1", [1, 2, 3, 4], 30, 4.0)
        p.call("send", "r1", "D", "r1", [5, 6], 30, [0], 4.0)  # layer 0 goes; 1 and 2 never become ready
        wait_until(lambda: d.call("poll", "r1")[0] == "transferring", timeout=10.0, interval=0.01,
                   message=f"{d.name}:r1 reached transferring")
        d.kill()
        # the sender sees the pair broken, or (nothing in flight to notice with) its 4 s deadline passes
        state, failure, waited = wait_state(p, "r1", WAIT_S)
        assert state == "failed" and waited < WAIT_S, (failure, waited)
        assert "broken" in failure or "deadline" in failure
        d2 = Agent("D", store_url, spec_d)  # same name, new incarnation
        agents.append(d2)
        d2.ready()
        d2.call("recv", "r2", "P", "r2", [9, 8, 7, 6, 5], 33, 10.0)
        p.call("send", "r2", "D", "r2", [7, 8, 9], 33, "all", 10.0)
        assert wait_state(p, "r2", 15)[:2] == ("done", None)
        assert wait_state(d2, "r2", 15)[:2] == ("done", None)
        assert p.call("checksum", [7, 8, 9], 33) == d2.call("checksum", [9, 8, 7, 6, 5], 33)
    finally:
        _stop(agents)


def test_sender_killed_mid_transfer_receiver_fails_then_new_sender_works(store_url):
    spec_p = CacheSpec(num_layers=3, num_blocks=32, block_size=16, seed=4)
    spec_d = CacheSpec(num_layers=3, num_blocks=64, block_size=8)
    p, d = Agent("P", store_url, spec_p), Agent("D", store_url, spec_d)
    agents = [p, d]
    try:
        _start(p, d)
        d.call("recv", "r1", "P", "r1", [1, 2, 3, 4], 30, 6.0)
        d.call("recv", "r2", "P", "r2", [10, 11], 16, 20.0)  # posted, not yet started
        p.call("send", "r1", "D", "r1", [5, 6], 30, [0, 1], 6.0)
        wait_until(lambda: d.call("poll", "r1")[0] == "transferring", timeout=10.0, interval=0.01,
                   message=f"{d.name}:r1 reached transferring")
        p.kill()
        state, failure, waited = wait_state(d, "r1", WAIT_S)
        assert state == "failed" and waited < WAIT_S, (failure, waited)
        assert "connection to sender lost" in failure   # the lost connection, not its 6 s deadline
        assert d.call("poll", "r2") == ["pending", None] or d.call("poll", "r2") == ("pending", None)
        p2 = Agent("P", store_url, spec_p)
        agents.append(p2)
        p2.ready()
        p2.call("send", "r2", "D", "r2", [3], 16, "all", 10.0)
        assert wait_state(d, "r2", 15)[:2] == ("done", None)
        assert p2.call("checksum", [3], 16) == d.call("checksum", [10, 11], 16)
    finally:
        _stop(agents)


def test_dtype_mismatch_rejected_and_channel_keeps_working(store_url):
    spec_p = CacheSpec(num_layers=2, num_blocks=16, block_size=16, seed=5, alt_dtype="float16")
    spec_d = CacheSpec(num_layers=2, num_blocks=32, block_size=16)
    p, d = Agent("P", store_url, spec_p), Agent("D", store_url, spec_d)
    agents = [p, d]
    try:
        _start(p, d)
        d.call("recv", "bad", "P", "bad", [0, 1], 20, 5.0)
        p.call("send_alt", "bad", "D", "bad", [0, 1], 20, "all", 5.0)
        state, failure, _ = wait_state(p, "bad", 10)
        assert state == "failed" and "dtype mismatch" in failure and "float16" in failure
        state, failure, _ = wait_state(d, "bad", 10)
        assert state == "failed" and "dtype mismatch" in failure
        assert d.call("untouched", [])
        d.call("recv", "good", "P", "good", [2, 3], 20, 5.0)
        p.call("send", "good", "D", "good", [4, 5], 20, "all", 5.0)
        assert wait_state(p, "good", 10)[:2] == ("done", None)
        assert wait_state(d, "good", 10)[:2] == ("done", None)
        assert p.call("checksum", [4, 5], 20) == d.call("checksum", [2, 3], 20)
    finally:
        _stop(agents)


def test_hung_receiver_fails_sender_within_deadline_and_pair_recovers(store_url):
    import os
    import signal

    # 2048 tokens x 1 KiB rows: 4 MiB per layer, more than loopback socket buffers hold
    spec_p = CacheSpec(num_layers=3, num_blocks=128, block_size=16, num_kv_heads=4, head_dim=64, seed=6)
    spec_d = CacheSpec(num_layers=3, num_blocks=256, block_size=16, num_kv_heads=4, head_dim=64)
    p, d = Agent("P", store_url, spec_p), Agent("D", store_url, spec_d)
    agents = [p, d]
    blocks = list(range(128))
    try:
        _start(p, d)
        # the receiver's deadline (1.5 s) passes while it is stopped: loopback receive buffers autotune up to
        # tcp_rmem's max (32 MiB on the CI host), so the layers the sender gave up on may all be in flight already,
        # and a receiver still within its deadline would complete them after SIGCONT (the full suite on 27 Nov:
        # "done"); in a deployment a failed attempt is aborted on both of its workers (router/attempt.py), which
        # drops such a completed copy
        d.call("recv", "r1", "P", "r1", blocks, 2048, 1.5)
        p.call("send", "r1", "D", "r1", blocks, 2048, [0], 2.0)
        wait_until(lambda: d.call("poll", "r1")[0] == "transferring", timeout=10.0, interval=0.01,
                   message=f"{d.name}:r1 reached transferring")
        os.kill(d.proc.pid, signal.SIGSTOP)  # alive but not reading: a hung peer
        try:
            p.call("layer", "r1", 1)
            p.call("layer", "r1", 2)
            # failed at its 2 s deadline by the endpoint itself (its reaper), while the peer is still stopped:
            # not by the 5 s I/O timeout of the pair (another message), nor by the wait giving up
            state, failure, waited = wait_state(p, "r1", WAIT_S)
            assert state == "failed" and "deadline exceeded after 2.000 s" in failure, failure
            assert waited < WAIT_S, waited
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        state, failure, _ = wait_state(d, "r1", 10)
        assert state == "failed", failure  # pair broken under it, or its own deadline passed
        d.call("recv", "r2", "P", "r2", list(range(128, 256)), 2048, 10.0)
        p.call("send", "r2", "D", "r2", blocks, 2048, "all", 10.0)
        assert wait_state(p, "r2", 15)[:2] == ("done", None)
        assert wait_state(d, "r2", 15)[:2] == ("done", None)
        assert p.call("checksum", blocks, 2048) == d.call("checksum", list(range(128, 256)), 2048)
    finally:
        _stop(agents)
