"""benchmarks/bench_integrations.py runs, at a small size, and reports every loss and trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_reports_each_loss_against_the_frameworks_own() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_integrations.py"),
            "--batch",
            "4",
            "--length",
            "32",
            "--completions",
            "4",
            "--completion-length",
            "8",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line.split("  ")[0]: line.split()[-1] for line in result.stdout.splitlines() if line}
    for name in ("kpo_core.token", "kpo_core.sequence", "kpo_core.geometric", "kpo", "ctpo"):
        assert rows[name].endswith("x"), result.stdout
    assert rows["vanilla"] == "1.00x"
    assert rows["GRPOTrainer"] == "1.00x"
    assert rows["KpoGRPOTrainer kalman (KPO)"].endswith("x")
