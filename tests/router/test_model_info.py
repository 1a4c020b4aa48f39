"""The router reads its model view (config, tokenizer, limits) without importing the model stack.

Each check runs in a fresh interpreter, so what another test imported cannot hide an import.
What must stay out is the model, its attention and kernels, and the engine loop; torch itself is
checked by test_router_without_torch.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_STACK = ("engine.model", "engine.attention", "engine.kernels", "engine.llm_engine", "engine.scheduler",
               "engine.model_runner", "engine.llm")

PROBE = """
import json, sys
{imports}
print(json.dumps(sorted(m for m in sys.modules if m.startswith("engine"))))
"""


def _engine_modules(imports: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"probe failed:\n{out.stderr}")
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("imports", [
    "import router.model_info",
    "import router.server",
    "from router.config import RouterConfig\nfrom router.model_info import load_model_view\n"
    "tok, limits = load_model_view(RouterConfig(model='tiny'))\nassert limits.vocab_size > 0 and tok is not None",
], ids=["import-model-info", "import-server", "load-model-view"])
def test_router_model_view_leaves_the_model_stack_out(imports: str) -> None:
    loaded = _engine_modules(imports)
    assert "engine" in loaded  # the probe saw the engine at all
    assert sorted(loaded & set(MODEL_STACK)) == []


def test_probe_sees_the_model_stack_when_it_is_loaded() -> None:
    # the same probe on the engine's loader proper: it must report the stack, or the test above proves nothing
    loaded = _engine_modules("from engine.loader import load_model; import engine.model")
    assert "engine.model" in loaded
