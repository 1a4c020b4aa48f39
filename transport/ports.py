"""The one check for a TCP port number, used by every config, flag and server that takes one.

Lifecycle: a pure function called while validating a config or a command line, before anything binds.
"""
from __future__ import annotations

from typing import Optional


def check_port(value: object, field: str, *, allow_zero: bool = True, allow_none: bool = False,
               zero_means: str = "a free port") -> Optional[int]:
    """Return ``value`` if it is a port number, else raise ``ValueError`` naming ``field``.

    ``allow_zero``: 0 is accepted (and means ``zero_means``, which the message spells out);
    ``allow_none``: None is accepted and returned (an optional port that is off)."""
    if value is None and allow_none:
        return None
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 65535:
        extra = f" (0: {zero_means})" if allow_zero else ""
        none = "None or " if allow_none else ""
        raise ValueError(f"{field} must be {none}an integer port in [{low}, 65535]{extra}, got {value!r}")
    return value
