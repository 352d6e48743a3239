"""What a run leaves in its output directory, and what it prints while it runs.

    config.json     the resolved RunSpec (every default filled in)
    metrics.jsonl   one JSON record per learner step, in step order
    status.json     the run's state, its timestamped transitions, the error of a failed run
    curves.png      reward, entropy, clip fraction and staleness over steps (see `plots`)
    checkpoints/    see `checkpoints`
    events.jsonl    the run's events (the stability guard's actions, pause and resume)
    resume.json     written by the operator: the resume request of a paused run (`pause`)

The driver reports through `RunObserver`s (services.observers): the run directory here is one,
an `EventObserver` and a `ResumeSource` too (services/pipeline/pause.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, TextIO

from services.observers import MetricsRecord, ResumeRequest, RunState
from services.pipeline.pause import ResumeFile, append_event_line

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
CURVES_FILE = "curves.png"
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"  # the Hugging Face export of the run's final checkpoint
EVAL_FILE = "eval.jsonl"  # one line per held-out evaluation (services/pipeline/evaluation.py)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def json_safe(value: Any) -> Any:
    """`value` with every NaN/inf (in nested dicts and lists too) as None: JSON has no such
    numbers, and a reader (a browser's JSON.parse among them) must not choke on them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


def json_safe_record(record: MetricsRecord) -> MetricsRecord:
    """`record` with NaN/inf values as None, ready for JSON (files, stores, HTTP)."""
    safe: MetricsRecord = json_safe(record)
    return safe


def read_metrics(out_dir: Path, keys: Collection[str] | None = None) -> list[MetricsRecord]:
    """The metrics records of a run directory, in file order; only `keys` of each if given.

    Read line by line, so that a long run's file is never held whole (nor, with `keys`, every
    field of every record: the curves need five of about a hundred).
    """
    path = out_dir / METRICS_FILE
    if not path.exists():
        return []
    records = []
    with path.open(encoding="utf-8") as file:
        for line in file:
            if not line.strip():
                continue
            record = json.loads(line)
            records.append(record if keys is None else {k: record[k] for k in keys if k in record})
    return records


class RunDirectory:
    """The files of one run's output directory (an observer of its own run)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = out_dir / CHECKPOINTS_DIR
        self.model = out_dir / MODEL_DIR
        self.curves = out_dir / CURVES_FILE
        status = out_dir / STATUS_FILE
        self._status: dict[str, Any] = (
            json.loads(status.read_text(encoding="utf-8")) if status.exists() else {}
        )
        self._resumes = ResumeFile(out_dir)

    def write_config(self, resolved: dict[str, Any]) -> None:
        _write_atomic(self.path / CONFIG_FILE, json.dumps(resolved, indent=2) + "\n")

    def read_metrics(self, keys: Collection[str] | None = None) -> list[MetricsRecord]:
        return read_metrics(self.path, keys)

    def on_metrics_rewound(self, step: int, record: MetricsRecord | None) -> None:
        """Drop records after `step`: a resumed run redoes those steps, and must not repeat them.
        `step`'s own record is kept, or added where it never arrived."""
        kept = [r for r in read_metrics(self.path) if r["step"] <= step]
        if record is not None and all(r["step"] != step for r in kept):
            kept.append(json_safe_record(record))
        text = "".join(json.dumps(r) + "\n" for r in kept)
        _write_atomic(self.path / METRICS_FILE, text)

    def on_metrics(self, record: MetricsRecord) -> None:
        line = json.dumps(json_safe_record(record))
        with (self.path / METRICS_FILE).open("a", encoding="utf-8") as file:
            file.write(line + "\n")

    def update_details(self, **details: Any) -> None:
        """Change details of status.json (the actors' pids after a replacement), not the state."""
        self._status.update(details)
        _write_atomic(self.path / STATUS_FILE, json.dumps(self._status, indent=2) + "\n")

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        transitions = self._status.setdefault("transitions", [])
        transitions.append({"state": state, "at": time.time()})
        self._status.update(state=state, error=error, **details)
        _write_atomic(self.path / STATUS_FILE, json.dumps(self._status, indent=2) + "\n")

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        append_event_line(self.path, kind, json_safe(data), time.time())

    def take_resume(self, paused_at: int) -> ResumeRequest | None:
        return self._resumes.take_resume(paused_at)

    def refuse(self, request: ResumeRequest, reason: str) -> None:
        self._resumes.refuse(request, reason)


def format_status_line(state: RunState, error: str | None = None) -> str:
    """The line a status change prints: `[kpo] run failed: <error>`."""
    suffix = f": {error}" if error else ""
    return f"[kpo] run {state}{suffix}"


def format_progress_line(record: MetricsRecord, total_steps: int) -> str:
    """The line a learner step prints: the numbers a person watches, step counted to `total`.

    Also prints records read back from JSON, where a NaN became None.
    """

    def num(key: str, spec: str) -> str:
        value = record.get(key)
        return "nan" if value is None else format(value, spec)

    width = len(str(total_steps))
    fields = [
        f"step {record['step']:>{width}}/{total_steps}",
        f"reward {num('reward_mean', '.3f')}",
        f"acc {num('accuracy', '.3f')}",
        f"entropy {num('entropy', '.3f')}",
        f"clip {num('clip_fraction', '.4f')}",
        f"staleness {num('staleness_mean', '.2f')}/{num('staleness_max', '.0f')}",
        f"dropped {num('rollouts_dropped_stale', '')}",
        f"{num('step_seconds', '.2f')}s",
    ]
    return "  ".join(fields)


class ProgressPrinter:
    """One line per learner step with the numbers a person watches, and every status change."""

    def __init__(self, total_steps: int, stream: TextIO = sys.stdout) -> None:
        self._total = total_steps
        self._stream = stream

    def on_status(self, state: RunState, error: str | None = None, **details: Any) -> None:
        print(format_status_line(state, error), file=self._stream, flush=True)

    def on_metrics(self, record: MetricsRecord) -> None:
        print(format_progress_line(record, self._total), file=self._stream, flush=True)
