"""The README's reflection client (the gRPC client that needs no .proto file) runs as printed against a real
router and streams the offline engine's text."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from engine import SamplingParams
from tests.roles.harness import offline, start_roles

README = Path(__file__).resolve().parents[1] / "README.md"


def _reflection_block() -> str:
    text = README.read_text()
    m = re.search(r"<!-- reflection-client[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "the README lost its reflection-client block"
    return m.group(1)


def test_readme_reflection_client_streams_offline_text(tmp_path):
    torch.set_num_threads(1)
    script = tmp_path / "reflect.py"
    script.write_text(_reflection_block())
    want = offline(["def main():"], [SamplingParams(max_tokens=16, temperature=0.0)])[0][1]
    roles = start_roles(tag="readme-")
    try:
        out = subprocess.run([sys.executable, str(script), roles.router.address], capture_output=True, text=True,
                             timeout=120)
    finally:
        roles.close()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == want + "\n"
