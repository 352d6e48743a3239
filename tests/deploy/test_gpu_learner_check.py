"""The GPU check's learner part on a bare machine (scripts/gpu_learner_check.py), on CPU.

`scripts/gpu_check.sh prepare` downloads the wheels for this interpreter (from the package index
the project installs from), and `scripts/gpu_check.sh learner --dry-run` runs in a virtualenv
that has only torch, transformers and what they need (tests/deploy/bare_python.py): it must
install the wheels, report the machine, resolve every import of tests/gpu and the benchmark
without the project installed, and print a plan within its budget. What cannot reach a GPU here
(phases killed at their cap with their children, the summary after each phase, the JUnit counts)
is driven with real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gpu_learner_check as check
import pytest

from tests.deploy.bare_python import bare_python

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("gpu-check") / "wheels"
    done = subprocess.run(
        ["bash", str(SCRIPT), "prepare", str(dest), "--python", THIS_PYTHON, "--platform",
         os.uname().machine],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bare_python(tmp_path_factory.mktemp("bare"))


def dry_run(bare: Path, wheels: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        ["bash", str(SCRIPT), "learner", "--dry-run", "--wheels", str(wheels), "--target",
         str(tmp_path / "site"), "--out", str(tmp_path / "out"), *flags],
        env={**environment, "PYTHON": str(bare)}, cwd=tmp_path, capture_output=True, text=True,
        check=False, timeout=600,
    )  # fmt: skip


def test_the_bare_python_has_torch_and_transformers_and_not_the_project(bare: Path) -> None:
    probe = "import importlib.util as u; print([bool(u.find_spec(m)) for m in %r])"
    modules = ["torch", "transformers", "pydantic", "pytest", "kpo_core"]
    done = subprocess.run(
        [str(bare), "-c", probe % modules], cwd="/", capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str([True, True, False, False, False])


def test_the_dry_run_installs_reports_resolves_every_import_and_plans_within_budget(
    bare: Path, wheels: Path, tmp_path: Path
) -> None:
    done = dry_run(bare, wheels, tmp_path, "--budget", "480", "--memory-gib", "79")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "import problem" not in output
    for reported in ("torch:", "transformers:", "c_compiler:", "python_h:", "varlen_attn:"):
        assert f"gpu_check: {reported}" in output, reported
    installed = {path.name.split("-")[0] for path in (tmp_path / "site").glob("*.dist-info")}
    assert {"pydantic", "pydantic_core", "pytest", "annotated_types", "xxhash", "zstandard"} <= (
        installed
    )
    assert "gpu_check: plan: tests: up to" in output
    assert "gpu_check: plan: benchmark: up to" in output
    assert "within a 480 s budget" in output
    # The benchmark's own dry run, reached without the project installed, sizes case b for 79 GiB.
    assert "79" in output and "b" in output.split("gpu_check: plan:")[-1]


def test_wheels_without_this_interpreter_are_named_not_a_traceback(
    bare: Path, wheels: Path, tmp_path: Path
) -> None:
    partial = tmp_path / "wheels"
    shutil.copytree(wheels, partial)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for compiled in partial.glob(f"pydantic_core-*-{tag}-*.whl"):
        compiled.unlink()
    done = dry_run(bare, partial, tmp_path)
    assert done.returncode != 0
    assert "pydantic-core" in done.stderr and tag in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("budget", [60.0, 300.0, 480.0, 900.0])
def test_the_phases_caps_fit_the_budget(budget: float, tmp_path: Path) -> None:
    found = {"gpu": "a GPU", "compile_problem": None}
    tests, compiled, benchmark = check.plan(budget, tmp_path, found, 79.0)
    # The two test phases share one cap: what the first uses, the second cannot.
    assert tests.cap_s == compiled.cap_s
    assert tests.cap_s + benchmark.cap_s + check.MARGIN_S <= budget + 1e-9
    assert tests.cap_s <= check.TESTS_SHARE * budget
    assert all(phase.skip is None for phase in (tests, compiled, benchmark))


def test_no_compiler_skips_the_compiled_test_with_the_reason(tmp_path: Path) -> None:
    reason = "compiled layers need a compiler and Python's headers: no C compiler"
    found = {"gpu": "a GPU", "compile_problem": reason}
    _, compiled, benchmark = check.plan(480.0, tmp_path, found, 79.0)
    assert compiled.skip == reason and benchmark.skip is None
    _, compiled, benchmark = check.plan(480.0, tmp_path, {"compile_problem": None}, 79.0)
    assert compiled.skip == benchmark.skip == "no CUDA device visible"


def test_a_phase_past_its_cap_is_killed_with_its_children(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    # The phase starts a child that would outlive it, then never ends on its own.
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(child_pid)!r}, 'w').write(str(child.pid)); time.sleep(600)"
    )
    phase = check.Phase("tests", [sys.executable, "-c", code], cap_s=3.0)
    result = check.run_phase(phase, dict(os.environ), cap_s=3.0)
    assert result["timed_out"] and result["status"] != 0
    assert result["seconds"] < 60
    pid = int(child_pid.read_text())
    # Killed with the group: gone, or a zombie awaiting its reaper, never still running.
    state = Path(f"/proc/{pid}/stat")
    assert not state.exists() or state.read_text().split(")")[-1].split()[0] == "Z"


def test_the_summary_is_on_disk_after_each_phase_and_counts_the_tests(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skips(): pass\n"
    )
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                  "--rootdir", str(tmp_path), "--junitxml", str(out / "tests.xml")]  # fmt: skip
    # The second phase fails without a report: the first's counts must survive it.
    phases = [
        check.Phase("tests", pytest_run, cap_s=120.0),
        check.Phase("tests-compiled", [sys.executable, "-c", "raise SystemExit(3)"], 120.0),
        check.Phase("benchmark", [sys.executable, "-c", "pass"], 120.0, skip="no CUDA device"),
    ]
    summary: dict = {"phases": {}}
    ok = check.run_phases(phases, dict(os.environ), 400.0, out, summary)
    assert not ok
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["tests"]["tests"] == {
        "tests": 3, "failures": 1, "errors": 0, "skipped": 1, "passed": 1,
    }  # fmt: skip
    assert on_disk["tests"]["tests-compiled"] is None
    assert on_disk["phases"]["tests-compiled"]["status"] == 3
    assert on_disk["phases"]["benchmark"] == {"skipped": "no CUDA device"}
