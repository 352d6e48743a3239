"""The learner part of the GPU check (`scripts/gpu_check.sh prepare|learner`), for a bare machine.

A GPU machine lent for a short window may have nothing but a CUDA build of torch and
transformers: no pydantic (whose core is a compiled wheel), no pytest, no network, perhaps no C
compiler. So the check is split in two:

- `prepare DEST` (here, with network): `pip download`s the wheels the learner's tests and
  benchmark need beyond torch and transformers (pydantic, pydantic-core, annotated-types,
  typing-inspection, pytest and what they need; xxhash and zstandard, the digest and the
  compressor of delta publishes), pinned to the versions installed here, for every CPython
  version and platform a GPU image may have (a few MB), with a manifest.
- `run` (there): installs the wheels that fit the interpreter into a target folder (unzipped:
  no pip needed), prints what the machine has (GPU, memory, torch, transformers, the compiler and
  Python.h that compiled layers need, varlen_attn's signature), checks that every module the
  tests and the benchmark import resolves, then runs, inside `--budget` seconds: tests/gpu's fast
  tests, the compiled-layer test (skipped, with the reason, without a compiler), and the
  benchmark (benchmarks/bench_learner_speed.py, cases a, c, b, sized to the GPU's memory; it
  writes its JSON after every case and skips a case that would not fit the time left). Each
  phase runs in its own process group, killed at its share of the budget; `summary.json` is
  rewritten after every phase, so a run cut short keeps what it measured. `--dry-run` does all
  of this but the phases (no GPU needed) and prints the plan.

Standard library only at import time (and `packaging`, which transformers requires): this runs
before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from services.learner.toolchain import compile_problem, compiler, python_header  # noqa: E402

DEFAULT_WHEELS = REPO / ".gpu-check" / "wheels"
DEFAULT_TARGET = REPO / ".gpu-check" / "site"
MANIFEST = "prepared.json"
# Pinned to the versions installed where `prepare` runs (the ones the test suite passed with).
PINNED = ("pydantic", "pytest", "xxhash", "zstandard")
# pytest's dependencies below 3.11: pip evaluates `python_version` markers against the running
# interpreter, not `--python-version`, so they are named outright (pure Python, harmless above).
BELOW_311 = ("exceptiongroup", "tomli")
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
PLATFORMS = ("x86_64", "aarch64")
# Modules the phases import, checked before any runs (the tests' own imports by collection).
BENCHMARK_MODULES = ("bench_learner_speed", "bench_logprob_head")
TESTS = "tests/gpu"
COMPILE_TESTS = "compiled"  # the -k expression of tests/gpu's compiled-layer tests
# Per benchmark record: what the goals are read from.
FIGURES = ("seconds", "vs_plain_time", "tokens_per_s", "mfu", "peak_bytes", "micro_batch_tokens")
TESTS_SHARE = 0.45  # of the budget, at most, for tests/gpu; the benchmark has the rest
MARGIN_S = 10.0  # kept back from the budget: killing a phase and the summary take a moment


# --- prepare ---------------------------------------------------------------------------------


def requirements() -> list[str]:
    pinned = [f"{name}=={importlib.metadata.version(name)}" for name in PINNED]
    return pinned + list(BELOW_311)


def prepare(dest: Path, pythons: Sequence[str], platforms: Sequence[str]) -> dict[str, Any]:
    """Download the wheels for every (Python, platform) pair into `dest`; the manifest says
    which pairs are covered, so `run` can name what is missing."""
    dest.mkdir(parents=True, exist_ok=True)
    covered, failed = [], {}
    for version in pythons:
        for machine in platforms:
            tags = [
                f"manylinux2014_{machine}",
                f"manylinux_2_17_{machine}",
                f"manylinux_2_28_{machine}",
            ]
            command = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--only-binary=:all:",
                "--implementation",
                "cp",
                "--python-version",
                version,
                *(arg for tag in tags for arg in ("--platform", tag)),
                "--dest",
                str(dest),
                *requirements(),
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                covered.append(f"cp{version.replace('.', '')}-{machine}")
            else:
                failed[f"cp{version}-{machine}"] = done.stderr.strip().splitlines()[-1:]
    manifest = {
        "requirements": requirements(),
        "covered": covered,
        "failed": failed,
        "wheels": sorted(path.name for path in dest.glob("*.whl")),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(path.stat().st_size for path in dest.glob("*.whl"))
    print(
        f"gpu_check prepare: {len(manifest['wheels'])} wheels, {size / 2**20:.1f} MiB in "
        f"{dest}; interpreters covered: {', '.join(covered) or 'none'}"
    )
    for pair, reason in failed.items():
        print(f"gpu_check prepare: no wheels for {pair}: {' '.join(reason)}")
    return manifest


# --- install ----------------------------------------------------------------------------------


def fitting_wheels(wheels: Path) -> dict[str, Path]:
    """For each distribution in `wheels`, its wheel this interpreter takes best (the earliest of
    its tags in `sys_tags`, which lists the most specific first)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    rank = {tag: index for index, tag in enumerate(sys_tags())}
    best: dict[str, tuple[int, Path]] = {}
    for path in sorted(wheels.glob("*.whl")):
        name, _, _, tags = parse_wheel_filename(path.name)
        fits = [rank[tag] for tag in tags if tag in rank]
        if fits and (name not in best or min(fits) < best[name][0]):
            best[name] = (min(fits), path)
    return {name: path for name, (_, path) in best.items()}


