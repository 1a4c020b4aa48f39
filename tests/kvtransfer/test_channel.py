"""The seam between an endpoint and its channels: a ``ChannelHost``, no endpoint.

Channels are built here on a host whose ``finished`` records what it is told,
so these tests pin that every transfer a channel ends (deadline, close) is
reported there once, FAILED with its reason, and dropped from the channel.
"""
import threading
import time

import pytest
import torch

from kvtransfer import InprocStore, TransferState
from kvtransfer.channel import ChannelHost
from kvtransfer.channel_recv import RecvChannel
from kvtransfer.channel_send import SendChannel
from kvtransfer.layout import CacheLayout, TokenRows
from kvtransfer.rendezvous import Rendezvous
from kvtransfer.transfer import Transfer
from tests.kvtransfer.agent import CacheSpec, make_cache

torch.set_num_threads(1)


@pytest.fixture
def host():
    ended: list[tuple[Transfer, TransferState, str | None]] = []
    lock = threading.RLock()

    def finished(t: Transfer) -> None:
        ended.append((t, t.state, t.failure))

    h = ChannelHost("d0", "inproc", 3.0, 4096, lock, Rendezvous(InprocStore(), "kvt", "d0"), finished)
    return h, ended


def _transfer(h: ChannelHost, direction: str, deadline_s: float) -> Transfer:
    caches = make_cache(CacheSpec(num_layers=2, num_blocks=4, block_size=4))
    layout = CacheLayout.of(caches)
    return Transfer(1, direction, "p0", "r1", caches, layout, TokenRows(layout, [0, 1], 6, "block_ids"),
                    time.monotonic() + deadline_s, h.lock)


def test_recv_deadline_fails_through_host_finished(host):
    h, ended = host
    ch = RecvChannel(h, "p0")
    try:
        t = _transfer(h, "recv", 0.05)
        with h.lock:
            ch.post(t)
        ch.reap(time.monotonic() + 1.0)
        assert [(x, s) for x, s, _ in ended] == [(t, TransferState.FAILED)]
        reason = ended[0][2]
        assert reason.startswith("deadline exceeded") and "waiting for the sender" in reason and "'p0'" in reason
        assert t.transfer_id not in ch.live and "r1" not in ch.posted
        ch.reap(time.monotonic() + 2.0)
        assert len(ended) == 1  # reported once
    finally:
        ch.close()
        ch.join(2.0)
    assert len(ended) == 1


def test_send_close_fails_through_host_finished(host):
    h, ended = host
    ch = SendChannel(h, "p0")
    t = _transfer(h, "send", 5.0)
    with h.lock:
        ch.add(t)
    ch.close("going away")
    ch.join(2.0)
    assert ended == [(t, TransferState.FAILED, "going away")]
    assert not ch.live
    ch.close("again")
    assert len(ended) == 1
