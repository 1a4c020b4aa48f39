"""proto/ is the wire contract: it imports nothing of the project (conversions live with the side that owns them)."""
from __future__ import annotations

import ast
from pathlib import Path

PROJECT = {"engine", "router", "prefill_worker", "decode_worker", "worker_common", "kvtransfer", "cluster",
           "metrics", "loadtest", "benchmarks"}


def _imports(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


def test_proto_imports_nothing_of_the_project():
    proto = Path(__file__).resolve().parents[2] / "proto"
    bad = {p.name: sorted(_imports(p) & PROJECT) for p in proto.glob("*.py") if _imports(p) & PROJECT}
    assert bad == {}


def test_router_imports_no_engine_internals():
    router = Path(__file__).resolve().parents[2] / "router"
    internal = {}
    for p in router.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine."):
                internal.setdefault(p.name, []).append(node.module)
    assert internal == {}  # the router uses `from engine import ...` (the engine's public names) only
