"""The Ray a cluster runs on: shared, joined, or a private local instance it owns; and the device it offers.

Lifecycle of a ``ClusterRay()``:

1. ``start(config, namespace)``: an already-initialized Ray in this process is shared (tests, an embedding
   app) and never shut down here; else ``config.ray_address`` is joined (``"auto"`` joins ``ray start`` or
   KubeRay: this process owns only its driver connection); else a private local instance starts in its own
   short temp dir (Ray's unix sockets live under it, and it keeps two clusters apart), with no dashboard and
   no prestarted idle workers (``NO_PRESTART``), and this object owns it. A detached cluster (its workers
   outlive this process) refuses to start a private Ray.
2. ``resolve_device(requested)``: "auto" becomes "cuda" when the Ray cluster offers GPUs, else "cpu".
3. ``shutdown()``: disconnects a Ray this object started or joined; for a private instance it also makes
   sure the processes ``ray.init`` spawned (GCS, raylet, their workers) are gone, killing stragglers, and
   removes the temp dir. Idempotent; a shared Ray is left alone.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Optional

import psutil
import ray

from cluster.config import ClusterConfig, resolve_device

log = logging.getLogger(__name__)

NO_PRESTART = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
"""A private Ray starts no idle Python workers ahead of need: pdserve's only Ray work is its worker actors, each with
a runtime env of its own (thread counts), which never reuse a default worker, so prestarted ones only cost CPU and
memory (measured 1 Dec on this 2-core box: two idle ``ray::IDLE`` processes, 0.5-0.6 CPU-s and 40 MB of their
own (78 MB resident) each, and their start beside the cluster's own)."""


class ClusterRay:
    """This cluster's connection to Ray (see module docstring)."""

    def __init__(self) -> None:
        self.owned = False
        """True when this object started or joined Ray (and so shuts its connection down)."""
        self._tmp: Optional[str] = None
        self._procs: list[psutil.Process] = []

    def start(self, config: ClusterConfig, namespace: str) -> None:
        """Share, join or start Ray for a cluster with ``config`` (see module docstring)."""
        if ray.is_initialized():  # this process already has Ray (tests, an embedding app): share, never shut down
            return
        if config.detached and config.ray_address is None:
            raise ValueError("detached workers need a Ray that outlives this process: give ray_address (pdserve "
                             "controller --address), or join Ray before start()")
        if config.ray_address is not None:
            ray.init(address=config.ray_address, namespace=namespace, log_to_driver=False)
            self.owned = True  # our driver connection; the Ray cluster itself outlives us
            return
        from cluster.config import pool_tp

        # every rank of a tensor-parallel worker is a CPU its actor reserves
        want = (config.num_prefill * pool_tp(config, "prefill") + config.num_decode * pool_tp(config, "decode")
                + config.num_colocated * pool_tp(config, "colocated"))
        num_cpus = config.ray_num_cpus or max(os.cpu_count() or 1, int(want * config.cpus_per_worker) + 2)
        # A short private temp dir: Ray's unix sockets live under it, and it keeps two clusters apart.
        self._tmp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
        before = {p.pid for p in psutil.Process().children()}
        ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=self._tmp,
                 namespace=namespace, logging_level="WARNING", log_to_driver=False,
                 _system_config=NO_PRESTART)
        self.owned = True
        # The processes ray.init just spawned (GCS, raylet, ...): shutdown() makes sure they and theirs are gone.
        self._procs = [p for p in psutil.Process().children() if p.pid not in before]

    @staticmethod
    def resolve_device(requested: str) -> tuple[str, float]:
        """(the device the workers use, the GPUs the Ray cluster offers) for ``requested`` ("auto", "cpu",
        "cuda"); ValueError for "cuda" without GPUs."""
        gpus = ray.cluster_resources().get("GPU", 0)
        return resolve_device(requested, gpus), gpus

    def shutdown(self) -> None:
        """Disconnect (and for a private instance, stop) the Ray this object started or joined."""
        if self.owned:
            self.owned = False
            self._shutdown()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _shutdown(self) -> None:
        # Collect descendants before shutdown: once the raylet exits its workers lose their parent link.
        procs: list[psutil.Process] = []
        for p in self._procs:
            try:
                procs += [p, *p.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        ray.shutdown()
        # Ray's workers exit on their own shortly after the raylet; wait, then kill stragglers, so
        # `pdserve up` never leaves a process behind.
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=2)
