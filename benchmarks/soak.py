"""Soak test: the resident memory of a long run, per process, sampled over time.

Runs examples/demo.yaml (the tiny model) through `kpo run` in a process of its own, with a step
count it cannot reach, for --minutes (30, counted from when its actors are up). Every --every
seconds (30) it samples the resident memory (VmRSS of /proc/<pid>/status) of the driver (the
`kpo run` process) and of every actor that the run's status.json lists. At the end it cancels
the run as Ctrl-C would (SIGTERM: the driver finishes its learner step, writes a checkpoint and
records `cancelled`) and reports per process: RSS at the start (the first sample after a warm-up
of --warmup-minutes, 2: model loading, allocator pools and caches filling up), at the end, the
peak, the growth in MiB and in MiB/hour (end minus start over the time between them, and the
least-squares slope of every sample after the warm-up, which one noisy sample moves less), and
the learner step reached.

Why `kpo run` and not a run submitted to the control plane: the memory looked at here is the
run's own, and `kpo run` is that run with nothing in between. Its driver is the very process
started here (a Ray job's driver would be a grandchild of Ray's job supervisor, its pid nowhere
recorded), its status.json lands in a directory chosen here, and it starts its own Ray instance
rather than a shared head whose jobs and daemons would have to be told apart. The control plane's
behaviour under requests is benchmarks/bench_load.py's subject.

Writes to --out (default runs/soak-<date>-<time>):

    samples.csv    one row per process per sample: elapsed_s, unix_time, step, process, pid,
                   rss_mib (empty once the process is gone)
    rss.png        RSS of each process over time, and the learner step
    summary.json   the figures printed at the end
    run.log        what `kpo run` printed
    run/           the run's own output directory (metrics, checkpoints, curves)

Ctrl-C ends the sampling early; the run is still cancelled cleanly and the report written.
Exit status 1 when the run did not end `cancelled` (it failed, or ended by itself).

    python benchmarks/soak.py [--minutes 30] [--every 30] [--warmup-minutes 2] [--out DIR]
    make soak SOAK_ARGS="--minutes 60"
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import print_table

from services.pipeline.outputs import json_safe

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
DRIVER = "driver"
CSV_FIELDS = ("elapsed_s", "unix_time", "step", "process", "pid", "rss_mib")


# --- reading processes and the run's files (pure, or nearly) -----------------------------------


def parse_vm_rss_kib(status_text: str) -> int | None:
    """The VmRSS of a /proc/<pid>/status text, in KiB; None when it has none (a zombie, a
    kernel thread)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                unit = fields[2].lower() if len(fields) > 2 else "kb"
                if unit != "kb":
                    raise ValueError(f"unexpected unit in {line!r}")
                return int(fields[1])
            raise ValueError(f"cannot parse {line!r}")
    return None


def parse_start_ticks(stat_text: str) -> int:
    """The start time (clock ticks after boot) of a /proc/<pid>/stat text: what tells a process
    from a later one that got the same pid. The command name may hold spaces and parentheses,
    so the fields are counted from the last ')'."""
    after_name = stat_text[stat_text.rindex(")") + 2 :].split()
    return int(after_name[19])  # field 22 of the line; the state (field 3) is after_name[0]


def read_rss_mib(pid: int, start_ticks: int | None = None) -> float | None:
    """Resident memory of `pid` in MiB; None when it is gone (or, with `start_ticks`, when the
    pid now belongs to another process)."""
    proc = Path("/proc") / str(pid)
    try:
        if start_ticks is not None and parse_start_ticks(_read(proc / "stat")) != start_ticks:
            return None
        kib = parse_vm_rss_kib(_read(proc / "status"))
    except (OSError, ValueError, IndexError):
        return None
    return None if kib is None else kib / 1024


