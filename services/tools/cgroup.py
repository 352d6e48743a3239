"""A cgroup v2 per slot, so that memory and processes are bounded per call, not per process.

RLIMIT_AS bounds one process: a call of `nproc` processes can hold `nproc` times `memory_mb`,
plus what it keeps outside any address space. A cgroup bounds them together. It needs a
delegated cgroup: a cgroup v2 directory this process may write, with the memory and pids
controllers available. `KPO_SANDBOX_CGROUP` names it (opt-in: the server does not move itself
between cgroups unasked): a cgroup's directory (under /sys/fs/cgroup), or `auto` for this
process's own cgroup (a container's, where the runtime delegates it).

The layout follows cgroup v2's rule that only leaves hold processes once controllers are enabled
below a cgroup: every process in `<base>` itself moves into `<base>/server` (this process, and
under the chart's `tini --` entrypoint tini, PID 1, in the container's cgroup beside it), the
memory and pids controllers are enabled in `<base>`, and slot N's calls run in `<base>/call-N`
with memory.max (the call's memory, its tmpfs pages included), memory.swap.max 0, pids.max
(its processes and threads) and memory.oom.group 1 (an out-of-memory kill ends the whole call,
not one of its processes at random). A call's first process moves itself into its slot's
cgroup before it execs anything, so nothing it forks starts outside it; `kill` (cgroup.kill)
ends whatever of a call is left.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

ENV_VARIABLE = "KPO_SANDBOX_CGROUP"
CONTROLLERS = ("memory", "pids")


class CgroupUnavailable(RuntimeError):
    """The configured cgroup cannot bound calls (not cgroup v2, not writable, no controller)."""


def cgroup2_mount() -> Path:
    """Where the cgroup v2 hierarchy is mounted: /sys/fs/cgroup, or (a hybrid host's)
    /sys/fs/cgroup/unified."""
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        for line in mounts:
            fields, _, source = line.partition(" - ")
            if source.split()[:1] == ["cgroup2"]:
                return Path(fields.split()[4])
    raise CgroupUnavailable("no cgroup v2 hierarchy is mounted")


def own_cgroup() -> Path:
    """This process's cgroup v2 directory (the `0::` line of /proc/self/cgroup)."""
    with open("/proc/self/cgroup", encoding="utf-8") as cgroups:
        for line in cgroups:
            hierarchy, _, path = line.rstrip("\n").partition("::")
            if hierarchy == "0":
                return cgroup2_mount() / path.lstrip("/")
    raise CgroupUnavailable("this process is in no cgroup v2 hierarchy")


def configured_base() -> Path | None:
    """The delegated cgroup KPO_SANDBOX_CGROUP names, None when it is unset or empty."""
    value = os.environ.get(ENV_VARIABLE, "").strip()
    if not value:
        return None
    return own_cgroup() if value == "auto" else Path(value)


def _write(path: Path, value: str) -> None:
    with open(path, "w", encoding="ascii") as file:
        file.write(value)


def vacate(base: Path) -> list[int]:
    """Move every process of cgroup `base` into `<base>/server` (made when there is one); the
    pids moved."""
    pids = [int(pid) for pid in (base / "cgroup.procs").read_text().split()]
    if not pids:
        return []
    (base / "server").mkdir(exist_ok=True)
    return move_processes(pids, base / "server")


def move_processes(pids: list[int], cgroup: Path) -> list[int]:
    """Move the processes `pids` into `cgroup`; those moved (one that has exited since it was
    listed is not, and is no error)."""
    moved = []
    # Unbuffered: cgroup.procs takes one pid per write(2), and says which one failed.
    with open(cgroup / "cgroup.procs", "wb", buffering=0) as procs:
        for pid in pids:
            try:
                procs.write(f"{pid}\n".encode())
            except ProcessLookupError:  # ESRCH: gone since it was listed
                continue
            moved.append(pid)
    return moved


class SlotCgroups:
    """`<base>/call-<slot>` for each slot, limited as one call may be."""

    def __init__(self, base: Path, slots: int, memory_bytes: int, pids: int) -> None:
        self.base = base
        try:
            controllers = (base / "cgroup.controllers").read_text().split()
        except OSError as error:
            raise CgroupUnavailable(f"{base} is not a cgroup v2 directory: {error}") from error
        missing = [name for name in CONTROLLERS if name not in controllers]
        if missing:
            raise CgroupUnavailable(f"{base} has no {' or '.join(missing)} controller")
        try:
            self._enable(base)
            for slot in range(slots):
                self._limit(self.path(slot), memory_bytes, pids)
        except OSError as error:
            raise CgroupUnavailable(f"cannot set up call cgroups under {base}: {error}") from error

    @staticmethod
    def _enable(base: Path) -> None:
        # A cgroup with processes of its own cannot enable controllers for its children.
        vacate(base)
        try:
            _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
        except OSError as error:
            if error.errno != errno.EBUSY:
                raise
            left = " ".join((base / "cgroup.procs").read_text().split())
            raise CgroupUnavailable(
                f"cannot enable {' and '.join(CONTROLLERS)} below {base}: processes are still "
                f"in it ({left or 'none listed'}), and cgroup v2 enables controllers only "
                "above cgroups without processes of their own"
            ) from error

    @staticmethod
    def _limit(path: Path, memory_bytes: int, pids: int) -> None:
        path.mkdir(exist_ok=True)
        _write(path / "memory.max", str(memory_bytes))
        _write(path / "pids.max", str(pids))
        _write(path / "memory.oom.group", "1")
        if (path / "memory.swap.max").exists():  # absent where the kernel has no swap accounting
            _write(path / "memory.swap.max", "0")

    def path(self, slot: int) -> Path:
        return self.base / f"call-{slot}"

    def procs(self, slot: int) -> str:
        """The file a call's first process writes its pid to, to enter its slot's cgroup."""
        return str(self.path(slot) / "cgroup.procs")

    def kill(self, slot: int) -> None:
        """SIGKILL every process left in the slot's cgroup (cgroup.kill, Linux 5.14)."""
        _write(self.path(slot) / "cgroup.kill", "1")

    def peak_bytes(self, slot: int) -> int | None:
        """The most memory the slot's calls have held at once (memory.peak, Linux 5.19)."""
        try:
            return int((self.path(slot) / "memory.peak").read_text())
        except (OSError, ValueError):
            return None
