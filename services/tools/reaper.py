"""Reaping what sandbox calls leave to this process.

bwrap's outer process (the child the runner started) exits as soon as the namespace's init
tells it the code's exit status, without waiting for that init, which is still exiting (or,
when the call was killed, dying of --die-with-parent). The init is then an orphan: the kernel
hands it to the nearest child subreaper among its ancestors, else to PID 1. A process of the
`process` backend that leaves its session (setsid, a double fork) is an orphan the same way once
the call ends. An orphan that nobody reaps stays a zombie, and a zombie counts against its uid's
RLIMIT_NPROC: a sandbox server that is PID 1 of its container (no init; Python never reaps what
it did not start) reaches "bwrap: Can't fork" after a few hundred calls, while it looks alive.

So when this process is PID 1 or a child subreaper (`become_subreaper`: `kpo sandbox serve` is
one), the runner reaps, after each call, the orphans of calls among its children. Only those:
`waitpid(-1)` would also take the exit status of a child that subprocess.Popen is waiting for
(Popen then reports exit status 0). An orphan of a call is told apart by what no Popen child of
this process is: the init of a pid namespace below ours (NSpid ends in 1; bwrap's init), or a
process of a per-slot uid (only that slot's own call, already reaped, ever ran as it). Each is
pinned by a pidfd before it is checked and reaped through that pidfd (waitid P_PIDFD), so a pid
reused in between is never taken for it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import time
from contextlib import suppress

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
# Orphans of calls are already dying (--die-with-parent, or killed with their uid): this bounds
# how long one call's cleanup waits for them, should the kernel be slow to tear a namespace down.
REAP_WAIT_S = 5.0

_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphans of this process's descendants come to it, not to PID 1 (prctl(2))."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(number)}")


def is_reaper() -> bool:
    """Whether orphans come to this process: it is PID 1 (of its pid namespace) or a child
    subreaper."""
    if os.getpid() == 1:
        return True
    flag = ctypes.c_int(0)
    return _libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and bool(
        flag.value
    )


def children() -> list[int]:
    """This process's children, those of every thread (a child's parent is the thread that
    forked it; an orphan's is the one the kernel picked)."""
    found: list[int] = []
    with suppress(FileNotFoundError):
        for task in os.listdir("/proc/self/task"):
            path = f"/proc/self/task/{task}/children"
            with suppress(FileNotFoundError, ProcessLookupError), open(path, "rb") as listing:
                found += [int(pid) for pid in listing.read().split()]
    return found


def _status(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as status:
            lines = status.read().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def is_call_orphan(status: dict[str, str], slot_uid: int | None) -> bool:
    """Whether a child of this process with this /proc status is an orphan of a sandbox call
    (see the module docstring): a pid namespace's init, or (slot_uid) a process of that uid."""
    nspid = status.get("NSpid", "").split()
    if len(nspid) > 1 and nspid[-1] == "1":
        return True
    real_uid = status.get("Uid", "").split()[:1]
    return slot_uid is not None and real_uid == [str(slot_uid)]


def reap_call_orphans(slot_uid: int | None = None, wait_s: float = REAP_WAIT_S) -> int:
    """Reap the orphans of calls among this process's children, waiting up to `wait_s` in all
    for those still exiting; how many were reaped. Nothing to do unless `is_reaper()`."""
    if not is_reaper():
        return 0
    deadline = time.monotonic() + wait_s
    reaped = 0
    for pid in children():
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            reaped += _reap_if_orphan(pid, pidfd, slot_uid, deadline)
        finally:
            os.close(pidfd)
    return reaped


def _reap_if_orphan(pid: int, pidfd: int, slot_uid: int | None, deadline: float) -> int:
    status = _status(pid)
    try:
        # Still the process the pidfd holds: /proc/{pid} was not a reused pid's.
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return 0
    if status is None or not is_call_orphan(status, slot_uid):
        return 0
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        log.warning("sandbox: orphan %d of a call has not exited; left for a later call", pid)
        return 0
    try:
        return int(os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None)
    except ChildProcessError:  # another thread's cleanup reaped it first
        return 0
