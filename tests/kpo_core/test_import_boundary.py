"""kpo_core needs only torch, numpy, pydantic and the standard library (STYLE.md habit 1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kpo_core

ALLOWED = {"torch", "numpy", "pydantic", "kpo_core", "__future__"} | set(sys.stdlib_module_names)
PACKAGE = Path(kpo_core.__file__).parent


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_source_imports_only_allowed_packages() -> None:
    files = [p for p in PACKAGE.rglob("*.py") if "integrations" not in p.parts]
    assert len(files) >= 7
    offenders = {str(p.relative_to(PACKAGE)): imported_roots(p) - ALLOWED for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_kpo_core_loads_no_service_dependency() -> None:
    code = (
        "import sys, kpo_core.kalman, kpo_core.ratios, kpo_core.losses, kpo_core.config, "
        "kpo_core.advantages, kpo_core.diagnostics; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert "torch" in loaded
    assert not loaded & {"ray", "transformers", "fastapi", "redis", "vllm", "services", "yaml"}