def install(wheels: Path, target: Path) -> list[str]:
    """Unzip into `target` the wheels that fit this interpreter (a wheel is laid out to be
    unpacked into site-packages as it is); the prepared requirements none fits are errors."""
    manifest_path = wheels / MANIFEST
    if not manifest_path.is_file():
        raise SystemExit(
            f"gpu_check: {manifest_path} not found: run `scripts/gpu_check.sh prepare {wheels}` "
            "on a machine with network access first, and bring the folder along"
        )
    manifest = json.loads(manifest_path.read_text())
    chosen = fitting_wheels(wheels)
    wanted = {_distribution(text) for text in manifest["requirements"]} | {"pydantic-core"}
    missing = sorted(name for name in wanted if name not in chosen)
    if missing:
        interpreter = f"cp{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}"
        raise SystemExit(
            f"gpu_check: {wheels} has no wheel of {', '.join(missing)} for {interpreter} "
            f"(covered: {', '.join(manifest['covered'])}); prepare again with --python "
            f"{sys.version_info.major}.{sys.version_info.minor}"
        )
    target.mkdir(parents=True, exist_ok=True)
    for path in chosen.values():
        with zipfile.ZipFile(path) as archive:
            archive.extractall(target)
    return sorted(path.name for path in chosen.values())


def _distribution(requirement: str) -> str:
    """`pydantic==2.1` -> `pydantic`, normalised as wheel names are."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(Requirement(requirement).name))


# --- what the machine has -------------------------------------------------------------------


def varlen_signature() -> str:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        return f"absent ({error})"
    return str(inspect.signature(varlen_attn))


def environment() -> dict[str, Any]:
    """What the phases depend on, read before any runs (printed, and kept in the summary)."""
    import torch
    import transformers

    found: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpus": torch.cuda.device_count(),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        found["gpu"] = properties.name
        found["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
        found["capability"] = f"{properties.major}.{properties.minor}"
    try:
        found["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        found["triton"] = None
    found["c_compiler"] = compiler("cuda")
    header = python_header()
    found["python_h"] = str(header) if header else None
    found["compile_problem"] = compile_problem("cuda")
    found["varlen_attn"] = varlen_signature()
    return found


# --- phases ---------------------------------------------------------------------------------


@dataclass
class Phase:
    """One process of the check: its command, the seconds it may take at most, and why it is
    skipped (None: it runs)."""

    name: str
    command: list[str]
    cap_s: float
    skip: str | None = None
    result: dict[str, Any] = field(default_factory=dict)


def plan(budget_s: float, out: Path, found: dict[str, Any], memory_gib: float) -> list[Phase]:
    """The phases in order, fast first, each capped so that together they fit `budget_s`: the
    tests at most TESTS_SHARE of it (the compiled-layer test gets what the others leave), the
    benchmark the rest (at run time: whatever the tests left)."""
    usable = budget_s - MARGIN_S
    tests_cap = TESTS_SHARE * usable
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", "-rA", TESTS]
    no_gpu = None if found.get("gpu") else "no CUDA device visible"
    compile_skip = no_gpu or found["compile_problem"]
    return [
        Phase(
            "tests",
            [*pytest, "-k", f"not {COMPILE_TESTS}", "--junitxml", str(out / "tests.xml")],
            tests_cap,
            no_gpu,
        ),
        Phase(
            "tests-compiled",
            [*pytest, "-k", COMPILE_TESTS, "--junitxml", str(out / "tests-compiled.xml")],
            tests_cap,
            compile_skip,
        ),
        Phase(
            "benchmark",
            [
                sys.executable,
                str(REPO / "benchmarks" / "bench_learner_speed.py"),
                "--device",
                "cuda",
                "--quick",
                "--cases",
                "a,c,b",
                "--json",
                str(out / "bench_learner_speed.json"),
                "--memory-gib",
                str(memory_gib),
            ],
            usable - tests_cap,
            no_gpu,
        ),
    ]


def phase_environment(target: Path) -> dict[str, str]:
    """The phases' environment: the installed wheels first on the path, then the repository
    (the project is not installed) and its benchmarks; nothing from the network; no plugins the
    image's own pytest might carry."""
    paths = [str(target), str(REPO), str(REPO / "benchmarks")]
    before = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths + ([before] if before else [])),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        # Freed blocks are given back whole: the benchmark's cases follow one another in one
        # process, and fragmentation would otherwise count against the next case's memory.
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