def start_ticks_of(pid: int) -> int | None:
    try:
        return parse_start_ticks(_read(Path("/proc") / str(pid) / "stat"))
    except (OSError, ValueError, IndexError):
        return None


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def actor_processes(status: dict[str, Any]) -> list[tuple[str, int]]:
    """(name, pid) of every actor in a status.json: generation-0.., verifier-0.., learner."""
    out: list[tuple[str, int]] = []
    actors = status.get("actors") or {}
    for role, singular in (("generation", "generation"), ("verifiers", "verifier")):
        out += [(f"{singular}-{i}", int(pid)) for i, pid in enumerate(actors.get(role, []))]
    learners = [int(pid) for pid in actors.get("learner", [])]
    if len(learners) == 1:
        out.append(("learner", learners[0]))
    else:
        out += [(f"learner-{i}", pid) for i, pid in enumerate(learners)]
    return out


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(_read(run_dir / "status.json"))
    except (OSError, ValueError):
        return {}
    return data


def last_step(metrics_path: Path) -> int:
    """The step of the last complete record of a metrics.jsonl (read from its end); 0 if none."""
    try:
        with metrics_path.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - 65536))
            tail = file.read().decode("utf-8", errors="replace")
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the seek, or one being written
    return 0


# --- figures (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Growth:
    """How one process's RSS moved after the warm-up."""

    process: str
    pid: int
    start_mib: float
    end_mib: float
    peak_mib: float
    growth_mib: float
    mib_per_hour: float  # (end - start) / hours between them
    fit_mib_per_hour: float  # least-squares slope of the samples after the warm-up
    samples: int  # after the warm-up
    gone: bool  # the process had ended by the last sample


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points; NaN for fewer than 2 distinct x."""
    if len(points) < 2:
        return math.nan
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return math.nan
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx


def growth(
    process: str, pid: int, points: Sequence[tuple[float, float | None]], warmup_s: float
) -> Growth:
    """The growth of one process from (elapsed seconds, RSS MiB or None when gone) samples.

    The start is the first sample at or after `warmup_s`; when the run was shorter than the
    warm-up, the first sample of all. The end is the last sample with a value.
    """
    alive = [(t, rss) for t, rss in points if rss is not None]
    if not alive:
        nan = math.nan
        return Growth(process, pid, nan, nan, nan, nan, nan, nan, 0, True)
    kept = [(t, rss) for t, rss in alive if t >= warmup_s] or alive
    (t0, start), (t1, end) = kept[0], kept[-1]
    hours = (t1 - t0) / 3600
    return Growth(
        process=process,
        pid=pid,
        start_mib=start,
        end_mib=end,
        peak_mib=max(rss for _, rss in kept),
        growth_mib=end - start,
        mib_per_hour=(end - start) / hours if hours > 0 else math.nan,
        fit_mib_per_hour=slope(kept) * 3600,
        samples=len(kept),
        gone=points[-1][1] is None,
    )


# --- the run -----------------------------------------------------------------------------------


def start_run(config: Path, run_dir: Path, log: TextIO) -> subprocess.Popen[bytes]:
    """`kpo run` of `config` into `run_dir`, with more steps than it will make, in a session of
    its own (a Ctrl-C here does not reach it: it is cancelled on purpose, at the end)."""
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("RAY_ADDRESS", None)  # a local Ray instance: its actors' pids are on this machine
    command = [sys.executable, "-m", "services.cli", "run", str(config), "--out", str(run_dir)]
    command += ["--set", "name=soak", "--set", "pipeline.steps=10000000"]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_for_actors(
    run: subprocess.Popen[bytes], run_dir: Path, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not read_status(run_dir).get("actors"):
        if run.poll() is not None:
            raise RuntimeError(f"`kpo run` ended ({run.returncode}):\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no actors within {timeout_s:.0f} s:\n{_tail(log_path)}")
        time.sleep(1.0)


def cancel(run: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, float]:
    """SIGTERM (the driver's cancel), then a second one (stop at once), then SIGKILL; the exit
    code and the seconds it took."""
    start = time.monotonic()
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGTERM, 30.0), (signal.SIGKILL, 30)):
        if run.poll() is not None:
            break
        run.send_signal(sig)
        try:
            run.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            print(f"  `kpo run` still running {wait_s:.0f} s after signal {sig}", flush=True)
    code = run.wait()
    return code, time.monotonic() - start


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(_read(path).splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- sampling ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    elapsed_s: float
    unix_time: float
    step: int
    process: str
    pid: int
    rss_mib: float | None


class Sampler:
    """Samples the driver and the actors of status.json, keeping pids' start times."""

    def __init__(self, driver_pid: int, run_dir: Path) -> None:
        self.driver_pid = driver_pid
        self.run_dir = run_dir
        self.started: dict[int, int | None] = {}
        self.samples: list[Sample] = []

    def processes(self) -> list[tuple[str, int]]:
        return [(DRIVER, self.driver_pid), *actor_processes(read_status(self.run_dir))]

    def sample(self, elapsed_s: float) -> list[Sample]:
        step = last_step(self.run_dir / "metrics.jsonl")
        now = time.time()
        taken = []
        for name, pid in self.processes():
            if pid not in self.started:
                self.started[pid] = start_ticks_of(pid)
            ticks = self.started[pid]
            rss = read_rss_mib(pid, ticks) if ticks is not None else None
            taken.append(Sample(round(elapsed_s, 1), round(now, 1), step, name, pid, rss))
        self.samples += taken
        return taken


def write_csv_rows(writer: Any, samples: Sequence[Sample]) -> None:
    for s in samples:
        rss = "" if s.rss_mib is None else f"{s.rss_mib:.1f}"
        writer.writerow([s.elapsed_s, s.unix_time, s.step, s.process, s.pid, rss])


def progress_line(samples: Sequence[Sample], minutes: float) -> str:
    first = samples[0]
    memory = ", ".join(
        f"{s.process} {'gone' if s.rss_mib is None else f'{s.rss_mib:,.0f}'}" for s in samples
    )
    return (
        f"  [soak {first.elapsed_s / 60:5.1f}/{minutes:g} min] step {first.step}; RSS MiB: {memory}"
    )


# --- the report --------------------------------------------------------------------------------


def growths(samples: Sequence[Sample], warmup_s: float) -> list[Growth]:
    """One Growth per (process, pid), in the order they first appear."""
    series: dict[tuple[str, int], list[tuple[float, float | None]]] = {}
    for s in samples:
        series.setdefault((s.process, s.pid), []).append((s.elapsed_s, s.rss_mib))
    return [growth(name, pid, points, warmup_s) for (name, pid), points in series.items()]


def _num(value: float, spec: str = ",.1f") -> str:
    return "-" if math.isnan(value) else format(value, spec)


def print_report(rows: Sequence[Growth], warmup_s: float, last: Sample) -> None:
    print()
    print(
        f"RSS after a warm-up of {warmup_s / 60:g} min to the end ({last.elapsed_s / 60:.1f} min "
        f"of sampling), learner step reached: {last.step}"
    )
    table = [
        [
            g.process + (" (gone)" if g.gone else ""),
            str(g.pid),
            _num(g.start_mib),
            _num(g.end_mib),
            _num(g.peak_mib),
            _num(g.growth_mib, "+,.1f"),
            _num(g.mib_per_hour, "+,.1f"),
            _num(g.fit_mib_per_hour, "+,.1f"),
        ]
        for g in rows
    ]
    headers = ["process", "pid", "start MiB", "end MiB", "peak MiB", "growth MiB"]
    print_table([*headers, "MiB/h", "MiB/h (fit)"], table)


def plot(samples: Sequence[Sample], warmup_s: float, path: Path) -> None:
    """RSS of each process over time (top) and the learner step (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, steps) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 1))
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        if s.rss_mib is not None:
            series.setdefault(f"{s.process} ({s.pid})", []).append((s.elapsed_s / 60, s.rss_mib))
    for label, points in series.items():
        memory.plot([t for t, _ in points], [r for _, r in points], marker=".", label=label)
    memory.axvline(warmup_s / 60, color="grey", linestyle="--", linewidth=1, label="end of warm-up")
    memory.set_ylabel("RSS (MiB)")
    memory.set_title("resident memory of the run's processes")
    memory.grid(alpha=0.3)
    memory.legend(fontsize="small")
    per_time = sorted({(s.elapsed_s / 60, s.step) for s in samples})
    steps.plot([t for t, _ in per_time], [n for _, n in per_time], color="black")
    steps.set_xlabel("minutes since the actors started")
    steps.set_ylabel("learner step")
    steps.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --- main --------------------------------------------------------------------------------------


def sample_until(
    sampler: Sampler, run: subprocess.Popen[bytes], args: argparse.Namespace, csv_file: TextIO
) -> str:
    """Sample every --every seconds for --minutes; why it stopped."""
    writer = csv.writer(csv_file)
    writer.writerow(CSV_FIELDS)
    duration_s = args.minutes * 60
    start = time.monotonic()
    try:
        while True:
            elapsed = time.monotonic() - start
            taken = sampler.sample(elapsed)
            write_csv_rows(writer, taken)
            csv_file.flush()
            print(progress_line(taken, args.minutes), flush=True)
            if run.poll() is not None:
                return f"the run ended by itself (exit code {run.returncode})"
            if elapsed >= duration_s:
                return "time is up"
            next_at = start + min(duration_s, (int(elapsed / args.every) + 1) * args.every)
            time.sleep(max(0.0, next_at - time.monotonic()))
    except KeyboardInterrupt:
        return "interrupted (Ctrl-C)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the sampling")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--out", type=Path, help="output directory; default runs/soak-<time>")
    parser.add_argument("--config", type=Path, default=DEMO, help="the run's YAML file")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="for the actors")
    parser.add_argument("--cancel-timeout", type=float, default=300.0, help="for `cancelled`")
    args = parser.parse_args()
    if args.minutes <= 0 or args.every <= 0 or args.warmup_minutes < 0:
        parser.error("--minutes and --every must be > 0, --warmup-minutes >= 0")
    if args.warmup_minutes >= args.minutes:
        print(f"note: the warm-up ({args.warmup_minutes:g} min) is not shorter than the run")

    out = (args.out or Path("runs") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=False)
    run_dir, log_path = out / "run", out / "run.log"
    warmup_s = args.warmup_minutes * 60
    with log_path.open("w", encoding="utf-8") as log:
        run = start_run(args.config, run_dir, log)
    print(f"`kpo run` started (pid {run.pid}) into {run_dir}; its output: {log_path}", flush=True)
    try:
        wait_for_actors(run, run_dir, log_path, args.start_timeout)
        sampler = Sampler(run.pid, run_dir)
        print(
            f"actors up: {', '.join(f'{n} {p}' for n, p in sampler.processes())}; sampling every "
            f"{args.every:g} s for {args.minutes:g} min",
            flush=True,
        )
        with (out / "samples.csv").open("w", encoding="utf-8", newline="") as csv_file:
            why = sample_until(sampler, run, args, csv_file)
        print(f"stopping: {why}; cancelling the run", flush=True)
    finally:
        code, cancel_s = cancel(run, args.cancel_timeout)
    status = read_status(run_dir)
    final_step = last_step(run_dir / "metrics.jsonl")
    state = status.get("state", "unknown")
    print(f"the run ended {state} (exit code {code}) {cancel_s:.1f} s after its cancel")

    rows = growths(sampler.samples, warmup_s)
    print_report(rows, warmup_s, sampler.samples[-1])
    print(f"final learner step: {final_step}")
    plot(sampler.samples, warmup_s, out / "rss.png")
    summary = {
        "minutes": args.minutes,
        "every_s": args.every,
        "warmup_minutes": args.warmup_minutes,
        "stopped": why,
        "final_state": state,
        "exit_code": code,
        "cancel_seconds": round(cancel_s, 1),
        "final_step": final_step,
        "processes": [asdict(g) for g in rows],
    }
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    print(f"samples: {out / 'samples.csv'}; plot: {out / 'rss.png'}; summary: {out}/summary.json")
    if state != "cancelled":
        sys.exit(1)


if __name__ == "__main__":
    main()
