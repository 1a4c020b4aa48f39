"""Start real role servers on loopback for the role tests, and the offline reference.

``start_roles(kv=...)`` builds prefill and decode workers (real engines on the
``tiny`` model, real gRPC servers on free ports) and a router in front of them
with a StaticWorkerSource; ``kv="gloo"`` uses kvtransfer's gloo backend over a torch
TCPStore on a free port, ``kv="inproc"`` its same-process backend.
``offline(...)`` runs the same prompts through the engine alone: the reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
import torch

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2, pdserve_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from tests.waiting import wait_until


# The KV transport the role tests use: the real kvtransfer ("gloo") unless noted.
KV = "gloo"


def engine_config(**kw: Any) -> EngineConfig:
    base = dict(model="tiny", num_kv_blocks=256, num_threads=1, max_num_batched_tokens=512)
    base.update(kw)
    return EngineConfig(**base)


@dataclass
class Roles:
    prefills: list
    decodes: list
    router: RouterServer
    source: StaticWorkerSource
    channel: grpc.Channel
    stub: pdserve_pb2_grpc.PDServeStub
    store: Any = None
    extra: list = field(default_factory=list)

    def close(self) -> None:
        self.channel.close()
        self.router.stop()
        for w in [*self.prefills, *self.decodes, *self.extra]:
            w.stop()

    def idle(self) -> bool:
        """Every worker holds no request and all its blocks are free."""
        return all(not w.requests and w.info().num_free_blocks == w.info().num_total_blocks
                   for w in [*self.prefills, *self.decodes])

    def busy(self) -> list[str]:
        """What keeps the workers from idle: each worker's held request ids and blocks in use."""
        out = []
        for w in [*self.prefills, *self.decodes]:
            info = w.info()
            if w.requests or info.num_free_blocks != info.num_total_blocks:
                out.append(f"{w.cfg.worker_id}: requests {sorted(w.requests)[:5]}, "
                           f"{info.num_total_blocks - info.num_free_blocks} blocks in use")
        return out

    def wait_idle(self, timeout_s: float = 1.0) -> bool:
        """Wait until ``idle()``; True, or AssertionError naming what is still busy after ``timeout_s``."""
        wait_until(self.idle, timeout=timeout_s, interval=0.01,
                   message=lambda: f"workers idle (still busy: {self.busy()})")
        return True


_STORES: list = []  # TCPStore servers stay up for the test session (cheap; each on its own free port)


def make_store(kv: str = KV) -> Any:
    """The kv_store a worker config gets: a tcp:// URL of a fresh TCPStore served by this process.

    A URL, not the Store object: each endpoint then opens its own client, so two endpoints in
    one process never wait on each other through one shared client connection.
    """
    if kv == "inproc":
        from kvtransfer import InprocStore

        return InprocStore()
    st = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _STORES.append(st)
    return f"tcp://127.0.0.1:{st.port}"


def start_roles(kv: str = KV, n_prefill: int = 1, n_decode: int = 1, engine: Optional[dict] = None,
                decode_engine: Optional[dict] = None, router: Optional[dict] = None,
                transfer_timeout_s: float = 10.0, tag: str = "", metrics: bool = False,
                worker: Optional[dict] = None) -> Roles:
    """``worker``: extra fields of every worker's config."""
    P, D = PrefillWorker, DecodeWorker
    store = make_store(kv)
    backend = kv
    prefills, decodes = [], []
    try:
        for i in range(n_prefill):
            prefills.append(P(PrefillWorkerConfig(f"{tag}p{i}", engine=engine_config(**(engine or {})), kv_store=store,
                                                  kv_backend=backend, transfer_timeout_s=transfer_timeout_s,
                                                  serve_metrics=metrics, **(worker or {}))).start())
        for i in range(n_decode):
            decodes.append(D(DecodeWorkerConfig(f"{tag}d{i}", engine=engine_config(**(decode_engine or engine or {})),
                                                kv_store=store, kv_backend=backend,
                                                transfer_timeout_s=transfer_timeout_s,
                                                serve_metrics=metrics, **(worker or {}))).start())
        source = StaticWorkerSource([w.info for w in [*prefills, *decodes]])
        r = RouterServer(RouterConfig(serve_metrics=metrics, **(router or {})), source).start()
    except BaseException:
        for w in [*prefills, *decodes]:
            w.stop()
        raise
    ch = grpc.insecure_channel(r.address)
    return Roles(prefills, decodes, r, source, ch, pdserve_pb2_grpc.PDServeStub(ch), store)


def start_colocated(n: int = 1, engine: Optional[dict] = None, router: Optional[dict] = None,
                    tag: str = "", metrics: bool = False, worker: Optional[dict] = None) -> Roles:
    from decode_worker import ColocatedWorker, ColocatedWorkerConfig

    workers = []
    try:
        for i in range(n):
            workers.append(ColocatedWorker(ColocatedWorkerConfig(f"{tag}c{i}", engine=engine_config(**(engine or {})),
                                                                 serve_metrics=metrics, **(worker or {}))).start())
        source = StaticWorkerSource([w.info for w in workers])
        r = RouterServer(RouterConfig(serve_metrics=False, mode="colocated", **(router or {})), source).start()
    except BaseException:
        for w in workers:
            w.stop()
        raise
    ch = grpc.insecure_channel(r.address)
    return Roles([], workers, r, source, ch, pdserve_pb2_grpc.PDServeStub(ch))


def collect(stub: pdserve_pb2_grpc.PDServeStub, timeout: float = 60.0, **kw: Any) -> list[pdserve_pb2.GenerateResponse]:
    return list(stub.Generate(pdserve_pb2.GenerateRequest(**kw), timeout=timeout))


def joined(resps: list) -> tuple[list[int], str, str]:
    return ([t for r in resps for t in r.token_ids], "".join(r.text for r in resps), resps[-1].finish_reason)


_OFFLINE: dict = {}


def offline(prompts: list, params: list[SamplingParams]) -> list:
    """engine.LLM("tiny").generate: (token_ids, text, finish_reason, logprobs) per prompt."""
    outs = _offline_llm().generate(prompts, params)
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs]


def offline_beams(prompt: list, params: Any) -> list:
    """engine.LLM("tiny").beam_search on one prompt (token ids): its ranked ``BeamSearchSequence``s."""
    return _offline_llm().beam_search([prompt], params)[0].sequences


def _offline_llm() -> Any:
    from engine import LLM

    llm = _OFFLINE.get("tiny")
    if llm is None:
        llm = _OFFLINE["tiny"] = LLM(model="tiny", num_kv_blocks=256, num_threads=1)
    return llm


def counter_values(metrics: Any, name: str, label: Optional[str] = None) -> dict[str, float]:
    """A Prometheus counter's ``_total`` values read from ``metrics.render()`` (what /metrics serves), keyed by
    ``label``'s value ("" for all series summed when ``label`` is None); {} when the counter has no series."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        if fam.name != name:
            continue
        for smp in fam.samples:
            if smp.name.endswith("_total"):
                key = smp.labels[label] if label else ""
                out[key] = out.get(key, 0.0) + smp.value
    return out
