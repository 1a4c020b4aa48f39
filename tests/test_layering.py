"""Which package may import which: shared/DESIGN.md's dependency rules as a table, checked on every file.

Every ``import``/``from ... import`` of every module is read with ``ast`` (function-level and
``TYPE_CHECKING`` imports included: a lazy import is still a dependency), its top-level package
looked up, and any package not in the importer's row is a violation. ``TYPE_ONLY`` names the few
edges allowed for annotations alone (inside ``if TYPE_CHECKING:``), never at run time. The table is the one place
the rules live in code; change it together with DESIGN.md. ``benchmarks/`` (scripts at the top)
and ``tests/`` are not packages anyone may import.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, frozenset[str]] = {
    "proto": frozenset(),  # the wire contract: conversions live with the side that owns the types
    # runs alone (offline API, benchmarks); stands on transport for one thing: transport.gloo, which opens the
    # tensor-parallel group (engine/tensor_parallel.py) as it opens kvtransfer's pair groups
    "engine": frozenset({"transport"}),
    "transport": frozenset({"proto"}),  # ports, TLS, bearer auth, gRPC serving: the bottom both sides share
    "metrics": frozenset({"transport"}),
    "kvtransfer": frozenset({"metrics", "transport"}),
    "worker_common": frozenset({"engine", "kvtransfer", "proto", "metrics", "transport"}),
    "prefill_worker": frozenset({"worker_common", "engine", "kvtransfer", "proto", "metrics", "transport"}),
    "decode_worker": frozenset({"worker_common", "engine", "kvtransfer", "proto", "metrics", "transport"}),
    "router": frozenset({"engine", "proto", "metrics", "transport"}),
    "loadtest": frozenset({"proto", "transport"}),  # a client: it knows the wire, not the internals
    # the simulator measures costs through the roles themselves
    "simulator": frozenset({"engine", "router", "loadtest", "kvtransfer", "worker_common", "prefill_worker",
                            "decode_worker", "proto", "metrics", "transport"}),
}
TYPE_ONLY: dict[str, frozenset[str]] = {
    "metrics": frozenset({"engine"}),  # the engine's stats record it is handed (engine.stats), typed, not imported
}
LIBRARY = frozenset(ALLOWED) | {"cluster"}
ALLOWED["cluster"] = LIBRARY - {"cluster"}  # launches and wires everything
ALLOWED["benchmarks"] = LIBRARY  # scripts at the top
PROJECT = LIBRARY | {"benchmarks", "tests"}

ENGINE_PUBLIC_ONLY = frozenset({"router"})
"""Packages that may use the engine's public names only (``from engine import ...``), never ``engine.<module>``."""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str) -> list[tuple[int, str, bool]]:
    """(line, dotted module, type-only) of every absolute import in ``source``, at any depth; type-only: inside
    an ``if TYPE_CHECKING:`` body."""
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, id(node) in typing_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, id(node) in typing_only))
    return found


def violations(package: str, name: str, source: str) -> list[str]:
    """What ``source`` (file ``name`` of ``package``) imports against the table, one line per import."""
    bad = []
    for line, module, type_only in imports_of(source):
        top = module.split(".")[0]
        if top not in PROJECT or top == package:
            continue
        if type_only and top in TYPE_ONLY.get(package, ()):
            continue
        if top not in ALLOWED[package]:
            bad.append(f"{name}:{line}: {package} imports {module} (allowed: {sorted(ALLOWED[package])})")
        elif top == "engine" and package in ENGINE_PUBLIC_ONLY and module != "engine":
            bad.append(f"{name}:{line}: {package} imports {module}: use the engine's public names (from engine import)")
    return bad


def _files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "csrc" not in p.parts)


def test_every_package_of_the_table_exists():
    assert sorted(p for p in ALLOWED if not (ROOT / p).is_dir()) == []


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_table_allows(package: str) -> None:
    files = _files(package)
    assert files, f"{package}/ has no Python files"
    bad = [v for p in files for v in violations(package, str(p.relative_to(ROOT)), p.read_text())]
    assert bad == []


@pytest.mark.parametrize("package,source", [
    ("proto", "from engine import SamplingParams\n"),
    ("transport", "import worker_common.config\n"),
    ("engine", "def f():\n    from router.core import RouterCore\n"),  # a function-level import counts
    ("kvtransfer", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.model\n"),
    ("prefill_worker", "from decode_worker.choices import ChoiceGroup\n"),  # the roles never import each other
    ("decode_worker", "import prefill_worker\n"),
    ("worker_common", "from decode_worker import DecodeWorker\n"),  # nothing imports upward
    ("router", "from worker_common.request import RequestSet\n"),
    ("router", "from engine.model import CausalLM\n"),  # public names only
    ("loadtest", "from router.core import RouterCore\n"),
    ("metrics", "import kvtransfer\n"),
    ("cluster", "import benchmarks.soak\n"),
    ("simulator", "from tests.waiting import wait_until\n"),
    ("metrics", "from engine.stats import SchedulerStats\n"),  # type-only edges stay type-only
    ("metrics", "def f():\n    from engine import stats\n"),
])
def test_a_violation_is_caught(package: str, source: str) -> None:
    assert len(violations(package, "synthetic.py", source)) == 1


@pytest.mark.parametrize("package,source", [
    ("router", "from engine import SamplingParams\nimport grpc\nfrom router.core import RouterCore\n"),
    ("decode_worker", "def f():\n    from worker_common.request import RequestSet\n    from .choices import x\n"),
    ("cluster", "import simulator.plan\nfrom prefill_worker import PrefillWorker\n"),
    ("metrics", "import typing\nif typing.TYPE_CHECKING:\n    from engine.stats import SchedulerStats\n"),
])
def test_an_allowed_import_passes(package: str, source: str) -> None:
    assert violations(package, "synthetic.py", source) == []


def _benchmark_sibling_imports(name: str, source: str, siblings: frozenset[str]) -> list[str]:
    """Imports in a benchmark file that reach a sibling by its bare name (what a ``sys.path`` edit enables) and
    ``sys.path`` edits themselves: the package is imported as ``benchmarks.<name>`` (benchmarks/__init__.py)."""
    bad = [f"{name}:{line}: imports {module} by its bare name (use benchmarks.{module})"
           for line, module, _ in imports_of(source) if module.split(".")[0] in siblings]
    bad += [f"{name}:{node.lineno}: edits sys.path" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append")
            and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys"]
    return bad


def _benchmark_siblings() -> frozenset[str]:
    root = ROOT / "benchmarks"
    return frozenset(p.stem for p in root.glob("*.py") if p.stem != "__init__") | \
        frozenset(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


def test_benchmarks_are_one_package_without_sys_path_edits() -> None:
    siblings = _benchmark_siblings()
    assert {"harness", "soak", "serving_overhead"} <= siblings
    bad = [v for p in _files("benchmarks")
           for v in _benchmark_sibling_imports(str(p.relative_to(ROOT)), p.read_text(), siblings)]
    assert bad == []


@pytest.mark.parametrize("source", [
    "from disagg_plots import write_plots\n",
    "import harness\n",
    "import sys\nsys.path.insert(0, '/repo')\n",
])
def test_a_benchmark_sibling_import_is_caught(source: str) -> None:
    assert len(_benchmark_sibling_imports("synthetic.py", source, _benchmark_siblings())) == 1
