"""Regenerate the committed Python code for every ``proto/*.proto``.

Run ``python -m proto.generate`` from the repository root after editing a
``.proto``; ``--check`` compiles into a temp dir and exits 1 if the committed
files differ (the stale-code test calls ``generate`` the same way).
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent


def generate(out_root: Path) -> list[Path]:
    """Compile all protos into ``out_root/proto/``; return the generated files."""
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    (out_root / "proto").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_root / "proto").iterdir() if p.suffix in (".py", ".pyi"))


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing beside) the protos."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [p.name for p in fresh
                if not (PROTO_DIR / p.name).exists() or not filecmp.cmp(p, PROTO_DIR / p.name, shallow=False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="only report stale files")
    ns = ap.parse_args()
    if ns.check:
        stale = stale_files()
        if stale:
            print("stale generated files:", ", ".join(stale))
            return 1
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
