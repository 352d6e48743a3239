"""Running one piece of untrusted Python code under a sandbox backend.

The interface the rollouts use is `ToolRunner.run(code) -> ToolResult`; `observation_text`
turns a result into what goes into the model's context. Implementations: `SandboxRunner`
(here: one call in a child of this process), `LocalSandbox` and `HttpSandbox`
(services/tools/client.py).

Backends:
- bwrap (default): bubblewrap. New user, pid, network, ipc, uts (and cgroup) namespaces; no
  network at all; /usr and the few /etc files Python reads bound read-only, the root and /dev
  remounted read-only; a fresh size-capped tmpfs as the working directory of every call;
  nothing of the host's run, data or token directories bound; an empty environment. The
  process tree dies with its parent (--die-with-parent) and the pid namespace dies with it.
  A seccomp filter (services/tools/seccomp.py) denies, with EPERM, the kernel interfaces a
  program has no use for (io_uring, bpf, perf_event_open, ptrace, mounting, namespaces, ...) and
  memory outside any address space (memfd_create, System V shared memory).
- process: the same rlimits, timeout and cleared environment, no namespaces, no filter. Only for
  machines without user namespaces, only when explicitly allowed: the code can read what its
  uid can read and reach the network. Only with per-slot uids (as root): after each call every
  process of the slot's uid is killed, which is how a process that left the call's session
  (setsid, a double fork) is ended; with one uid for all there is no telling a call's processes
  from the server's, and the backend refuses to start.

Both: rlimits on CPU seconds, address space, processes, open files and file size (set by
`prlimit` in the child before it execs the sandbox, so no Python runs between fork and exec in
this threaded process), an oom_score_adj of 1000 (`choom`: under memory pressure the kernel
kills a call, not the server), a wall-clock timeout that kills the whole process group, and
output read at most to the cap (the call is stopped once it prints more: nothing large is ever
buffered). Where KPO_SANDBOX_CGROUP names a delegated cgroup v2 (services/tools/cgroup.py), each
call also runs in a cgroup of its slot, which bounds its memory and processes together.

RLIMIT_NPROC counts every process of a real uid, not of a call. Run as root (a container's
default), each concurrent call therefore runs as its own unprivileged uid from a pool
(`uid_base + slot`), so one call's fork bomb exhausts only its own budget. Run as an ordinary
user there is one uid for all calls and the server: the limit is then a shared budget of
`nproc * slots + NPROC_HEADROOM`, and a fork bomb can make concurrent calls fail to start
until its timeout kills it (bounded; the pod's pids limit is the outer bound).

What calls leave behind is reaped here when this process is PID 1 or a subreaper
(services/tools/reaper.py): a zombie counts against its uid's process limit. A call that could
not start the sandbox at all (no process to fork, nothing to exec: told by bwrap's status, which
the code cannot write) counts towards `unready_reason`, the server's readiness.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from services.tools.cgroup import CgroupUnavailable, SlotCgroups, configured_base
from services.tools.reaper import reap_call_orphans
from services.tools.seccomp import SeccompUnavailable, build_filter

log = logging.getLogger(__name__)

ToolStatus = Literal["ok", "error", "timeout", "refused", "unavailable"]
TOOL_STATUSES: tuple[ToolStatus, ...] = ("ok", "error", "timeout", "refused", "unavailable")
Backend = Literal["bwrap", "process"]

# argv of one exec is capped by the kernel at 128 KiB per argument (MAX_ARG_STRLEN); the code
# travels as `python -c CODE`, so it must fit with room to spare.
MAX_CODE_BYTES = 120_000
# Processes (threads count) the server itself and its thread pool may hold in the shared-uid
# mode, on top of the calls' budgets.
NPROC_HEADROOM = 512
# Bytes of stderr kept (its tail): only its last line is shown.
STDERR_TAIL_BYTES = 8192
DEFAULT_UID_BASE = 200_000
# Processes and threads of a call. Each may hold `memory_mb` of address space, so without a
# cgroup this times memory_mb is what one call can hold: small, where 64 let a call hold 64 GiB.
DEFAULT_NPROC = 16
# Open files of each process of a call: pipes, sockets and memory-backed files hold kernel
# memory that no address space counts, and every one of them needs a descriptor.
DEFAULT_NOFILE = 64
# Kernel memory one descriptor can pin outside every address space (a socket's send buffer).
KERNEL_MIB_PER_DESCRIPTOR = 0.2
# Consecutive calls that could not start the sandbox before the runner reports itself unready.
UNREADY_AFTER = 3
# The trivial call that checks, while unready, whether calls start again.
PROBE_CODE = "print('ok')"
PROBE_TIMEOUT_S = 10.0
KILL_EVERY_PROCESS = """
import os, signal
try:
    os.kill(-1, signal.SIGKILL)
