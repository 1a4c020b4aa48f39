"""pdserve's profiler, discrete-event simulator and capacity planner (``pdserve profile|simulate|plan``).

The simulator runs pdserve's own policy objects (the engine's ``Scheduler`` and
``BlockManager``, the router's ``WorkerSelector``, prefix index and conditional
disaggregation rule) on a virtual clock, with step, transfer and router costs from a
profile measured on real hardware (``simulator.costs``).
"""
from importlib.metadata import PackageNotFoundError, version

try:
    PDSERVE_VERSION = version("pdserve")
except PackageNotFoundError:  # run from a checkout that was never installed
    PDSERVE_VERSION = "0.1.0"
