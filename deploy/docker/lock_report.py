"""A hash lock from pip's installation report: one `name==version --hash=sha256:...` per package.

    python deploy/docker/lock_report.py REPORT.json "HEADER LINE" ["HEADER LINE" ...] > LOCK

REPORT.json is what `pip install --dry-run --report` wrote (every package pip would install, with
the wheel it chose); the header lines become the lock's leading comments. Used by
lock_gpu_worker.sh and lock_control_plane.sh, whose locks the images install with
`pip install --require-hashes --no-deps`.
"""

from __future__ import annotations

import json
import sys


def lock_text(report: dict[str, object], header: list[str]) -> str:
    rows = []
    for item in report["install"]:  # type: ignore[attr-defined]
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        rows.append((name.lower(), f"{name}=={version} \\\n    --hash=sha256:{digest}"))
    lines = [f"# {line}" for line in header] + [line for _, line in sorted(rows)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report_path, *header_lines = sys.argv[1:]
    with open(report_path, encoding="utf-8") as report_file:
        sys.stdout.write(lock_text(json.load(report_file), header_lines))