except ProcessLookupError:
    pass
"""
# oom_score_adj of every process of a call: the kernel's first choice when memory runs out.
OOM_SCORE_ADJ = 1000


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call.

    output: stdout, then the error's last line when the code failed, truncated to
      max_output_chars.
    status: ok (exit 0), error (non-zero exit, an exception, or stopped by a limit other than
      the wall clock), timeout (the wall clock), refused (the sandbox would not run it: code
      too large, bad request), unavailable (the sandbox could not be reached in time).
    seconds: wall-clock seconds of the call as the caller saw it.
    timeout_s: the wall-clock limit the call ran under (set with status timeout).
    """

    output: str
    status: ToolStatus
    seconds: float
    timeout_s: float | None = None


class ToolRunner(Protocol):
    def run(self, code: str) -> ToolResult: ...


def observation_text(result: ToolResult) -> str:
    """What goes into the model's context for one call: the output for ok and error (its last
    line is the exception), else a one-line `error: ...` the model can learn to react to,
    after whatever the code printed before it was stopped."""
    if result.status in ("ok", "error"):
        return result.output
    if result.status == "timeout":
        limit = result.timeout_s if result.timeout_s is not None else result.seconds
        text = f"error: timeout after {limit:g} s"
        return f"{result.output}\n{text}" if result.output else text
    if result.status == "refused":
        return f"error: refused: {result.output}" if result.output else "error: refused"
    return "error: sandbox unavailable"


class SandboxUnavailable(RuntimeError):
    """The backend cannot run here (no bwrap, no user namespaces, process not allowed)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one call. cpu_s None: the timeout rounded up plus one second (the wall clock
    then always fires first for a busy loop, with the clearer observation). memory_mb is the
    address space of each process (RLIMIT_AS), and of the whole call where it has a cgroup;
    nproc its processes and threads; nofile the open files of each process."""

    timeout_s: float = 5.0
    cpu_s: int | None = None
    memory_mb: int = 1024
    nproc: int = DEFAULT_NPROC
    file_mb: int = 16
    max_output_chars: int = 1000
    nofile: int = DEFAULT_NOFILE

    def cpu_seconds(self, timeout_s: float) -> int:
        return self.cpu_s if self.cpu_s is not None else math.ceil(timeout_s) + 1

    def worst_case_mib(self, processes: int, calls: int) -> float:
        """The most memory `calls` calls with `processes` processes among them can hold
        without a cgroup (docs/tools.md, "Memory of a call"): each process its address space and
        the kernel buffers of its descriptors (a socket's send buffer is about 208 KiB, so 0.2
        MiB each), and each call its two tmpfs."""
        return processes * (self.memory_mb + self.nofile * KERNEL_MIB_PER_DESCRIPTOR) + (
            calls * 2 * self.file_mb
        )


def find_python() -> str:
    """The system interpreter the sandbox runs: under /usr (the only tree bound), never a
    virtualenv's (it would need the repository bound)."""
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 under /usr/local/bin or /usr/bin")


def _compose(stdout: str, error_line: str, max_chars: int) -> str:
    # The error's line tells the model what went wrong: it keeps its place and stdout gives
    # way when both do not fit.
    if not error_line:
        return stdout[:max_chars]
    error_line = error_line[:max_chars]
    room = max_chars - len(error_line) - 1
    if room <= 0:
        return error_line
    head = stdout[:room]
    return f"{head}\n{error_line}" if head else error_line


def _last_line(stderr: bytes) -> str:
    for line in reversed(stderr.decode("utf-8", "replace").splitlines()):
        if line.strip():
            return line.strip()
    return ""


_SIGNAL_LINES = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "File size limit exceeded",
    signal.SIGKILL: "Killed (SIGKILL)",
    signal.SIGSEGV: "Segmentation fault",
}


