"""curves.png redrawn in a child process (`CurveDrawer`): from the run's metrics file, never in
the driver's own process, the newest records included once `finish` returns, and a drawing that
fails or hangs reported without failing anything."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.pipeline.curves import CurveDrawer
from services.pipeline.outputs import CURVES_FILE, METRICS_FILE, RunDirectory
from services.pipeline.plots import draw_run_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_records(run_dir: RunDirectory, steps: range) -> None:
    for step in steps:
        run_dir.on_metrics({"step": step, "reward_mean": step / 10, "entropy_mean": 1 / step})


def test_the_curves_are_drawn_in_a_child_and_the_driver_never_imports_matplotlib(
    tmp_path: Path,
) -> None:
    write_records(RunDirectory(tmp_path), range(1, 11))
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from services.pipeline.curves import CurveDrawer
        drawer = CurveDrawer(Path({str(tmp_path)!r}), "demo")
        drawer.redraw()
        drawer.finish()
        print("matplotlib" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stderr
    assert (tmp_path / CURVES_FILE).read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob(".*partial"))  # written aside, renamed into place


def test_after_finish_the_curves_show_every_record_even_if_one_came_mid_drawing(
    tmp_path: Path,
) -> None:
    run_dir = RunDirectory(tmp_path / "run")
    write_records(run_dir, range(1, 6))
    drawer = CurveDrawer(run_dir.path, "t")
    drawer.redraw()
    write_records(run_dir, range(6, 21))
    drawer.redraw()  # owed if the first is still drawing, started at once otherwise
    drawer.finish()
    assert not drawer.drawing
    # The same records drawn here, in this process, give the very same picture.
    reference = RunDirectory(tmp_path / "reference")
    write_records(reference, range(1, 21))
    expected = draw_run_curves(reference.path, "t")
    assert expected is not None
    assert (run_dir.path / CURVES_FILE).read_bytes() == expected.read_bytes()


def test_a_run_without_records_draws_nothing(tmp_path: Path) -> None:
    drawer = CurveDrawer(tmp_path, "t")
    drawer.redraw()
    drawer.finish()
    assert not (tmp_path / CURVES_FILE).exists()


def test_a_drawing_that_fails_is_logged_with_what_it_printed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "reward_mean": 0.5}\nnot json\n')
    drawer = CurveDrawer(tmp_path, "t")
    with caplog.at_level(logging.WARNING, logger="services.pipeline.curves"):
        drawer.redraw()
        drawer.finish()
    [warning] = caplog.records
    assert f"drawing the curves of {tmp_path} failed (exit code 1)" in warning.message
    assert "JSONDecodeError" in warning.message
    assert not (tmp_path / CURVES_FILE).exists()


def test_a_drawing_that_hangs_is_killed_at_finish_and_the_previous_curves_stay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = RunDirectory(tmp_path)
    write_records(run_dir, range(1, 4))
    drawn = draw_run_curves(tmp_path, "t")
    assert drawn is not None
    before = drawn.read_bytes()
    # A metrics "file" that is a fifo nobody writes: the child blocks opening it.
    (tmp_path / METRICS_FILE).unlink()
    os.mkfifo(tmp_path / METRICS_FILE)
    drawer = CurveDrawer(tmp_path, "t")
    with caplog.at_level(logging.WARNING, logger="services.pipeline.curves"):
        drawer.redraw()
        drawer.finish(timeout_s=1.0)
    assert [r.message for r in caplog.records] == [f"drawing {tmp_path} took over 1 s; killed"]
    assert not drawer.drawing
    assert drawn.read_bytes() == before
