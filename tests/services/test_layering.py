"""Imports run one way: down the layers of services/ (docs/architecture.md), never up, never round.

Every module of services/ and kpo_core/ is parsed (`ast`, nothing imported), each import is mapped
to its unit (a package of services/, a module at the top of services/, or kpo_core), and an
import is allowed only when `LAYERS` says its unit may import the target's. Imports inside
functions and under `TYPE_CHECKING` count too: a lazy import is still a dependency. On top of
that, no import cycle may join two units, nor two modules of one package.
"""

from __future__ import annotations

import ast
import graphlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("kpo_core", "services")


# Each unit with the units it may import, lowest first: a unit names only units above it in this
# table, so the table is the layer picture and allows no cycle. Listed, not inherited: the
# learner may import the spec and the spec the generation registry, yet the learner may not
# import generation (they are peers under the pipeline).
def may(*units: str) -> frozenset[str]:
    return frozenset(units)


LAYERS: dict[str, frozenset[str]] = {
    # The pure algorithm: nothing of the service.
    "kpo_core": may(),
    # Leaves shared by every layer: the root package, the messages between actors, the metrics
    # record, what a run reports to its observers, token positions, durable file writes.
    "services": may(),
    "messages": may(),
    "metrics": may(),
    "observers": may(),
    "positions": may(),
    "durable_files": may(),
    "host_memory": may(),
    "http_listener": may(),
    "local_ray": may(),
    # What a model family's layers attend to, read from its config (learner, hf engine, checks).
    "model_layout": may(),
    # Building blocks with no knowledge of a run.
    "store": may(),
    "tools": may("kpo_core", "messages", "http_listener"),
    "weights": may(),
    "generation": may("messages", "positions", "model_layout", "tools", "weights"),
    # The built-in models' warm start measures them through the generation backend.
    "tasks": may("messages", "tools", "generation"),
    "reward": may("messages", "tasks"),
    # The run spec reads the registries (backends, verifiers, dataset formats, built-in models).
    "spec": may("kpo_core", "tools", "generation", "reward", "tasks"),
    # What a run is made of above the spec: the learner group, the trackers.
    "learner": may(
        "kpo_core",
        "messages",
        "host_memory",
        "positions",
        "durable_files",
        "model_layout",
        "spec",
        "weights",
        "reward",
    ),
    "tracking": may("observers", "spec"),
    # The data plane: the run driver.
    "pipeline": may(
        "services",
        "kpo_core",
        "messages",
        "metrics",
        "observers",
        "durable_files",
        "local_ray",
        "model_layout",
        "store",
        "tools",
        "weights",
        "tasks",
        "generation",
        "reward",
        "spec",
        "learner",
        "tracking",
    ),
    # The control plane: Ray jobs, then HTTP, then the command line over everything.
    "jobs": may("services", "local_ray", "store"),
    "api": may(
        "kpo_core",
        "metrics",
        "observers",
        "http_listener",
        "store",
        "tasks",
        "spec",
        "pipeline",
        "jobs",
    ),
    "cli": may(
        "kpo_core",
        "observers",
        "store",
        "tools",
        "tasks",
        "spec",
        "learner",
        "pipeline",
        "jobs",
        "api",
    ),
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, as `file:line`."""

    file: str  # relative to the scanned root, with forward slashes
    line: int
    module: str  # the importing module
    target: str  # the imported module (the deepest one of the tree it names)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """`services.X...` -> X; `services` -> services; `kpo_core...` -> kpo_core."""
    parts = module.split(".")
    if parts[0] != "services":
        return parts[0]
    return parts[1] if len(parts) > 1 else "services"


def scan(root: Path, packages: Sequence[str]) -> list[Import]:
    """Every import, anywhere in a module, of one of `packages`' modules by one of them."""
    files = {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }

    def resolve(name: str) -> str | None:
        # `from a.b import c` names module a.b.c when there is one, else a name in a.b.
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    imports: list[Import] = []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in packages:
                    continue
                target = resolve(name)
                if target is not None and target != module:
                    relative = path.relative_to(root).as_posix()
                    imports.append(Import(relative, node.lineno, module, target))
    return list(dict.fromkeys(imports))  # `from m import a, b`: one import of m


def rule_breaks(
    imports: Iterable[Import],
    layers: Mapping[str, frozenset[str]],
    exceptions: frozenset[tuple[str, str]] = frozenset(),
) -> list[str]:
    """Each import its unit may not make, saying whether it runs up or sideways."""
    order = list(layers)
    found: list[str] = []
    for imp in imports:
        source, target = unit_of(imp.module), unit_of(imp.target)
        if source == target or (imp.file, imp.target) in exceptions:
            continue
        if source not in layers or target not in layers:
            found.append(f"{imp}: {source if source not in layers else target} has no layer")
        elif target not in layers[source]:
            way = "upward" if order.index(target) > order.index(source) else "undeclared"
            found.append(f"{imp}: {way}, {source} may not import {target}")
    return found


def first_cycle(imports: Sequence[Import], node: str) -> list[Import]:
    """The imports around one cycle of the graph whose nodes are `node` ("unit" or "module")
    of each import's two ends; [] when there is none."""

    def ends(imp: Import) -> tuple[str, str]:
        if node == "unit":
            return unit_of(imp.module), unit_of(imp.target)
        return imp.module, imp.target

    first: dict[tuple[str, str], Import] = {}
    for imp in imports:
        source, target = ends(imp)
        if source != target:
            first.setdefault((source, target), imp)
    graph: dict[str, set[str]] = {}
    for source, target in first:
        graph.setdefault(source, set()).add(target)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        # The sorter's cycle lists nodes each a predecessor of the next (here: imported by
        # it), ending where it started.
        cycle: list[str] = error.args[1]
        return [first[(importer, imported)] for imported, importer in itertools.pairwise(cycle)]
    return []


def checked_imports() -> list[Import]:
    return scan(REPO_ROOT, CHECKED)


def test_the_layers_name_only_lower_layers() -> None:
    seen: set[str] = set()
    for unit, allowed in LAYERS.items():
        assert allowed <= seen, f"{unit} may import {sorted(allowed - seen)}, not below it"
        seen.add(unit)


def test_every_unit_has_a_layer_and_every_layer_a_unit() -> None:
    units = {
        unit_of(module_name(path, REPO_ROOT))
        for package in CHECKED
        for path in (REPO_ROOT / package).rglob("*.py")
    }
    assert units - LAYERS.keys() == set(), "add these to LAYERS, at the layer they belong to"
    assert LAYERS.keys() - units == set(), "these layers are gone from the tree"


def test_imports_run_down_the_layers() -> None:
    breaks = rule_breaks(checked_imports(), LAYERS)
    assert breaks == [], "imports against the layers:\n" + "\n".join(breaks)


def test_kpo_core_imports_nothing_of_the_service() -> None:
    reaching = [imp for imp in checked_imports() if imp.module.startswith("kpo_core")]
    assert [str(imp) for imp in reaching if unit_of(imp.target) != "kpo_core"] == []


@pytest.mark.parametrize("node", ["unit", "module"])
def test_no_import_cycle(node: str) -> None:
    cycle = first_cycle(checked_imports(), node)
    assert cycle == [], f"an import cycle between {node}s:\n" + "\n".join(map(str, cycle))


# --- the checker itself, on a tree made for it ----------------------------------------------------


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


SYNTHETIC_LAYERS = {"services": may(), "low": may(), "high": may("low")}


def test_the_checker_reports_an_upward_import_by_file_and_line(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/low/__init__.py": "",
            "services/low/base.py": "import os\n\n\ndef f():\n    from ..high import top\n",
            "services/high/__init__.py": "",
            "services/high/top.py": "from services.low.base import f\n",
        },
    )
    imports = scan(tmp_path, ["services"])
    assert rule_breaks(imports, SYNTHETIC_LAYERS) == [
        "services/low/base.py:5 imports services.high.top: upward, low may not import high"
    ]
    # The same import is let through when it is a listed exception.
    exception = frozenset({("services/low/base.py", "services.high.top")})
    assert rule_breaks(imports, SYNTHETIC_LAYERS, exception) == []


