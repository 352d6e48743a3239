"""No function of the service or the algorithm runs over 80 lines (benchmarks and tests are
exempt): a longer one does several things that each deserve a name and a test of their own.

Counted from `def` to the function's last line, docstring and comments included, as a reader
meets it; every module of services/ and kpo_core/ is parsed (`ast`), nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("kpo_core", "services")
MAX_LINES = 80


def long_functions(root: Path) -> list[str]:
    found = []
    for package in CHECKED:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    assert node.end_lineno is not None
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        where = path.relative_to(root)
                        found.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_of_services_or_kpo_core_is_over_80_lines() -> None:
    assert long_functions(REPO_ROOT) == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "services").mkdir()
    (tmp_path / "kpo_core").mkdir()
    (tmp_path / "services" / "long.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "kpo_core" / "short.py").write_text("def short():\n    return 1\n")
    assert long_functions(tmp_path) == [f"services/long.py:1 long: {MAX_LINES + 1} lines"]
