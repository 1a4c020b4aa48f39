"""Per-key quotas (router.quotas) and the keys file they read (transport.api_keys), as units with a fake clock.

Expected numbers are worked by hand from the bucket rules: a requests bucket holds max(1, rps) and refills rps
per second; a tokens bucket holds tokens_per_min and refills a 60th of it per second; admission charges
prompt + max_tokens and the lease's release refunds what was not generated.
"""
from __future__ import annotations

import os
import time

import pytest

from router.quotas import QuotaBook, QuotaExceeded
from transport.api_keys import ApiKey, KeyLimits, KeysFile, KeyTable, bearer_token, parse_keys


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def key(name: str = "a", **limits) -> ApiKey:
    return ApiKey(name, f"secret-{name}".encode(), KeyLimits(**limits))


def test_requests_per_second_bucket_refills_and_says_when():
    clock = Clock()
    book = QuotaBook(clock=clock)
    k = key(requests_per_s=2)
    for _ in range(2):  # a full bucket: two at once
        book.admit(k, 1, 1).release(1)
    with pytest.raises(QuotaExceeded) as e:
        book.admit(k, 1, 1)
    assert "requests_per_s" in e.value.message and "'a'" in e.value.message
    assert e.value.retry_after_s == pytest.approx(0.5)  # one token at 2/s
    assert e.value.retry_after_header == "1"
    clock.t += 0.5
    book.admit(k, 1, 1).release(1)
    assert book.refused[("a", "requests_per_s")] == 1


def test_tokens_per_minute_charges_max_tokens_and_refunds_the_unused():
    clock = Clock()
    book = QuotaBook(clock=clock)
    k = key(tokens_per_min=600)  # 10 tokens a second
    lease = book.admit(k, 100, 400)  # 500 charged, 100 left
    with pytest.raises(QuotaExceeded) as e:
        book.admit(k, 50, 100)  # needs 150
    assert "tokens_per_min" in e.value.message
    assert e.value.retry_after_s == pytest.approx(5.0)  # 50 missing at 10/s
    lease.release(completion_tokens=100)  # 300 of the 400 unused: refunded -> 400 left
    book.admit(k, 50, 100).release(100)  # 150 of 400: fits
    with pytest.raises(QuotaExceeded) as e:
        book.admit(k, 500, 200)  # more than the whole bucket: can never pass
    assert e.value.retry_after_s is None and e.value.retry_after_header is None


def test_max_concurrent_counts_leases_in_flight():
    book = QuotaBook()
    k = key(max_concurrent=2)
    a, b = book.admit(k, 1, 1), book.admit(k, 1, 1)
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        book.admit(k, 1, 1)
    a.release(1)
    a.release(1)  # idempotent: one release per lease
    assert book.in_flight("a") == 1
    book.admit(k, 1, 1)
    b.release(None)
    assert book.in_flight("a") == 1


def test_each_router_enforces_its_share():
    book = QuotaBook(routers=4, clock=Clock())
    k = key(requests_per_s=8, tokens_per_min=4000, max_concurrent=6)
    assert book.share(k.limits) == (2.0, 1000.0, 1)  # 6 / 4 rounds down, but never below one


def test_a_refused_request_takes_nothing_and_other_names_are_independent():
    clock = Clock()
    book = QuotaBook(clock=clock)
    a, b = key("a", requests_per_s=1, tokens_per_min=60), key("b", requests_per_s=1)
    with pytest.raises(QuotaExceeded):
        book.admit(a, 100, 1)  # over the token bucket: the request token is not spent
    book.admit(a, 10, 1).release(1)
    book.admit(b, 10, 1).release(1)
    assert book.in_flight("a") == 0 and book.in_flight("b") == 0


def test_keys_without_limits_or_no_key_are_never_refused():
    book = QuotaBook()
    for _ in range(100):
        book.admit(None, 10**6, 10**6)
        book.admit(key("free"), 10**6, 10**6)
    assert book.refused == {}