def test_the_checker_reports_an_undeclared_sideways_import(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "services/a/__init__.py": "",
            "services/b/__init__.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from services.a import x\n",
            "services/a/x.py": "",
        },
    )
    layers = {"a": may(), "b": may()}
    assert rule_breaks(scan(tmp_path, ["services"]), layers) == [
        "services/b/__init__.py:3 imports services.a.x: undeclared, b may not import a"
    ]


def test_the_checker_finds_cycles_between_units_and_between_modules(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "services/low/__init__.py": "",
            "services/low/base.py": "def build():\n    from services.low import impl\n",
            "services/low/impl.py": "from services.low.base import build\n",
            "services/low/up.py": "import services.mid\n",
            "services/mid/__init__.py": "from services import high\n",
            "services/high/__init__.py": "from services.low import base\n",
        },
    )
    imports = scan(tmp_path, ["services"])
    units = first_cycle(imports, "unit")
    assert {(imp.file, imp.target) for imp in units} == {
        ("services/low/up.py", "services.mid"),
        ("services/mid/__init__.py", "services.high"),
        ("services/high/__init__.py", "services.low.base"),
    }
    modules = first_cycle(imports, "module")
    assert {(imp.file, imp.line, imp.target) for imp in modules} == {
        ("services/low/base.py", 2, "services.low.impl"),
        ("services/low/impl.py", 1, "services.low.base"),
    }
    cut = ("services/low/impl.py", "services/low/up.py")
    acyclic = [imp for imp in imports if imp.file not in cut]
    assert first_cycle(acyclic, "unit") == [] and first_cycle(acyclic, "module") == []
