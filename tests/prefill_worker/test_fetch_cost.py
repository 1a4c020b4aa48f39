"""FetchCost: receive a prefix when that is estimated faster than computing it, from measured rates; probe now and
then once refusing, so the estimate follows the load."""
from __future__ import annotations

import pytest

from prefill_worker.fetch_cost import DEFAULT_OVERHEAD_S, MIN_OBSERVED_TOKENS, PROBE_EVERY, FetchCost


def test_an_unmeasured_worker_fetches_and_then_follows_its_measurements():
    c = FetchCost(alpha=1.0)
    assert c.worth(64) and c.decide(64)  # nothing measured: fetch, and measure it
    c.observe_prefill(100, 0.5)  # 5 ms a computed token (a CPU engine)
    assert c.worth(64)  # no fetch measured yet
    c.observe_fetch(64, 0.012, 0.004)  # wire 62.5 us a token, 8 ms beyond the wire
    assert c.receive_s(64) == pytest.approx(0.008 + 0.004) and c.compute_s(64) == pytest.approx(0.32)
    assert c.worth(64) and c.worth(2)  # 8 ms + 0.125 ms < 10 ms
    assert not c.worth(1)  # one token: the overhead dominates
    c.observe_prefill(1000, 0.05)  # now 50 us a computed token (a fast engine)
    assert not c.worth(64) and not c.worth(100000)  # 62.5 us on the wire > 50 us computed, whatever the length


def test_means_move_by_alpha_and_bad_measurements_are_ignored():
    c = FetchCost(alpha=0.5)
    c.observe_prefill(100, 10.0)
    c.observe_prefill(100, 30.0)
    assert c.compute_s_per_token == pytest.approx(0.2)
    c.observe_prefill(0, 1.0)
    c.observe_prefill(100, 0.0)
    c.observe_prefill(MIN_OBSERVED_TOKENS - 1, 1.0)  # a short prefill: mostly the step's fixed cost
    c.observe_fetch(0, 1.0, 1.0)
    assert c.compute_s_per_token == pytest.approx(0.2) and c.wire_s_per_token is None
    assert c.overhead_s == DEFAULT_OVERHEAD_S
    with pytest.raises(ValueError, match="alpha"):
        FetchCost(alpha=0)


def test_a_refusing_worker_probes_once_in_probe_every():
    c = FetchCost(alpha=1.0)
    c.observe_prefill(1000, 0.01)  # 10 us a token computed
    c.observe_fetch(100, 0.02, 0.01)  # 100 us a token on the wire
    decisions = [c.decide(64) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2
    assert decisions[PROBE_EVERY - 1] and decisions[2 * PROBE_EVERY - 1]
