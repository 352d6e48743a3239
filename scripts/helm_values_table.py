"""The values table of a Helm chart's README, generated from the `# --` comments of values.yaml.

The convention is helm-docs' (as in the KubeRay charts): a comment block starting with `# --`
right above a key documents that key, continuation lines are further `#` lines. A documented key
is one row of the table, with its default as it stands in values.yaml; its children (the fields
of `resources`, say) are part of that default and need no comment of their own. Every other key
must be a mapping whose children are all documented: a value without a `# --` comment is an
error, so the chart cannot grow an undocumented value.

    python scripts/helm_values_table.py helm/kpo           # rewrite the table in README.md
    python scripts/helm_values_table.py helm/kpo --check   # exit 1 if it is out of date

The table goes between the `<!-- values-table:start -->` and `<!-- values-table:end -->` lines of
the chart's README.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

START = "<!-- values-table:start -->"
END = "<!-- values-table:end -->"
_DOC_START = re.compile(r"^\s*# -- ?(.*)$")
_DOC_MORE = re.compile(r"^\s*# ?(.*)$")
_KEY = re.compile(r"^(\s*)([^\s#:-][^:]*|\"[^\"]+\"):(?:\s|$)")


@dataclass(frozen=True)
class Row:
    key: str  # dotted path
    description: str


class UndocumentedValues(ValueError):
    """values.yaml has values that no `# --` comment covers."""


def documented_keys(text: str) -> list[Row]:
    """The documented keys of a values.yaml text, in file order."""
    rows: list[Row] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    pending: list[str] | None = None  # the `# --` block being read
    opaque_indent: int | None = None  # inside a documented key's value: no more rows
    for line in text.splitlines():
        if not line.strip():
            continue
        start, more = _DOC_START.match(line), _DOC_MORE.match(line)
        if start:
            pending = [start.group(1).strip()]
            continue
        if more:
            if pending is not None:
                pending.append(more.group(1).strip())
            continue
        indent = len(line) - len(line.lstrip())
        if opaque_indent is not None:
            if indent > opaque_indent or line.lstrip().startswith("- "):
                continue
            opaque_indent = None
        key_match = _KEY.match(line)
        if key_match is None:
            pending = None
            continue
        key = key_match.group(2).strip('"')
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(k for _, k in stack), key])
        if pending is not None:
            rows.append(Row(path, " ".join(p for p in pending if p)))
            opaque_indent = indent
            pending = None
        else:
            stack.append((indent, key))
    return rows


def leaves(values: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every value that is not a non-empty mapping."""
    if isinstance(values, dict) and values:
        return [
            path
            for key, child in values.items()
            for path in leaves(child, f"{prefix}.{key}" if prefix else str(key))
        ]
    return [prefix]


def lookup(values: Any, path: str) -> Any:
    for key in path.split("."):
        values = values[key]
    return values


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return "null"


def table(values_text: str) -> str:
    """The Markdown table of a values.yaml text; raises UndocumentedValues."""
    rows = documented_keys(values_text)
    values = yaml.safe_load(values_text) or {}
    covered = {row.key for row in rows}
    missing = [
        leaf
        for leaf in leaves(values)
        if not any(leaf == key or leaf.startswith(f"{key}.") for key in covered)
    ]
    if missing:
        raise UndocumentedValues("values without a `# --` comment: " + ", ".join(missing))
    lines = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for row in rows:
        value = lookup(values, row.key)
        default = json.dumps(value, separators=(", ", ": ")).replace("|", "\\|")
        description = row.description.replace("|", "\\|")
        lines.append(f"| `{row.key}` | {type_name(value)} | `{default}` | {description} |")
    return "\n".join(lines)


def with_table(readme: str, values_text: str) -> str:
    """`readme` with the text between the markers replaced by the current table."""
    before, start, rest = readme.partition(START)
    _, end, after = rest.partition(END)
    if not start or not end:
        raise ValueError(f"README.md needs the lines {START} and {END}")
    return f"{before}{START}\n{table(values_text)}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chart", type=Path, help="chart directory (holds values.yaml, README.md)")
    parser.add_argument("--check", action="store_true", help="only check that it is up to date")
    args = parser.parse_args(argv)
    readme_path = args.chart / "README.md"
    readme = readme_path.read_text(encoding="utf-8")
    try:
        updated = with_table(readme, (args.chart / "values.yaml").read_text(encoding="utf-8"))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if updated == readme:
        return 0
    if args.check:
        print(
            f"{readme_path}: the values table is out of date; run "
            f"`python scripts/helm_values_table.py {args.chart}`",
            file=sys.stderr,
        )
        return 1
    readme_path.write_text(updated, encoding="utf-8")
    print(f"updated the values table of {readme_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
