"""The metrics table of docs/pipeline.md, generated from the declaration in services/metrics.py.

    python scripts/metrics_table.py           # rewrite the table in docs/pipeline.md
    python scripts/metrics_table.py --check   # exit 1 if it is out of date

The table goes between the `<!-- metrics-table:start -->` and `<!-- metrics-table:end -->` lines;
tests/services/test_metrics.py fails when it differs from `services.metrics.markdown_table()`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.metrics import markdown_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "pipeline.md"
START = "<!-- metrics-table:start -->"
END = "<!-- metrics-table:end -->"


def with_table(doc: str) -> str:
    """`doc` with the text between the markers replaced by the current table."""
    before, start, rest = doc.partition(START)
    _, end, after = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the doc needs the lines {START} and {END}")
    return f"{before}{START}\n{markdown_table()}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--doc", type=Path, default=DOC, help="the Markdown file (docs/pipeline.md)"
    )
    parser.add_argument("--check", action="store_true", help="only check that it is up to date")
    args = parser.parse_args(argv)
    doc = args.doc.read_text(encoding="utf-8")
    try:
        updated = with_table(doc)
    except ValueError as error:
        print(f"error: {args.doc}: {error}", file=sys.stderr)
        return 1
    if updated == doc:
        return 0
    if args.check:
        print(
            f"{args.doc}: the metrics table is out of date; run `python scripts/metrics_table.py`",
            file=sys.stderr,
        )
        return 1
    args.doc.write_text(updated, encoding="utf-8")
    print(f"updated the metrics table of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
