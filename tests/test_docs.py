"""docs/benchmarks.md stays a page of current tables, not a journal (issue 46): under its line budget, one
section per benchmark script, and every script it names exists. Dated runs belong in docs/benchmarks/history.md."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
MAX_LINES = 450


def test_benchmarks_page_stays_under_its_line_budget():
    n = len(BENCHMARKS_MD.read_text().splitlines())
    assert n <= MAX_LINES, (f"docs/benchmarks.md has {n} lines (budget {MAX_LINES}): move dated runs to "
                            "docs/benchmarks/history.md and keep one current table per benchmark")


def test_each_benchmark_has_one_section_and_the_scripts_it_names_exist():
    text = BENCHMARKS_MD.read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert len(headings) == len(set(headings)), "a benchmark has two sections"
    named = set(re.findall(r"`(benchmarks/[\w/]+\.py)`", text))
    assert named, "no benchmark script is named"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/benchmarks.md names scripts that do not exist: {missing}"