def _signal_line(returncode: int) -> str:
    # bwrap reports a child killed by signal N as exit 128 + N; `process` as -N.
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if not number:
        return f"exited with status {returncode}"
    try:
        sig = signal.Signals(number)
    except ValueError:
        return f"killed by signal {number}"
    return _SIGNAL_LINES.get(sig, f"killed by {sig.name}")


def _bwrap_argv(bwrap: str, workdir_bytes: int, seccomp_fd: int, status_fd: int) -> list[str]:
    """bwrap's options; the seccomp program is read from `seccomp_fd`, and bwrap writes its
    status to `status_fd` (JSON lines: the child's pid, then its exit code once it has run)."""
    argv = [
        bwrap,
        "--seccomp",
        str(seccomp_fd),
        "--json-status-fd",
        str(status_fd),
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        # A new session: no controlling terminal to push input into (TIOCSTI).
        "--new-session",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    # Merged /usr (Debian 12, Ubuntu) makes these symlinks; older layouts bind them.
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    # The /etc files Python and libc read, not /etc (it holds the host's secrets and config).
    for name in ("ld.so.cache", "localtime", "alternatives", "ssl/openssl.cnf"):
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    size = str(workdir_bytes)
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        size,
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--size",
        size,
        "--tmpfs",
        "/tmp",
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
        "--clearenv",
    ]
    for key, value in _sandbox_env("/tmp").items():
        argv += ["--setenv", key, value]
    return [*argv, "--"]


def _sandbox_env(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
    }


# A call's first process enters its slot's cgroup (writing its own pid) before it execs the
# rest, so that nothing of the call ever runs outside it: "$1" is the cgroup.procs file.
CGROUP_ENTER = 'echo $$ > "$1" && shift && exec "$@"'