FILE = '''
[[key]]
name = "team-a"
key = "pdk-aaaaaaaa"
requests_per_s = 5
tokens_per_min = 60000
max_concurrent = 8

[[key]]
name = "team-b"
key = "pdk-bbbbbbbb"
'''


def test_keys_file_parses_names_limits_and_identifies_in_constant_time():
    t = parse_keys(FILE, "keys.toml")
    a = t.identify(b"pdk-aaaaaaaa")
    assert a.name == "team-a" and a.limits == KeyLimits(5.0, 60000, 8)
    assert t.identify(b"pdk-bbbbbbbb").limits.unlimited
    assert t.identify(b"pdk-wrong") is None and t.identify(b"") is None
    assert bearer_token("Bearer pdk-aaaaaaaa") == b"pdk-aaaaaaaa" and bearer_token("Basic x") == b""
    assert KeyTable.plain(["k1", ""]).identify(b"k1").name == "key-0"


@pytest.mark.parametrize("text, field", [
    ("[[key]]\nname='a'\nkey='short'\n", "key[0].key"),
    ("[[key]]\nname='bad name'\nkey='pdk-aaaaaaaa'\n", "key[0].name"),
    ("[[key]]\nname='a'\nkey='pdk-aaaaaaaa'\nrequests_per_s=0\n", "key[0].requests_per_s"),
    ("[[key]]\nname='a'\nkey='pdk-aaaaaaaa'\nmax_concurrent=1.5\n", "key[0].max_concurrent"),
    ("[[key]]\nname='a'\nkey='pdk-aaaaaaaa'\nrate=3\n", "unknown fields ['rate']"),
    ("[[key]]\nname='a'\nkey='pdk-aaaaaaaa'\n[[key]]\nname='b'\nkey='pdk-aaaaaaaa'\n", "listed twice"),
    ("[[key]]\nname='a'\nkey='pdk-aaaaaaaa'\n[[key]]\nname='a'\nkey='pdk-cccccccc'\nmax_concurrent=2\n",
     "different limits"),
    ("keys = 3\n", "unknown top-level"),
    ("[[key]\n", "not valid TOML"),
])
def test_keys_file_errors_name_the_file_and_the_entry(text, field):
    with pytest.raises(ValueError) as e:
        parse_keys(text, "keys.toml")
    assert "keys.toml" in str(e.value) and field in str(e.value)
    assert "pdk-aaaaaaaa" not in str(e.value)  # a key's value never appears in an error


def _touch(path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a visible change whatever the clock


def test_keys_file_reloads_rotates_and_survives_a_broken_edit(tmp_path, caplog):
    path = tmp_path / "keys.toml"
    path.write_text(FILE)
    kf = KeysFile(str(path), extra=KeyTable.plain(["cli-key-1"]))
    assert kf.identify(b"pdk-aaaaaaaa").name == "team-a" and kf.identify(b"cli-key-1").name == "key-0"
    rotated = FILE.replace('name = "team-b"', 'name = "team-a"\nrequests_per_s = 5\ntokens_per_min = 60000\n'
                                                'max_concurrent = 8')  # team-a's second key, team-b's removed
    _touch(path, rotated)
    assert kf.reload_if_changed()
    assert kf.identify(b"pdk-bbbbbbbb").name == "team-a"  # the new key shares the name's quota
    _touch(path, "[[key]\nbroken")
    assert not kf.reload_if_changed()
    assert kf.reload_errors == 1 and "keeping the 2 keys" in caplog.text
    assert kf.identify(b"pdk-aaaaaaaa").name == "team-a"  # the last good table stays in force
    _touch(path, FILE.replace("pdk-aaaaaaaa", "pdk-revoked1").replace("team-b", "team-c"))
    kf._checked = time.monotonic() - 2 * KeysFile.CHECK_EVERY_S  # the next lookup checks the file
    assert kf.identify(b"pdk-aaaaaaaa") is None  # revoked without a restart
    assert kf.identify(b"pdk-bbbbbbbb").name == "team-c"
    with pytest.raises(ValueError, match="api keys file"):
        KeysFile(str(tmp_path / "missing.toml"))
