"""The machine a benchmark ran on, as its report records it.

Lifecycle: a benchmark script calls ``machine_info(device)`` once at its start and writes the dict beside its
numbers (docs/benchmarks.md asks every figure for its machine and load). Nothing is cached: the load average is
the one at the call.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict:
    """CPU model, cores this process may use and cores present, Python, platform, torch's version, the 1/5/15-minute
    load averages at the call, and the GPU's name for a CUDA ``device``."""
    import torch

    info = {"cpu": cpu_model(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "torch": torch.__version__, "loadavg_start": [round(x, 2) for x in os.getloadavg()], "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info
