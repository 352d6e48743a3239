"""A run's curves.png, redrawn in a child process while the run goes on.

Why not in the driver: importing matplotlib costs the driver about 37 MiB, and every drawing
leaves some more behind in the allocator (freed, but not returned to the system: about 8 MiB
per drawing of the demo's curves, measured by benchmarks/soak.py), so a driver that draws at
every checkpoint grows for as long as the run lives. A child's memory all goes back when it
exits. The child also keeps the event loop free while a long run's curves are drawn.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import services

log = logging.getLogger(__name__)

# Where `services` is imported from, for the child: it runs the same code as the driver.
_PACKAGE_ROOT = str(Path(services.__file__).resolve().parent.parent)
ERROR_TAIL_CHARS = 2000


class CurveDrawer:
    """Redraws `out_dir`'s curves.png in a child process (`python -m services.pipeline.plots`),
    one at a time.

    `redraw()` starts a drawing, or, while one is under way, has the next drawing start once it
    is done (it would miss the newest records). `finish()` waits for the drawing under way and
    the one it still owes. A drawing that fails is logged with what it printed; it never fails
    the run, whose metrics file holds everything the curves show.
    """

    def __init__(self, out_dir: Path, title: str = "") -> None:
        self.out_dir = out_dir
        self.title = title
        self._child: subprocess.Popen[bytes] | None = None
        self._child_errors: IO[bytes] | None = None
        self._owed = False

    @property
    def drawing(self) -> bool:
        """Whether a child is drawing (reaped if it has ended)."""
        if self._child is not None and self._child.poll() is not None:
            self._reap()
        return self._child is not None

    def redraw(self) -> None:
        if self.drawing:
            self._owed = True
            return
        self._start()

    def poll(self) -> None:
        """Start the drawing owed once the one under way has ended; cheap, for the event loop."""
        if self._owed and not self.drawing:
            self._start()

    def finish(self, timeout_s: float = 300.0) -> None:
        """Wait for the drawing under way and the one owed, so that the curves show every
        record; a child past `timeout_s` is killed (the previous curves.png stays)."""
        for _ in range(2):
            if self._child is not None:
                try:
                    self._child.wait(timeout_s)
                    self._reap()
                except subprocess.TimeoutExpired:
                    self._child.kill()
                    self._child.wait()
                    self._reap(report=False)
                    log.warning("drawing %s took over %.0f s; killed", self.out_dir, timeout_s)
            if not self._owed:
                return
            self._start()

    def _start(self) -> None:
        self._owed = False
        # Closed by `_reap`, once the child has ended: it outlives this call.
        self._child_errors = tempfile.TemporaryFile()  # noqa: SIM115
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "services.pipeline.plots", str(self.out_dir)]
        self._child = subprocess.Popen(
            [*command, "--title", self.title],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._child_errors,
            env=env,
        )

    def _reap(self, report: bool = True) -> None:
        child, errors = self._child, self._child_errors
        self._child = self._child_errors = None
        assert child is not None and errors is not None
        if report and child.returncode != 0:
            errors.seek(0)
            printed = errors.read().decode("utf-8", "replace")[-ERROR_TAIL_CHARS:]
            log.warning(
                "drawing the curves of %s failed (exit code %s): %s",
                self.out_dir,
                child.returncode,
                printed.strip() or "it printed nothing",
            )
        errors.close()
