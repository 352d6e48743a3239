"""The `/metrics` export: per-run training metrics read from the store, and the API's own metrics.

Run metrics are not kept in process-local prometheus-client objects: `StoreCollector` reads them
from the store when Prometheus scrapes, so a restarted (or second) control-plane process exports
the same values. What it caches is only what makes a scrape cheap: the runs it has seen (new runs
are found by reading the run list down to the newest run already known, and only unfinished runs
are read again) and, per exported run, the last step read, the latest record and the histogram
buckets so far. A scrape therefore reads the records written since the previous scrape, never a
whole history again.

Exported per run (label `run_id`) while the run is `running` and for `finished_grace_s` after it
finished (so the final values are scraped at least once), as services/metrics.py declares each
record key, with its name and help text:

- gauges of the latest metrics record (`RUN_GAUGES`, and `STAGE_GAUGES` labelled
  `stage="raw"|"filtered"`: the ratio diagnostics of exp(z) and of the estimator's ratio; and
  `SHADOW_GAUGES` labelled `estimator="token"|...`: the shadow estimators' of a run with
  `algorithm.shadow`, from the record keys `shadow_<estimator>_<key>`);
- counters from the record's cumulative fields (`RUN_COUNTERS`);
- histograms built from every record's per-step durations (`RUN_HISTOGRAMS`).

Values that are missing, None, non-numeric or not finite in a record are skipped rather than
exported.

Not exported: queued runs (they have no metrics yet) and runs that finished before the grace
period; a declared key that a record does not hold simply gives no samples.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from services.metrics import EVAL_KEYS, SHADOW_ESTIMATORS, STAGES, Kind, exported
from services.pipeline.pause import ACTION_EVENT
from services.store import (
    TERMINAL_STATUSES,
    Event,
    RunNotFound,
    RunRecord,
    RunStatus,
    Store,
    StoreError,
)
from services.store.base import METRICS_REWOUND_EVENT

# Runs read per `list_runs` page, and records per `read_metrics` call.
RUN_PAGE = 100
RECORD_PAGE = 1000
# How long a finished run stays exported: a few scrape intervals, so its last values land.
FINISHED_GRACE_S = 300.0
# Learner steps take from a fraction of a second (tiny CPU model) to minutes (large GPU model).
STEP_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
API_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Distinct `route` label values ApiMetrics accepts before it folds new ones into "other".
MAX_ROUTES = 200
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The classic text format, which every Prometheus version reads. prometheus-client's own
# CONTENT_TYPE_LATEST now says version=1.0.0 (UTF-8 names), which older servers do not know; the
# body is the same for names like ours, which are all legacy-valid.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class RecordMetric:
    """One exported family and the metrics-record key it comes from (services/metrics.py)."""

    name: str
    key: str
    help: str


def _families(kind: Kind, staged: bool = False, shadowed: bool = False) -> tuple[RecordMetric, ...]:
    return tuple(
        RecordMetric(m.prometheus, m.key, m.help)
        for m in exported(kind, staged, shadowed)
        if m.prometheus is not None
    )


# The exported families, in the order of services/metrics.py's declaration.
RUN_GAUGES = _families(Kind.GAUGE)
# Ratio diagnostics, labelled `stage`: record keys `raw_<key>` and `filtered_<key>`.
STAGE_GAUGES = _families(Kind.GAUGE, staged=True)
# The shadow estimators' keys, labelled `estimator`: record keys `shadow_<estimator>_<key>`.
SHADOW_GAUGES = _families(Kind.GAUGE, shadowed=True)
RUN_COUNTERS = _families(Kind.COUNTER)
# Counters of the run's `guard.action` events, one series per value of their `event_labels`.
EVENT_COUNTERS = tuple(m for m in exported(Kind.COUNTER, from_events=True))
# A histogram's key may hold one duration or a list of them (several batches in one step).
RUN_HISTOGRAMS = _families(Kind.HISTOGRAM)


def number(value: Any) -> float | None:
    """`value` as a finite float, or None for anything that is not one (None, NaN, text, bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def durations(value: Any) -> list[float]:
    """The finite, non-negative durations a histogram key holds: one number or a list."""
    values = value if isinstance(value, list) else [value]
    return [v for v in map(number, values) if v is not None and v >= 0]


class Buckets:
    """A histogram's counts per bucket (not cumulative), sum and count, grown one value at a time.

    `bounds` are the finite upper bounds, ascending; a last bucket holds the rest (+Inf).
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is <=).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count of values <= le) pairs as the text format wants them, ending with +Inf."""
        pairs, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            pairs.append(("+Inf" if bound == math.inf else repr(bound), float(total)))
        return pairs


@dataclass
class RunSeries:
    """What the collector keeps of one exported run between scrapes."""

    last_step: int = -1
    latest: dict[str, Any] = field(default_factory=dict)
    histograms: dict[str, Buckets] = field(
        default_factory=lambda: {h.name: Buckets(STEP_BUCKETS_S) for h in RUN_HISTOGRAMS}
    )
    last_event: str | None = None  # the id of the last event read
    # Per EVENT_COUNTERS name: the count of the run's guard.action events per label values.
    event_counts: dict[str, collections.Counter[tuple[str, ...]]] = field(
        default_factory=lambda: {c.prometheus or "": collections.Counter() for c in EVENT_COUNTERS}
    )

    def add_event(self, event: Event) -> None:
        """Take in the run's next event (in order)."""
        self.last_event = event.id
        if event.kind == METRICS_REWOUND_EVENT:
            # The store dropped the records after this step; the steps trained again follow.
            self.last_step = min(self.last_step, int(event.data["step"]))
            return
        if event.kind != ACTION_EVENT:
            return
        for counter in EVENT_COUNTERS:
            labels = tuple(str(event.data.get(label)) for label in counter.event_labels)
            self.event_counts[counter.prometheus or ""][labels] += 1

    def add(self, record: Mapping[str, Any]) -> None:
        """Take in the next record (in step order)."""
        self.last_step = int(record["step"])
        # An evaluation's values are in one record only, but stay the latest evaluation's
        # until the next one: carried over, where every other gauge is the latest record's.
        evaluated = {key: self.latest[key] for key in EVAL_KEYS if key in self.latest}
        self.latest = {**evaluated, **record}
        for spec in RUN_HISTOGRAMS:
            for value in durations(record.get(spec.key)):
                self.histograms[spec.name].observe(value)


@dataclass(frozen=True)
class RunState:
    """A run's status and, once it finished, when (Unix seconds)."""

    status: RunStatus
    finished_at: float | None


class RunIndex:
    """The status of every run, refreshed at a cost of the new runs plus the unfinished ones.

    `list_runs` pages newest first by creation order, so the runs not yet known are those before
    the first known one. A finished run never changes again and is not read again.
    """

    def __init__(self) -> None:
        self.runs: dict[str, RunState] = {}

    def refresh(self, store: Store) -> None:
        """Read new runs and the current state of every unfinished run."""
        for run_id, state in list(self.runs.items()):
            if state.status not in TERMINAL_STATUSES:
                try:
                    self.runs[run_id] = _state(store.get_run(run_id))
                except RunNotFound:  # the store lost it (a Redis without persistence)
                    del self.runs[run_id]
        # Added only once the whole listing was read: a listing cut short by a store error must
        # not leave the older, unread runs behind a run that is already known.
        self.runs.update(list(self._new_runs(store)))

    def _new_runs(self, store: Store) -> Iterator[tuple[str, RunState]]:
        cursor: str | None = None
        while True:
            page, cursor = store.list_runs(limit=RUN_PAGE, cursor=cursor)
            for run in page:
                if run.id in self.runs:
                    return
                yield run.id, _state(run)
            if cursor is None:
                return

    def exported(self, now: float, grace_s: float) -> list[str]:
        """Runs whose metrics are exported: running, or finished less than `grace_s` ago."""
        return [
            run_id
            for run_id, state in self.runs.items()
            if state.status is RunStatus.RUNNING
            or (state.finished_at is not None and now - state.finished_at < grace_s)
        ]

    def counts(self) -> dict[RunStatus, int]:
        """How many runs have each status (every status present, zero included)."""
        counts = dict.fromkeys(RunStatus, 0)
        for state in self.runs.values():
            counts[state.status] += 1
        return counts


def _state(run: RunRecord) -> RunState:
    finished = run.status in TERMINAL_STATUSES
    return RunState(run.status, run.transitions[-1].at.timestamp() if finished else None)


class StoreCollector(Collector):
    """Run metrics from the store, evaluated at every scrape (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        finished_grace_s: float = FINISHED_GRACE_S,
        clock: Callable[[], float] = time.time,
        version: str | None = None,
    ) -> None:
        self.store = store
        self.finished_grace_s = finished_grace_s
        self.clock = clock
        self.version = version or _package_version()
        self.index = RunIndex()
        self.series: dict[str, RunSeries] = {}
        # Scrapes may come concurrently (the route runs in a thread pool); the caches are shared.
        self._lock = threading.Lock()

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            store_up = self._refresh()
            yield from self._system_metrics(store_up)
            yield from run_metrics(self.series)

    def describe(self) -> Iterable[Metric]:
        # Registering must not read the store: no description, so no collect() at registration.
        return []

    def _refresh(self) -> bool:
        """Bring the caches up to date; False when the store could not be read (values then
        stay as of the last successful scrape, and `kpo_store_up` says so)."""
        try:
            self.index.refresh(self.store)
            exported = set(self.index.exported(self.clock(), self.finished_grace_s))
            for run_id in set(self.series) - exported:
                del self.series[run_id]
            for run_id in exported:
                self._advance(run_id, self.series.setdefault(run_id, RunSeries()))
        except StoreError:
            return False
        return True

    def _advance(self, run_id: str, series: RunSeries) -> None:
        """Read the events after the last event seen, then the records after the last step
        seen, page by page. Events first: a rewind among them moves the last step back before
        the records trained again are read."""
        while True:
            events = self.store.read_events(run_id, series.last_event, RECORD_PAGE)
            for event in events:
                series.add_event(event)
            if len(events) < RECORD_PAGE:
                break
        while True:
            records = self.store.read_metrics(run_id, series.last_step, RECORD_PAGE)
            for record in records:
                series.add(record)
            if len(records) < RECORD_PAGE:
                return

    def _system_metrics(self, store_up: bool) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "kpo_build_info", "The control plane's version (always 1).", labels=["version"]
        )
        info.add_metric([self.version], 1.0)
        yield info
        yield GaugeMetricFamily(
            "kpo_store_up", "Whether the last scrape could read the store.", value=float(store_up)
        )
        runs = GaugeMetricFamily("kpo_runs", "Runs in the store by status.", labels=["status"])
        for status, count in self.index.counts().items():
            runs.add_metric([status.value], float(count))
        yield runs


def run_metrics(series: Mapping[str, RunSeries]) -> Iterator[Metric]:
    """The per-run families of the exported runs' cached series."""
    ordered = sorted(series.items())
    for spec in RUN_GAUGES:
        gauge = GaugeMetricFamily(spec.name, spec.help, labels=["run_id"])
        for run_id, run in ordered:
            _add_value(gauge, [run_id], run.latest.get(spec.key))
        yield gauge
    for spec in STAGE_GAUGES:
        gauge = GaugeMetricFamily(spec.name, spec.help, labels=["run_id", "stage"])
        for run_id, run in ordered:
            for stage in STAGES:
                _add_value(gauge, [run_id, stage], run.latest.get(f"{stage}_{spec.key}"))
        yield gauge
    for spec in SHADOW_GAUGES:
        gauge = GaugeMetricFamily(spec.name, spec.help, labels=["run_id", "estimator"])
        for run_id, run in ordered:
            for name in SHADOW_ESTIMATORS:
                key = f"shadow_{name}_{spec.key}"
                _add_value(gauge, [run_id, name], run.latest.get(key))
        yield gauge
    for spec in RUN_COUNTERS:
        counter = CounterMetricFamily(spec.name, spec.help, labels=["run_id"])
        for run_id, run in ordered:
            _add_value(counter, [run_id], run.latest.get(spec.key))
        yield counter
    for declared in EVENT_COUNTERS:
        name = declared.prometheus or ""
        counter = CounterMetricFamily(
            name, declared.help, labels=["run_id", *declared.event_labels]
        )
        for run_id, run in ordered:
            for labels, count in sorted(run.event_counts[name].items()):
                counter.add_metric([run_id, *labels], float(count))
        yield counter
    for spec in RUN_HISTOGRAMS:
        histogram = HistogramMetricFamily(spec.name, spec.help, labels=["run_id"])
        for run_id, run in ordered:
            buckets = run.histograms[spec.name]
            if any(buckets.counts):  # no observations: no samples, rather than a row of zeros
                histogram.add_metric([run_id], buckets.cumulative(), buckets.sum)
        yield histogram


def _add_value(
    family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], raw: Any
) -> None:
    value = number(raw)
    if value is not None:
        family.add_metric(labels, value)


