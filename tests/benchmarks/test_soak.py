"""The soak test's readings and figures: /proc parsing, status.json, metrics tail, RSS growth."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from soak import (
    Sample,
    actor_processes,
    growth,
    growths,
    last_step,
    parse_start_ticks,
    parse_vm_rss_kib,
    read_rss_mib,
    slope,
)

STATUS = """Name:\tpython
State:\tS (sleeping)
VmPeak:\t 2048000 kB
VmRSS:\t  123456 kB
RssAnon:\t  100000 kB
"""


def test_vm_rss_is_read_in_kib() -> None:
    assert parse_vm_rss_kib(STATUS) == 123456


def test_a_process_without_vm_rss_has_none() -> None:
    assert parse_vm_rss_kib("Name:\tkthreadd\nState:\tS (sleeping)\n") is None


def test_a_vm_rss_in_another_unit_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_vm_rss_kib("VmRSS:\t 12 MB\n")


def test_start_ticks_are_field_22_even_with_parentheses_in_the_name() -> None:
    fields_after_name = ["S", *(str(n) for n in range(4, 52))]  # fields 3.. of the line
    line = "4242 (ray::Learner (x) y) " + " ".join(fields_after_name)
    assert parse_start_ticks(line) == 22


def test_own_rss_is_read_from_proc() -> None:
    rss = read_rss_mib(os.getpid())
    assert rss is not None and rss > 1
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    assert read_rss_mib(os.getpid(), parse_start_ticks(stat)) == pytest.approx(rss, rel=0.5)
    assert read_rss_mib(os.getpid(), parse_start_ticks(stat) + 1) is None  # a reused pid


def test_actors_of_a_status_file_are_named_by_role() -> None:
    status = {"actors": {"generation": [11, 12], "verifiers": [21], "learner": [31]}}
    assert actor_processes(status) == [
        ("generation-0", 11),
        ("generation-1", 12),
        ("verifier-0", 21),
        ("learner", 31),
    ]
    assert actor_processes({"state": "queued"}) == []


def test_last_step_skips_a_line_still_being_written(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert last_step(path) == 0
    records = "".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in (1, 2, 3))
    path.write_text(records + '{"step": 4, "rew')
    assert last_step(path) == 3


def test_slope_of_a_line_and_of_too_few_points() -> None:
    assert slope([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == pytest.approx(2.0)
    assert math.isnan(slope([(0.0, 1.0)]))
    assert math.isnan(slope([(1.0, 1.0), (1.0, 2.0)]))


def test_growth_starts_after_the_warm_up() -> None:
    # 100 MiB while loading, then 500 MiB growing by 1 MiB a minute for an hour.
    points: list[tuple[float, float | None]] = [(0.0, 100.0)]
    points += [(60.0 * m, 500.0 + (m - 2)) for m in range(2, 63)]
    result = growth("learner", 7, points, warmup_s=120.0)
    assert (result.start_mib, result.end_mib, result.growth_mib) == (500.0, 560.0, 60.0)
    assert result.mib_per_hour == pytest.approx(60.0)
    assert result.fit_mib_per_hour == pytest.approx(60.0)
    assert result.samples == 61 and not result.gone


def test_growth_of_a_run_shorter_than_the_warm_up_uses_every_sample() -> None:
    result = growth("driver", 1, [(0.0, 100.0), (30.0, 101.0)], warmup_s=120.0)
    assert result.start_mib == 100.0 and result.end_mib == 101.0
    assert result.mib_per_hour == pytest.approx(120.0)


def test_a_process_that_went_away_keeps_its_last_reading() -> None:
    result = growth("verifier-0", 3, [(0.0, 90.0), (60.0, 95.0), (120.0, None)], 0.0)
    assert result.end_mib == 95.0 and result.gone
    never = growth("verifier-1", 4, [(0.0, None)], 0.0)
    assert never.gone and math.isnan(never.start_mib)


def test_growths_are_per_process_in_order_of_appearance() -> None:
    samples = [
        Sample(t, 0.0, 0, name, pid, rss)
        for t in (0.0, 60.0)
        for name, pid, rss in (("driver", 1, 400.0 + t), ("learner", 2, 900.0))
    ]
    rows = growths(samples, warmup_s=0.0)
    assert [(g.process, g.growth_mib) for g in rows] == [("driver", 60.0), ("learner", 0.0)]