@dataclass(frozen=True)
class _Spawn:
    """What one call's child process is started with."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: int | None
    pass_fds: tuple[int, ...] = ()
    workdir: str | None = None


class _BwrapPipes:
    """The two pipes of one bwrap call: the seccomp program bwrap reads (written whole before
    bwrap starts: it is far smaller than a pipe's buffer), and bwrap's JSON status."""

    def __init__(self, program: bytes) -> None:
        self.seccomp, writer = os.pipe()
        try:
            os.write(writer, program)
        finally:
            os.close(writer)
        self.status_reader, self.status = os.pipe()
        os.set_blocking(self.status_reader, False)
        self._child_ends_open = True

    def close_child_ends(self) -> None:
        """Once the child has them: then only bwrap holds the status pipe's writing end, and
        its end of file means bwrap has exited."""
        if self._child_ends_open:
            os.close(self.seccomp)
            os.close(self.status)
            self._child_ends_open = False

    def code_ran(self) -> bool:
        """Whether bwrap exec'd the code: it writes `exit-code` only for a child it exec'd
        (bubblewrap.c, report_child_exit_status). The code never holds this pipe."""
        status = bytearray()
        with suppress(BlockingIOError):
            while chunk := os.read(self.status_reader, 65536):
                status += chunk
        return b'"exit-code"' in status

    def close(self) -> None:
        self.close_child_ends()
        os.close(self.status_reader)


def _which(name: str, why: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxUnavailable(f"{name} not found: {why}")
    return path


def _seccomp_program() -> bytes:
    try:
        return build_filter()
    except SeccompUnavailable as error:
        raise SandboxUnavailable(str(error)) from error


def _slot_cgroups(limits: SandboxLimits, slots: int) -> SlotCgroups | None:
    """The slots' cgroups where KPO_SANDBOX_CGROUP asks for them (fails if they cannot be had:
    asked for, they are not silently left out)."""
    try:
        base = configured_base()
        if base is None:
            return None
        return SlotCgroups(base, slots, limits.memory_mb * 2**20, limits.nproc)
    except CgroupUnavailable as error:
        raise SandboxUnavailable(f"KPO_SANDBOX_CGROUP: {error}") from error


def _check_backend(backend: str, allow_unsafe_process: bool, per_slot_uid: bool) -> None:
    if backend not in ("bwrap", "process"):
        raise ValueError(f"unknown sandbox backend {backend!r}")
    if backend == "bwrap":
        return
    if not allow_unsafe_process:
        raise SandboxUnavailable(
            "the process backend has no namespaces (the code can read this user's "
            "files and reach the network); it runs only with allow_unsafe_process"
        )
    if not per_slot_uid:
        raise SandboxUnavailable(
            "the process backend needs per-slot uids (run the server as root): with one uid "
            "for every call and the server, a process a call leaves behind (setsid, a double "
            "fork) cannot be told from the server's, so it would run on after the call's "
            "timeout, with the network"
        )
    log.warning(
        "sandbox backend 'process': rlimits and a timeout only, NO namespaces: the "
        "code can read what this user can read and reach the network"
    )


class SandboxRunner:
    """Runs calls under one backend; safe to call from `slots` threads at once (more block
    for a free slot). Implements ToolRunner."""

    def __init__(
        self,
        backend: Backend = "bwrap",
        limits: SandboxLimits | None = None,
        *,
        allow_unsafe_process: bool = False,
        slots: int = 4,
        python: str | None = None,
        uid_base: int = DEFAULT_UID_BASE,
        check: bool = True,
        unready_after: int = UNREADY_AFTER,
    ) -> None:
        # As root, one unprivileged uid per slot (see the module docstring); else our own uid.
        self._per_slot_uid = os.geteuid() == 0
        _check_backend(backend, allow_unsafe_process, self._per_slot_uid)
        self.backend: Backend = backend
        self.limits = limits or SandboxLimits()
        self.slots = slots
        self.python = python or find_python()
        self.uid_base = uid_base
        self.unready_after = unready_after
        util_linux = "install util-linux"
        self._prlimit = _which("prlimit", util_linux)
        self._choom = _which("choom", util_linux)
        self._bwrap = (
            _which("bwrap", "install bubblewrap (make system-deps)") if backend == "bwrap" else None
        )
        self._seccomp = _seccomp_program() if backend == "bwrap" else None
        self.cgroups = _slot_cgroups(self.limits, slots)
        self._setpriv = _which("setpriv", util_linux) if self.cgroups is not None else None
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self._free.put(slot)
        self._start_failures = 0
        self._last_start_error = ""
        self._health_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        if check:
            problem = self.problem()
            if problem:
                raise SandboxUnavailable(problem)

    def problem(self) -> str | None:
        """Why this backend cannot run code here, or None: one trivial call."""
        result = self.run("print('ok')", timeout_s=10.0)
        if result.status == "ok" and result.output == "ok":
            return None
        return f"{self.backend} sandbox does not run code here: {result.output or result.status}"

    def unready_reason(self) -> str | None:
        """None while calls start. After `unready_after` consecutive calls that could not start
        the sandbox (its readiness: the server's /readyz), why; until a call starts again.
        While unready, this probes with a trivial call on a free slot: an unready server gets
        no calls of its own to find out with."""
        if self._start_failures < self.unready_after:
            return None
        self._probe()
        with self._health_lock:
            failures, error = self._start_failures, self._last_start_error
        if failures < self.unready_after:
            return None
        return f"the last {failures} calls could not start the sandbox: {error}"

    def _probe(self) -> None:
        # One probe at a time, and never waiting for a slot: busy slots are calls, which say
        # themselves whether they start.
        if not self._probe_lock.acquire(blocking=False):
            return
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            self._probe_lock.release()
            return
        try:
            self._run(PROBE_CODE, PROBE_TIMEOUT_S, slot, time.monotonic())
        finally:
            self._free.put(slot)
            self._probe_lock.release()

    def _record_start(self, started: bool, error: str = "") -> None:
        with self._health_lock:
            if started:
                self._start_failures = 0
                return
            self._start_failures += 1
            self._last_start_error = error
        log.warning("sandbox: a call could not start the sandbox: %s", error)

    @contextmanager
    def _slot(self) -> Iterator[int]:
        slot = self._free.get()
        try:
            yield slot
        finally:
            self._free.put(slot)

    def _uid(self, slot: int) -> int:
        return self.uid_base + slot if self._per_slot_uid else os.geteuid()

    def run(self, code: str, timeout_s: float | None = None) -> ToolResult:
        started = time.monotonic()
        limit = self.limits.timeout_s if timeout_s is None else timeout_s
        encoded = code.encode("utf-8", "surrogateescape")
        if len(encoded) > MAX_CODE_BYTES or "\x00" in code:
            reason = (
                "code contains a NUL byte"
                if "\x00" in code
                else f"code of {len(encoded)} bytes is over the {MAX_CODE_BYTES}-byte limit"
            )
            return ToolResult(reason, "refused", time.monotonic() - started)
        with self._slot() as slot:
            return self._run(code, limit, slot, started)

    def _limits_argv(self, timeout_s: float) -> list[str]:
        lim = self.limits
        cpu = lim.cpu_seconds(timeout_s)
        nproc = lim.nproc if self._per_slot_uid else lim.nproc * self.slots + NPROC_HEADROOM
        file_bytes = lim.file_mb * 2**20
        return [
            self._prlimit,
            # soft < hard: SIGXCPU (a clear "CPU time limit exceeded") before SIGKILL.
            f"--cpu={cpu}:{cpu + 1}",
            f"--as={lim.memory_mb * 2**20}",
            f"--nproc={nproc}",
            f"--nofile={lim.nofile}",
            f"--fsize={file_bytes}",
            "--core=0",
            "--",
            self._choom,
            "-n",
            str(OOM_SCORE_ADJ),
            "--",
        ]

    def _spawn(self, code: str, timeout_s: float, slot: int, pipes: _BwrapPipes | None) -> _Spawn:
        uid = self._uid(slot)
        python_argv = [self.python, "-I", "-u", "-B", "-c", code]
        if pipes is not None:
            assert self._bwrap is not None
            sandbox = _bwrap_argv(
                self._bwrap, self.limits.file_mb * 2**20, pipes.seccomp, pipes.status
            )
            argv = [*self._limits_argv(timeout_s), *sandbox, *python_argv]
            spawn = _Spawn(
                argv, {"PATH": "/usr/bin:/bin"}, "/", None, (pipes.seccomp, pipes.status)
            )
        else:
            workdir = tempfile.mkdtemp(prefix="kpo-sandbox-")
            os.chown(workdir, uid, uid)
            argv = [*self._limits_argv(timeout_s), *python_argv]
            spawn = _Spawn(argv, _sandbox_env(workdir), workdir, None, (), workdir)
        user = uid if self._per_slot_uid else None
        if self.cgroups is None:
            return replace(spawn, user=user)
        # Into the slot's cgroup first, as this (root or the cgroup's owner) process's uid,
        # which may write the cgroup; then the slot's uid.
        assert self._setpriv is not None
        enter = ["/bin/sh", "-c", CGROUP_ENTER, "sh", self.cgroups.procs(slot)]
        switch = (
            []
            if user is None
            else [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        )
        return replace(spawn, argv=[*enter, *switch, *spawn.argv])

    def _run(self, code: str, timeout_s: float, slot: int, started: float) -> ToolResult:
        pipes = _BwrapPipes(self._seccomp) if self._seccomp is not None else None
        spawn: _Spawn | None = None
        try:
            spawn = self._spawn(code, timeout_s, slot, pipes)
            return self._start_and_collect(spawn, timeout_s, slot, started, pipes)
        finally:
            if pipes is not None:
                pipes.close()
            if spawn is not None and spawn.workdir:
                shutil.rmtree(spawn.workdir, ignore_errors=True)

    def _start_and_collect(
        self,
        spawn: _Spawn,
        timeout_s: float,
        slot: int,
        started: float,
        pipes: _BwrapPipes | None,
    ) -> ToolResult:
        try:
            proc = subprocess.Popen(
                spawn.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=spawn.env,
                cwd=spawn.cwd,
                close_fds=True,
                pass_fds=spawn.pass_fds,
                # Its own process group, so a timeout kills the whole tree at once.
                start_new_session=True,
                user=spawn.user,
                group=spawn.user,
                extra_groups=[] if spawn.user is not None else None,
            )
        except OSError as exc:
            self._record_start(False, str(exc))
            return ToolResult(f"sandbox failed to start: {exc}", "error", 0.0)
        finally:
            if pipes is not None:
                pipes.close_child_ends()
        # Once: when the leader exits (so that what holds the pipes goes), or after a call
        # stopped before it did; a second would spawn another killer as the slot's uid for
        # nothing (what the first killed could fork nothing more).
        end_leftovers = _once(lambda: self._end_leftovers(slot))
        try:
            result, stopped = self._collect(proc, timeout_s, started, end_leftovers)
        finally:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            end_leftovers()
            reap_call_orphans(self._uid(slot) if self._per_slot_uid else None)
        started_code = stopped or pipes is None or pipes.code_ran()
        self._record_start(started_code, result.output)
        return result

    def _end_leftovers(self, slot: int) -> None:
        """End whatever of the slot's call is still running. Under bwrap nothing outlives the
        pid namespace; the process backend's calls can leave their session, but not their uid
        (kill(-1) as the slot's uid reaches every process of it, and a fork bomb's forks too:
        the kernel sends it to all of them at once), nor their cgroup."""
        if self.cgroups is not None:
            try:
                self.cgroups.kill(slot)
            except OSError as error:
                log.warning("sandbox: cgroup.kill of slot %d: %s", slot, error)
        if self.backend != "process":
            return
        uid = self._uid(slot)
        try:
            killer = subprocess.Popen(
                # kill(-1): every process this uid may signal but itself. In the sandbox's
                # python, which is there wherever the backend is (slim images lack kill(1)).
                [self.python, "-I", "-S", "-c", KILL_EVERY_PROCESS],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={},
                cwd="/",
                close_fds=True,
                user=uid,
                group=uid,
                extra_groups=[],
            )
        except OSError as error:
            log.warning("sandbox: cannot end the processes of uid %d: %s", uid, error)
            return
        killer.wait()

    def _collect(
        self,
        proc: subprocess.Popen[bytes],
        timeout_s: float,
        started: float,
        on_exit: Callable[[], None],
    ) -> tuple[ToolResult, bool]:
        """The call's result, and whether it was stopped (timeout, output cap) rather than
        ending on its own; `on_exit` runs once the leader has exited."""
        max_chars = self.limits.max_output_chars
        # A character is at most 4 bytes of UTF-8: past this many bytes the output is over.
        cap_bytes = 4 * (max_chars + 1)
        deadline = started + timeout_s
        stdout = bytearray()
        stderr_tail = bytearray()
        timed_out = over_cap = False
        assert proc.stdout is not None and proc.stderr is not None
        # A pidfd is readable once the process has exited, before it is reaped: its process
        # group is then still ours to kill (a reaped leader's group id could be reused).
        pidfd = os.pidfd_open(proc.pid)
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                sel.register(proc.stderr, selectors.EVENT_READ)
                sel.register(pidfd, selectors.EVENT_READ)
                while len(sel.get_map()) > 0:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        timed_out = True
                        break
                    for key, _ in sel.select(remaining):
                        fileobj = key.fileobj
                        if fileobj == pidfd:
                            # Exited: whatever it left behind (a background child holding
                            # the pipes) goes now, and the pipes close.
                            sel.unregister(pidfd)
                            _kill_group(proc)
                            on_exit()
                            continue
                        assert not isinstance(fileobj, int)
                        chunk = os.read(fileobj.fileno(), 65536)
                        if not chunk:
                            sel.unregister(fileobj)
                        elif fileobj is proc.stdout:
                            stdout += chunk[: cap_bytes + 1 - len(stdout)]
                            over_cap = len(stdout) > cap_bytes
                        else:
                            stderr_tail += chunk
                            del stderr_tail[:-STDERR_TAIL_BYTES]
                    # Also stop once the characters (not only the bytes) are over the cap.
                    if over_cap or (len(stdout) > max_chars and len(_decode(stdout)) > max_chars):
                        over_cap = True
                        break
        finally:
            _kill_group(proc)
            os.close(pidfd)
            proc.wait()
        seconds = time.monotonic() - started
        # A trailing newline is print()'s, not content: "83810205", not "83810205\n".
        text = _decode(stdout).rstrip()
        if timed_out:
            return ToolResult(text[:max_chars], "timeout", seconds, timeout_s), True
        if over_cap:
            line = f"OutputLimitExceeded: more than {max_chars} characters of output"
            return ToolResult(_compose(text, line, max_chars), "error", seconds), True
        if proc.returncode == 0:
            return ToolResult(text[:max_chars], "ok", seconds), False
        line = _last_line(bytes(stderr_tail)) or _signal_line(proc.returncode)
        if proc.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            line = _SIGNAL_LINES[signal.SIGXCPU]
        return ToolResult(_compose(text, line, max_chars), "error", seconds), False


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """`action`, run by the first call that gets through it (one that raised runs it again)."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            action()
            done = True

    return run


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", "replace")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the call's process group (prlimit -> bwrap, or the code and its children).
    Only while the leader is unreaped, so the group id cannot have been reused. Under bwrap,
    killing bwrap kills the namespace's init (die-with-parent) and with it every process of
    the pid namespace, whatever session or group they moved to."""
    if proc.returncode is None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
