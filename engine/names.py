"""Names a model is served under (no torch: configs and CLIs import this cheaply).

Lifecycle: stateless. Routers, workers and ``pdserve up`` call ``default_served_model_name`` when no
served name was given, so a filesystem path never reaches clients (ModelInfo, /v1/models) or metric labels.
"""
from __future__ import annotations

import os


def default_served_model_name(model: str) -> str:
    """The name a model is served under when none is given: a built-in name as it is, a model directory's
    basename ("/models/Qwen2.5-0.5B/" -> "Qwen2.5-0.5B"); the path itself never reaches clients or labels."""
    name = os.path.basename(os.path.normpath(os.path.expanduser(model)))
    return name if name not in ("", ".", "..", os.sep) else "model"
