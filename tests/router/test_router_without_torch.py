"""The router process never imports torch: its modules, its model view and its beam search run without it.

The router reads the model's config and tokenizer (``router.model_info``), validates and tokenizes requests, and
ranks beam search candidates (``PromptBeamSearch.step_top``); none of that needs torch, whose import alone costs
a router ~0.8 s and ~190 MB. Each probe runs in a fresh interpreter, so what another test imported cannot hide an
import: it imports every ``router`` module, builds the built-in ``tiny`` model's view (config, tokenizer,
limits), validates a plain and a beam search request, and runs a whole cluster-style beam search over worker-like
top-2W rows, then reports ``sys.modules`` and its peak RSS.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, json, pkgutil, random, sys

import router
for m in pkgutil.iter_modules(router.__path__):
    importlib.import_module("router." + m.name)

from engine import PromptBeamSearch
from proto import pdserve_pb2
from router.config import RouterConfig
from router.model_info import load_model_view
from router.validation import validate_generate

tok, limits = load_model_view(RouterConfig(model="tiny"))
assert tok is not None and limits.vocab_size > 0
plain = validate_generate(pdserve_pb2.GenerateRequest(prompt="def main():", max_tokens=8), limits, tok.encode, tok)
beam = validate_generate(pdserve_pb2.GenerateRequest(prompt="import os", beam_width=3, max_tokens=4),
                         limits, tok.encode, tok)
W, V, rng = beam.beam.beam_width, limits.vocab_size, random.Random(0)
search = PromptBeamSearch(list(beam.prompt_token_ids), beam.beam.max_tokens, beam.beam, limits.eos_token_id)
class _B:
    def __init__(self, tokens):
        self.tokens = tokens
parents = [_B(list(beam.prompt_token_ids))]
first = True
while not search.done:
    tops = [[(t, -rng.random() * 5) for t in rng.sample(range(V), 2 * W)] for _ in parents]
    if first:
        tops, parents, first = tops * W, parents * W, False
    nxt = search.step_top(tops, parents)
    parents = [_B(p.tokens + [t]) for p, t in nxt]
seqs = search.results(tok)
assert len(seqs) == W and all(s.text is not None for s in seqs)
print(json.dumps({"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
                  "peak_rss_kb": PEAK()}))
"""
# this process's peak RSS: VmHWM belongs to the exec'd image (ru_maxrss would carry over the forking pytest's peak)
PEAK = r"""
def PEAK():
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except OSError:
        return None
"""


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK + code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"probe failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_router_modules_model_view_and_beam_search_leave_torch_out() -> None:
    report = _run(PROBE)
    assert report["torch"] == [], f"the router process imported torch: {report['torch'][:5]}"
    # and it shows: the whole router probe peaks below a bare ``import torch`` (measured here, on this machine)
    bare_torch = _run("import json, torch\nprint(json.dumps({'peak_rss_kb': PEAK()}))")
    if report["peak_rss_kb"] is not None and bare_torch["peak_rss_kb"] is not None:  # no /proc: no RSS check
        assert report["peak_rss_kb"] < bare_torch["peak_rss_kb"], (report, bare_torch)
