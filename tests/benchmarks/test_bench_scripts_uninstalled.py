"""The learner benchmarks run as scripts where the project is not installed, as on the bare GPU
machine of scripts/gpu_check.sh (CUDA torch, transformers and a few wheels; no `pip install -e`).

Each run here is `python -S` (no site: no .pth file runs, so the editable install's finder that
maps kpo_core and services to this checkout is never installed) with PYTHONPATH holding only
the venv's site-packages, from a directory outside the repository. The fixture first shows that
`import kpo_core` fails in that setup while torch and transformers import, so a script that
works there found the project through its own sys.path, not through the install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
SITE_PACKAGES = sysconfig.get_paths()["purelib"]


def run_bare(arguments: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env.update(PYTHONPATH=SITE_PACKAGES, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-S", *arguments],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def neutral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory outside the repository, where the project is shown not to import."""
    cwd = tmp_path_factory.mktemp("bare")
    result = run_bare(["-c", "import torch, transformers; import kpo_core"], cwd)
    assert result.returncode != 0, "the project imports without its scripts' sys.path"
    assert "No module named 'kpo_core'" in result.stderr, result.stderr[-2000:]
    return cwd


@pytest.mark.parametrize(
    "script",
    ["bench_learner_speed.py", "bench_logprob_head.py", "bench_learner.py", "bench_shadow.py"],
)
def test_the_script_runs_without_the_project_installed(neutral: Path, script: str) -> None:
    result = run_bare([str(BENCHMARKS / script), "--help"], neutral)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_the_log_prob_head_benchmark_imports_and_counts_on_cpu(neutral: Path) -> None:
    # As bench_learner_speed imports it: only benchmarks/ put on sys.path by the caller.
    code = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import bench_logprob_head as b; "
        "print(b.count(b.Shape(16, 8, 100, 8, 32), 'fused')['products'])"
    )
    result = run_bare(["-c", code], neutral)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout) == pytest.approx(4.0)  # one product forward, three backward


def test_the_dry_run_plans_the_gpu_run_for_an_h100_without_cuda(neutral: Path) -> None:
    plan_json = neutral / "plan.json"
    result = run_bare(
        [str(BENCHMARKS / "bench_learner_speed.py"), "--dry-run", "--device", "cuda",
         "--memory-gib", "79", "--cases", "a,c,b", "--quick", "--json", str(plan_json)],
        neutral,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "cases a, c, b in this order" in out and "sized to 79.0 GiB" in out
    for row in ("a. 0.5B 64 x (128+1024)", "c. 0.5B 64 long-tailed", "b. 1.5B 32 x (128+4096)"):
        assert row in out
    assert "case b: the plain step peaked at 81.1 GiB on an H200" in out
    assert "over 79.0 GiB" in out and "micro_batch_tokens lowered to 8,448" in out
    plans = {p["case"]: p for p in json.loads(plan_json.read_text())["plan"]}
    assert list(plans) == ["a", "c", "b"]
    assert all(p["skip"] is None for p in plans.values())  # static memory fits 90% of 79 GiB
    b = plans["b"]
    assert (b["params"], b["rows_per_micro_batch"]) == (1_543_714_304, 3)
    assert b["static_gib"] == pytest.approx(18 * 1_543_714_304 / 2**30)
    assert b["projected_micro_batch_tokens"] == 8448 and b["projected_peak_gib"] < 79