def run_phase(phase: Phase, environment: dict[str, str], cap_s: float) -> dict[str, Any]:
    """Run `phase` in its own process group, killed (all of it: the tests spawn ranks) after
    `cap_s`; its exit status and seconds."""
    start = time.monotonic()
    process = subprocess.Popen(phase.command, cwd=REPO, env=environment, start_new_session=True)
    try:
        status = process.wait(timeout=max(cap_s, 1.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        status, timed_out = process.wait(), True
    return {
        "status": status,
        "seconds": round(time.monotonic() - start, 1),
        "timed_out": timed_out,
        "cap_s": round(cap_s, 1),
    }


def test_counts(report: Path) -> dict[str, int] | None:
    """passed / failed / errors / skipped from a pytest JUnit report; None without one."""
    if not report.is_file():
        return None
    root = ElementTree.parse(report).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    if suite is None:
        return None
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


# --- imports, figures, summary --------------------------------------------------------------


def check_imports(environment: dict[str, str]) -> list[str]:
    """Problems importing what the phases need (empty: none): the benchmark's modules, and the
    tests' through pytest's collection (which imports every test module and conftest)."""
    problems = []
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]"
    commands = {
        "benchmark imports": [sys.executable, "-c", code, *BENCHMARK_MODULES],
        "tests/gpu collection": [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            TESTS,
        ],
    }
    for name, command in commands.items():
        done = subprocess.run(
            command, cwd=REPO, env=environment, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            problems.append(f"{name}: " + " | ".join(tail))
    return problems


def benchmark_figures(report: Path) -> dict[str, Any]:
    """What the issue's goals read from the benchmark's JSON (whatever cases it finished): per
    case ours/plain time, MFU and peak memory, and the long-tailed rate against case a."""
    if not report.is_file():
        return {}
    data = json.loads(report.read_text())
    figures: dict[str, Any] = {"complete": data.get("complete", True)}
    ours = {}
    for record in data.get("records", []):
        key = f"{record['case']}/{record['variant']}"
        if "error" in record:
            figures[key] = record["error"]
            continue
        figures[key] = {name: record.get(name) for name in FIGURES}
        if record["variant"] == "ours":
            ours[record["case"]] = record
    if "a" in ours and "c" in ours:
        figures["c_rate_vs_a"] = ours["c"]["tokens_per_s"] / ours["a"]["tokens_per_s"]
    figures["skipped"] = data.get("skipped", {})
    return figures


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """Rewritten whole after every phase (atomically): a run cut short keeps what it did."""
    partial = out / "summary.json.tmp"
    partial.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(partial, out / "summary.json")


def run_phases(
    phases: list[Phase],
    environment: dict[str, str],
    budget_s: float,
    out: Path,
    summary: dict[str, Any],
) -> bool:
    """Each phase in turn within what is left of the budget; True if every one that ran passed."""
    deadline = time.monotonic() + budget_s - MARGIN_S
    tests_left = phases[0].cap_s
    ok = True
    for phase in phases:
        left = deadline - time.monotonic()
        cap = min(tests_left, left) if phase.name.startswith("tests") else left
        if phase.skip is None and phase.name == "benchmark":
            phase.command += ["--budget-s", f"{max(cap - MARGIN_S, 1):.0f}"]
        if phase.skip is None and cap < 5:
            phase.skip = f"budget: {left:.0f} s left"
        if phase.skip is not None:
            print(f"gpu_check: {phase.name}: skipped: {phase.skip}", flush=True)
            phase.result = {"skipped": phase.skip}
        else:
            print(f"gpu_check: {phase.name}: up to {cap:.0f} s", flush=True)
            phase.result = run_phase(phase, environment, cap)
            ok = ok and phase.result["status"] == 0
            if phase.name.startswith("tests"):
                tests_left -= phase.result["seconds"]
        summary["phases"][phase.name] = phase.result
        summary["tests"] = {
            name: test_counts(out / f"{name}.xml") for name in ("tests", "tests-compiled")
        }
        summary["benchmark"] = benchmark_figures(out / "bench_learner_speed.json")
        write_summary(out, summary)
    return ok


def print_summary(summary: dict[str, Any]) -> None:
    print("\ngpu_check learner: summary")
    for name, result in summary["phases"].items():
        print(f"  {name}: {json.dumps(result)}")
    for name, counts in summary["tests"].items():
        print(f"  {name}: {counts if counts is not None else 'no report'}")
    for key, value in summary["benchmark"].items():
        print(f"  benchmark {key}: {json.dumps(value, default=str)}")
    print(f"  total: {summary['seconds']:.0f} s of a {summary['budget_s']:.0f} s budget")


# --- main -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out = args.out or REPO / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    installed = install(args.wheels, args.target)
    print(f"gpu_check: installed into {args.target}: {', '.join(installed)}")
    found = environment()
    for key, value in found.items():
        print(f"gpu_check: {key}: {value}", flush=True)
    if not args.dry_run and not found.get("gpu"):
        print(f"gpu_check: no CUDA device visible to torch {found['torch']}", file=sys.stderr)
        return 1
    memory = args.memory_gib or found.get("gpu_memory_gib") or 80.0
    environment_vars = phase_environment(args.target)
    problems = check_imports(environment_vars)
    phases = plan(args.budget, out, found, memory)
    summary: dict[str, Any] = {
        "environment": found,
        "installed": installed,
        "budget_s": args.budget,
        "imports": problems or "ok",
        "phases": {},
    }
    for phase in phases:
        print(
            f"gpu_check: plan: {phase.name}: up to {phase.cap_s:.0f} s"
            + (f" (skipped: {phase.skip})" if phase.skip else "")
        )
    caps = phases[0].cap_s + phases[2].cap_s  # the compiled tests share the tests' cap
    print(
        f"gpu_check: plan: {caps:.0f} s of phases + {MARGIN_S:.0f} s margin within a "
        f"{args.budget:.0f} s budget"
    )
    for problem in problems:
        print(f"gpu_check: import problem: {problem}", file=sys.stderr)
    if problems:
        return 1
    if args.dry_run:
        benchmark_s = f"{max(phases[2].cap_s - MARGIN_S, 1):.0f}"
        dry = [*phases[2].command, "--budget-s", benchmark_s, "--dry-run"]
        return subprocess.run(dry, cwd=REPO, env=environment_vars, check=False).returncode
    ok = run_phases(phases, environment_vars, args.budget, out, summary)
    summary["seconds"] = time.monotonic() - start
    write_summary(out, summary)
    print_summary(summary)
    print(f"gpu_check: figures in {out}")
    return 0 if ok else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download the wheels (needs network)")
    prep.add_argument("dest", type=Path, nargs="?", default=DEFAULT_WHEELS)
    prep.add_argument(
        "--python",
        action="append",
        dest="pythons",
        help=f"a CPython version (repeatable; default {', '.join(PYTHONS)})",
    )
    prep.add_argument(
        "--platform",
        action="append",
        dest="platforms",
        choices=PLATFORMS,
        help="a Linux machine type (repeatable; default both)",
    )
    check = commands.add_parser("run", help="the learner check (needs a GPU unless --dry-run)")
    check.add_argument("--budget", type=float, default=480.0, help="seconds for all of it")
    check.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS)
    check.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    check.add_argument("--out", type=Path, help="figures (default: runs/gpu-check-TIME)")
    check.add_argument(
        "--memory-gib",
        type=float,
        default=0.0,
        help="size the cases for this much GPU memory (default: the GPU's)",
    )
    check.add_argument(
        "--dry-run",
        action="store_true",
        help="install, report, check imports and print the plan; run nothing",
    )
    args = parser.parse_args(argv)
    if args.command == "run" and args.budget < 60:
        parser.error("--budget: at least 60 seconds (the tests alone take longer)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "prepare":
        manifest = prepare(args.dest, args.pythons or PYTHONS, args.platforms or PLATFORMS)
        return 0 if manifest["covered"] else 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
