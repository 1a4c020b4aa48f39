"""A model-free stand-in role for testing the launcher's pool mechanics alone.

Lifecycle: like the real roles: ``start()`` serves grpc.health.v1 on a free
loopback port (SERVING), ``info()`` reports a WorkerInfo, ``drain()`` flips
health to NOT_SERVING, waits for ``inflight`` to reach 0 and stops, ``stop()``
stops at once. It loads no model, so a launcher test takes seconds.
"""
from __future__ import annotations

import json
import os
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.worker_pb2 import WorkerInfo


class StandInWorker:
    """Serves only gRPC health; enough for placement, registry and drain tests."""

    def __init__(self, role: str, worker_id: str, cfg, kv_store, node_ip: str, node_id: str) -> None:
        self.role, self.worker_id, self.node_id = role, worker_id, node_id
        self.model_name = cfg.served_model_name
        # Tests steer the stand-in through a JSON file:
        # {"queued_prompt_tokens": n, "num_free_blocks": m, "start_delay_s": s, "starting_file": path}
        self.load_file = cfg.engine_overrides.get("load_file")
        self.inflight = 0
        self._draining = False
        self._server = None
        self._health = health.HealthServicer()
        self.address = ""

    def start(self) -> None:
        load = self._load()
        if load.get("starting_file"):  # tells a test that the actor is placed and inside start()
            with open(load["starting_file"], "a") as f:
                f.write(self.worker_id + "\n")
        time.sleep(load.get("start_delay_s", 0))  # a slow "model load", for stop-during-start tests
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.address = f"127.0.0.1:{port}"
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)

    def _load(self) -> dict:
        if self.load_file and os.path.exists(self.load_file):
            with open(self.load_file) as f:
                return json.load(f)
        return {}

    def info(self) -> WorkerInfo:
        load = self._load()
        return WorkerInfo(worker_id=self.worker_id, role=self.role, grpc_address=self.address,
                          kv_name=self.worker_id, model_name=self.model_name, num_total_blocks=64,
                          num_free_blocks=load.get("num_free_blocks", 64),
                          queued_prompt_tokens=load.get("queued_prompt_tokens", 0),
                          num_running=self.inflight, ready=not self._draining, block_size=16)

    def engine_failed(self) -> None:
        """A stand-in has no engine to fail (``RoleWorker``'s contract)."""
        return None

    def drain(self, timeout_s: float = 30.0) -> bool:
        self._draining = True
        self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        clean = self.inflight == 0
        self.stop()
        return clean

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0.2).wait()
            self._server = None
