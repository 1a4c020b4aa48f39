"""pdserve's benchmarks: one script per question, each printing ratios against a reference run in the same sitting.

Run a flat script as ``python benchmarks/<name>.py`` (or ``python -m benchmarks.<name>``) from the checkout, the
soak as ``python -m benchmarks.soak``; ``bash scripts/setup`` installs the checkout in editable mode, which makes
this package importable from anywhere, so no script edits ``sys.path``. What several scripts share lives in
``benchmarks.harness`` (machine info, deployments, trace replay, JSON results); a script never imports another
script's private helpers. Nothing outside ``benchmarks/`` and ``tests/`` imports this package (tests/test_layering.py).
Results are recorded in docs/benchmarks.md (the current table per benchmark) and docs/benchmarks/history.md.
"""
