"""Setting up the slots' cgroups under a delegated cgroup (`KPO_SANDBOX_CGROUP`).

cgroup v2 enables controllers for a cgroup's children only while it holds no process itself.
Under the chart's `tini --` entrypoint the container's cgroup holds tini (PID 1) beside the
server, so every process of it, not only the server, must move to `<base>/server` first: moving
the server alone left tini there, and enabling the controllers failed (EBUSY) whenever the
server ran with `KPO_SANDBOX_CGROUP=auto`.

The layout is checked on a directory laid out as a cgroup tree of plain files (the files the
code writes), and the moves on a real cgroup v2 hierarchy where this machine lets a test make a
cgroup of its own; the controllers' limits themselves are test_sandbox_memory.py's.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from services.tools.cgroup import (
    CgroupUnavailable,
    SlotCgroups,
    move_processes,
    own_cgroup,
    vacate,
)

MIB = 2**20


def cgroup_tree(root: Path, procs: str) -> Path:
    """A directory with the files of a cgroup v2 that has the memory and pids controllers and
    holds the processes `procs` (cgroup.procs' text)."""
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text(procs)
    return root


def test_every_process_of_the_base_moves_out_before_the_controllers_are_enabled(
    tmp_path: Path,
) -> None:
    # tini (PID 1) and the server: both in the container's cgroup.
    base = cgroup_tree(tmp_path / "pod", "1\n4242\n")
    cgroups = SlotCgroups(base, slots=2, memory_bytes=512 * MIB, pids=8)
    assert (base / "server" / "cgroup.procs").read_text() == "1\n4242\n"
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"
    for slot in (0, 1):
        call = base / f"call-{slot}"
        assert cgroups.path(slot) == call
        assert (call / "memory.max").read_text() == str(512 * MIB)
        assert (call / "pids.max").read_text() == "8"
        assert (call / "memory.oom.group").read_text() == "1"


def test_a_base_without_processes_gets_no_server_cgroup(tmp_path: Path) -> None:
    base = cgroup_tree(tmp_path / "delegated", "")
    assert vacate(base) == []
    assert not (base / "server").exists()


def test_a_base_without_the_controllers_is_refused(tmp_path: Path) -> None:
    base = cgroup_tree(tmp_path / "pod", "1\n")
    (base / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(CgroupUnavailable, match="no memory or pids controller"):
        SlotCgroups(base, slots=1, memory_bytes=512 * MIB, pids=8)
    assert not (base / "server").exists()  # refused before anything moved


@pytest.fixture
def real_cgroup() -> Iterator[Path]:
    """A new cgroup v2 of this test's own, below this process's; skipped where none can be
    made (no cgroup v2, or not writable here)."""
    try:
        path = own_cgroup() / f"kpo-test-{os.getpid()}"
        path.mkdir()
    except (OSError, CgroupUnavailable) as error:
        pytest.skip(f"cannot make a cgroup v2 here: {error}")
    try:
        yield path
    finally:
        for leaf in (path / "server", path):
            with suppress(FileNotFoundError):
                leaf.rmdir()


def listed(cgroup: Path) -> list[int]:
    return sorted(int(pid) for pid in (cgroup / "cgroup.procs").read_text().split())


def test_processes_move_on_a_real_cgroup_and_one_gone_is_no_error(real_cgroup: Path) -> None:
    # pid_max is never a process's pid: the kernel answers ESRCH for it, as for a process that
    # exited after the base's cgroup.procs listed it.
    gone = int(Path("/proc/sys/kernel/pid_max").read_text())
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    pids = sorted(sleeper.pid for sleeper in sleepers)
    try:
        assert move_processes([pids[0], gone, pids[1]], real_cgroup) == pids
        assert listed(real_cgroup) == pids
        assert vacate(real_cgroup) == pids
        assert listed(real_cgroup) == []
        assert listed(real_cgroup / "server") == pids
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
