"""API keys with names and limits: the table a server checks bearer tokens against, and the file it comes from.

Lifecycle: a server builds its key source once: ``KeyTable.plain(keys)`` for keys given on the command line
(each its own name, no limits), or ``KeysFile(path)`` for a TOML file of named keys with limits. Every
authentication and quota check asks the source to ``identify`` the presented token; a ``KeysFile`` looks at the
file's modification time at most once a second and, when it changed, reads it again and swaps the whole table
at once, so keys are added, rotated (a new key under the same name shares that name's quota, the old one is
removed later) and revoked without a restart. A file that no longer parses is logged and the last good table
stays in force: a typo never opens the server or locks everybody out.

The file (TOML; names are what logs, metrics and errors show, never the keys themselves)::

    [[key]]
    name = "team-a"
    key = "pdk-...."            # the bearer token clients send
    requests_per_s = 5          # optional limits: absent = unlimited
    tokens_per_min = 60000      #   prompt + max_tokens charged at admission, unused tokens refunded at the end
    max_concurrent = 8          #   requests in flight at once

Limits are per deployment: a router enforces its share (``router.quotas``).
"""
from __future__ import annotations

import hmac
import logging
import math
import os
import re
import threading
import time
import tomllib
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
LIMIT_FIELDS = ("requests_per_s", "tokens_per_min", "max_concurrent")


@dataclass(frozen=True)
class KeyLimits:
    """What one key's name may use (None: unlimited)."""

    requests_per_s: Optional[float] = None
    tokens_per_min: Optional[int] = None
    max_concurrent: Optional[int] = None

    @property
    def unlimited(self) -> bool:
        return self.requests_per_s is None and self.tokens_per_min is None and self.max_concurrent is None


@dataclass(frozen=True)
class ApiKey:
    """One accepted bearer token, the name it is known by, and that name's limits."""

    name: str
    secret: bytes = field(repr=False)
    limits: KeyLimits = KeyLimits()


def bearer_token(value: Union[str, bytes, None]) -> bytes:
    """The token of an ``authorization: Bearer <token>`` value (b"" when there is none)."""
    if not value:
        return b""
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return raw[7:].strip() if raw[:7].lower() == b"bearer " else b""


class KeyTable:
    """An immutable set of keys; ``identify`` compares a token with every key in constant time."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = tuple(keys)

    @classmethod
    def plain(cls, secrets: Iterable[str]) -> "KeyTable":
        """Keys without limits (``--api-key``): each is named ``key-<i>`` in the order given."""
        return cls(ApiKey(f"key-{i}", s.encode()) for i, s in enumerate(s for s in secrets if s))

    def __len__(self) -> int:
        return len(self.keys)

    def identify(self, presented: bytes) -> Optional[ApiKey]:
        """The key ``presented`` is, or None. Every key is compared, so timing says nothing about which matched."""
        found = None
        for k in self.keys:
            if hmac.compare_digest(presented, k.secret):
                found = k
        return found


def _limit(entry: dict, name: str, where: str) -> Optional[float]:
    v = entry.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}.{name} must be a number > 0, got {v!r}")
    if name != "requests_per_s" and v != int(v):
        raise ValueError(f"{where}.{name} must be a whole number, got {v!r}")
    return float(v) if name == "requests_per_s" else int(v)


def parse_keys(text: str, source: str) -> KeyTable:
    """A ``KeyTable`` from the TOML text of a keys file; ValueError naming ``source`` and the entry otherwise."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source}: not valid TOML ({e})") from None
    unknown = set(doc) - {"key"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level entries {sorted(unknown)} (only [[key]] tables)")
    entries = doc.get("key", [])
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: no [[key]] entries")
    keys, secrets = [], set()
    for i, e in enumerate(entries):
        where = f"{source}: key[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where} must be a table")
        extra = set(e) - {"name", "key", *LIMIT_FIELDS}
        if extra:
            raise ValueError(f"{where}: unknown fields {sorted(extra)}")
        name, secret = e.get("name"), e.get("key")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"{where}.name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
        if not isinstance(secret, str) or len(secret) < 8 or any(c.isspace() for c in secret):
            raise ValueError(f"{where}.key (name {name!r}) must be at least 8 characters without whitespace "
                             f"(value not shown)")
        if secret in secrets:
            raise ValueError(f"{where}.key (name {name!r}) is listed twice")
        secrets.add(secret)
        limits = KeyLimits(*(_limit(e, f, where) for f in LIMIT_FIELDS))
        keys.append(ApiKey(name, secret.encode(), limits))
    by_name: dict[str, KeyLimits] = {}
    for k in keys:  # rotation: one name may have several keys, which share its limits: they must agree
        if by_name.setdefault(k.name, k.limits) != k.limits:
            raise ValueError(f"{source}: the keys named {k.name!r} give different limits; a name has one set")
    return KeyTable(keys)


class KeysFile:
    """A keys file, read at start (errors raise) and again whenever it changes (errors are logged, the last good
    table stays)."""

    CHECK_EVERY_S = 1.0

    def __init__(self, path: str, extra: Optional[KeyTable] = None) -> None:
        """``extra``: keys accepted beside the file's (``--api-key``), unnamed in it and unlimited."""
        self.path = os.fspath(path)
        self._extra = extra if extra is not None else KeyTable(())
        self._lock = threading.Lock()
        self._stamp = self._mtime()
        self._table = self._read()
        self._checked = time.monotonic()
        self.reloads = 0
        """Successful re-reads after the first."""
        self.reload_errors = 0

    def _mtime(self) -> tuple[int, int]:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise ValueError(f"api keys file {self.path}: {e.strerror}") from None
        return st.st_mtime_ns, st.st_size

    def _read(self) -> KeyTable:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"api keys file {self.path}: cannot be read ({e})") from None
        return parse_keys(text, f"api keys file {self.path}")

    @property
    def table(self) -> KeyTable:
        now = time.monotonic()
        if now - self._checked >= self.CHECK_EVERY_S:
            self.reload_if_changed(now)
        return self._table

    def reload_if_changed(self, now: Optional[float] = None) -> bool:
        """Re-read the file if its mtime or size changed; True when a new table took effect."""
        with self._lock:
            self._checked = time.monotonic() if now is None else now
            try:
                stamp = self._mtime()
                if stamp == self._stamp:
                    return False
                self._stamp = stamp  # a broken edit is reported once, and read again when it changes
                table = self._read()
            except ValueError as e:
                self.reload_errors += 1
                log.error("%s; keeping the %d keys in force", e, len(self._table))
                return False
            self._table = table
            self.reloads += 1
            log.info("api keys file %s reloaded: %d keys, %d names", self.path, len(table),
                     len({k.name for k in table.keys}))
            return True

    def __len__(self) -> int:
        return len(self.table) + len(self._extra)

    def identify(self, presented: bytes) -> Optional[ApiKey]:
        in_file, extra = self.table.identify(presented), self._extra.identify(presented)  # both: constant time
        return in_file or extra


KeySource = Union[KeyTable, KeysFile]


def key_source(api_keys: Iterable[str] = (), api_keys_file: Optional[str] = None) -> Optional[Any]:
    """The source a server checks tokens against: the file when given, else the plain keys, else None (open)."""
    table = KeyTable.plain(api_keys)
    if api_keys_file:
        return KeysFile(api_keys_file, table)
    return table if len(table) else None
