"""The pieces of ``benchmarks/cuda_engine.py`` (the script and its docstring say what is measured):
``checkpoint`` (shapes, workloads, the random checkpoint, prompts), ``context`` (the run's state and report),
``parity`` (phase 1) and ``speed`` (phases 2 and 3, the card's ceilings)."""
