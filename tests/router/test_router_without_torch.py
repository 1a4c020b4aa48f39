"""The router process never imports torch: its modules, its model view, its beam search and its serving run without it.

The router reads the model's config and tokenizer (``router.model_info``), validates and tokenizes requests, and
ranks beam search candidates (``PromptBeamSearch.step_top``); none of that needs torch, whose import alone costs
a router ~0.8 s and ~190 MB. Each probe runs in a fresh interpreter, so what another test imported cannot hide an
import: one imports every ``router`` module, builds the built-in ``tiny`` model's view (config, tokenizer,
limits), validates a plain and a beam search request, and runs a whole cluster-style beam search over worker-like
top-2W rows, then reports ``sys.modules`` and its peak RSS. Another serves requests: real workers run in the test's
process (they need torch), and a router in a fresh interpreter where ``import torch`` raises ImportError (and is
recorded, in case some code would catch it and go on) serves greedy requests through them, disaggregated and
colocated, over gRPC and the HTTP API: a lazy ``import torch`` anywhere on the request path fails it.
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


# The router half of a deployment, in a fresh interpreter with torch blocked: stdin carries the workers' records
# (hex WorkerInfo bytes per mode); stdout gets the outputs, the torch imports tried, and torch's modules loaded.
SERVE_PROBE = r"""
import importlib.abc, json, sys

TRIED = []

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            TRIED.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the router must not import torch)",
                                      name=name)
        return None

sys.meta_path.insert(0, _NoTorch())

import urllib.request

import grpc

from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.worker_pb2 import WorkerInfo
from router import RouterConfig, RouterServer, StaticWorkerSource

spec = json.loads(sys.stdin.read())
out = {}
for mode, infos in spec["workers"].items():
    source = StaticWorkerSource([WorkerInfo.FromString(bytes.fromhex(h)) for h in infos])
    r = RouterServer(RouterConfig(mode=mode, serve_metrics=False, http_port=0), source).start()
    try:
        with grpc.insecure_channel(r.address) as ch:
            stub = pdserve_pb2_grpc.PDServeStub(ch)
            resps = list(stub.Generate(pdserve_pb2.GenerateRequest(
                prompt=spec["prompt"], max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True), timeout=60))
        body = json.dumps({"model": "tiny", "prompt": spec["prompt"], "max_tokens": spec["max_tokens"],
                           "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://{r.http_address}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as f:
            http = json.loads(f.read())
        out[mode] = {"token_ids": [t for x in resps for t in x.token_ids], "text": "".join(x.text for x in resps),
                     "finish_reason": resps[-1].finish_reason, "http_text": http["choices"][0]["text"],
                     "http_finish_reason": http["choices"][0]["finish_reason"]}
    finally:
        r.stop()
print(json.dumps({"out": out, "tried": TRIED,
                  "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def test_a_router_without_torch_serves_requests_disaggregated_and_colocated() -> None:
    import torch

    from engine.sampling_params import SamplingParams
    from tests.roles.harness import offline, start_colocated, start_roles

    torch.set_num_threads(1)
    prompt, n = "def add(a, b):", 6
    pair = start_roles(tag="notorch-")
    colo = start_colocated(tag="notorch-")
    try:
        spec = {"prompt": prompt, "max_tokens": n, "workers": {
            "disaggregated": [w.info().SerializeToString().hex() for w in pair.prefills + pair.decodes],
            "colocated": [w.info().SerializeToString().hex() for w in colo.decodes]}}
        proc = subprocess.run([sys.executable, "-c", SERVE_PROBE], cwd=ROOT, input=json.dumps(spec),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"the torch-less router failed:\n{proc.stderr[-4000:]}"
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert pair.wait_idle(30.0) and colo.wait_idle(30.0)
    finally:
        pair.close()
        colo.close()
    assert report["tried"] == [], f"the router tried to import torch: {report['tried'][:5]}"
    assert report["torch"] == []
    ids, text, reason, _ = offline([prompt], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)])[0]
    assert set(report["out"]) == {"disaggregated", "colocated"}
    for mode, got in report["out"].items():
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (ids, text, "length"), (mode, got)
        assert (got["http_text"], got["http_finish_reason"]) == (text, "length"), (mode, got)
