"""The driver-memory probe: when it samples and snapshots, and its growth per 1,000 steps."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest
from driver_memory import MemoryProbe, Sample, per_1000_steps


@pytest.fixture
def tracing() -> Iterator[None]:
    tracemalloc.start()
    yield
    tracemalloc.stop()


def test_the_probe_samples_every_n_steps_after_the_warmup_and_snapshots_twice(
    tracing: None,
) -> None:
    probe = MemoryProbe(every=2, warmup=4, last=10)
    kept = []
    for step in range(1, 12):
        probe.on_metrics({"step": step})
        kept.append(bytearray(100_000))  # the heap grows 100 kB a step
    assert [s.step for s in probe.samples] == [4, 6, 8, 10]
    assert probe.first is not None and probe.last is not None
    grown = sum(stat.size_diff for stat in probe.last.compare_to(probe.first, "lineno"))
    assert 550_000 < grown < 700_000  # six steps of 100 kB between steps 4 and 10
    heap = [s.traced_mib for s in probe.samples]
    assert heap == sorted(heap) and heap[-1] - heap[0] > 0.5


def test_growth_per_1000_steps_is_the_least_squares_slope_less_tracings_own_memory() -> None:
    samples = [
        Sample(
            step=100 * i, rss_mib=500 + 0.3 * i + 0.1 * i, traced_mib=20.0, tracemalloc_mib=0.1 * i
        )
        for i in range(1, 6)
    ]
    assert per_1000_steps(samples, "run_rss_mib") == pytest.approx(3.0)
    assert per_1000_steps(samples, "traced_mib") == pytest.approx(0.0)
