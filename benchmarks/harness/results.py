"""A benchmark's JSON result: its numbers with the machine and command they came from.

Lifecycle: ``write_json`` once at a script's end (or after each point, for partial results).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from loadtest.machine import machine_info

__all__ = ["machine_info", "write_json"]


def write_json(path: Path | str, result: dict, *, machine: dict | None = None, indent: int = 1) -> Path:
    """Write ``result`` to ``path`` (parents made), with ``machine`` (``machine_info()`` when not given) and
    ``argv`` added where the result lacks them; values JSON cannot hold are written as strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = dict(result)
    out.setdefault("machine", machine if machine is not None else machine_info())
    out.setdefault("argv", sys.argv[1:])
    path.write_text(json.dumps(out, indent=indent, default=str))
    return path