class ApiMetrics:
    """Request counts and latencies of the control plane, by method, route template and status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kpo_api_requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "kpo_api_request_duration_seconds",
            "Time to answer an HTTP request (to the first byte of a streamed body).",
            ["method", "route"],
            buckets=API_BUCKETS_S,
            registry=registry,
        )
        self._routes: set[str] = set()
        self._lock = threading.Lock()

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered request. `route` is the path template (`/v1/runs/{run_id}`)."""
        method = method.upper() if method.upper() in HTTP_METHODS else "OTHER"
        route = self._bounded(route)
        self.requests.labels(method, route, str(int(status))).inc()
        self.duration.labels(method, route).observe(max(0.0, seconds))

    def _bounded(self, route: str) -> str:
        # A caller that passed raw paths would create a series per URL; cap the label's values.
        with self._lock:
            if route in self._routes or len(self._routes) < MAX_ROUTES:
                self._routes.add(route)
                return route
        return "other"


def build_registry(store: Store) -> tuple[CollectorRegistry, ApiMetrics]:
    """A registry of this app's own (not the global one) holding both kinds of metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry, ApiMetrics(registry)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus text format, and its content type.

    Reads the store (see `StoreCollector`), so call it from a worker thread, not the event loop.
    """
    return generate_latest(registry), CONTENT_TYPE


def _package_version() -> str:
    try:
        return metadata.version("kpo-rl")
    except metadata.PackageNotFoundError:  # running from a checkout that was not installed
        return "unknown"
