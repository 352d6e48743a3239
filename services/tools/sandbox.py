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
- process: the same rlimits, timeout and cleared environment, no namespaces. Only for machines
  without user namespaces, only when explicitly allowed: the code can read what this user can
  read and reach the network.

Both: rlimits on CPU seconds, address space, processes and file size (set by `prlimit` in the
child before it execs the sandbox, so no Python runs between fork and exec in this threaded
process), a wall-clock timeout that kills the whole process group, and output read at most to
the cap (the call is stopped once it prints more: nothing large is ever buffered).

RLIMIT_NPROC counts every process of a real uid, not of a call. Run as root (a container's
default), each concurrent call therefore runs as its own unprivileged uid from a pool
(`uid_base + slot`), so one call's fork bomb exhausts only its own budget. Run as an ordinary
user there is one uid for all calls and the server: the limit is then a shared budget of
`nproc * slots + NPROC_HEADROOM`, and a fork bomb can make concurrent calls fail to start
until its timeout kills it (bounded; the pod's pids limit is the outer bound).
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
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Literal, Protocol

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
    then always fires first for a busy loop, with the clearer observation)."""

    timeout_s: float = 5.0
    cpu_s: int | None = None
    memory_mb: int = 1024
    nproc: int = 64
    file_mb: int = 16
    max_output_chars: int = 1000

    def cpu_seconds(self, timeout_s: float) -> int:
        return self.cpu_s if self.cpu_s is not None else math.ceil(timeout_s) + 1


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


def _bwrap_argv(bwrap: str, workdir_bytes: int) -> list[str]:
    argv = [
        bwrap,
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
    ) -> None:
        if backend not in ("bwrap", "process"):
            raise ValueError(f"unknown sandbox backend {backend!r}")
        if backend == "process":
            if not allow_unsafe_process:
                raise SandboxUnavailable(
                    "the process backend has no namespaces (the code can read this user's "
                    "files and reach the network); it runs only with allow_unsafe_process"
                )
            log.warning(
                "sandbox backend 'process': rlimits and a timeout only, NO namespaces: the "
                "code can read what this user can read and reach the network"
            )
        self.backend: Backend = backend
        self.limits = limits or SandboxLimits()
        self.slots = slots
        self.python = python or find_python()
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise SandboxUnavailable("prlimit (util-linux) not found")
        self._prlimit = prlimit
        self._bwrap = shutil.which("bwrap") if backend == "bwrap" else None
        if backend == "bwrap" and self._bwrap is None:
            raise SandboxUnavailable("bwrap not found: install bubblewrap (make system-deps)")
        # As root, one unprivileged uid per slot (see the module docstring); else our own uid.
        self._per_slot_uid = os.geteuid() == 0
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self._free.put(uid_base + slot if self._per_slot_uid else os.geteuid())
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

    @contextmanager
    def _slot(self) -> Iterator[int]:
        uid = self._free.get()
        try:
            yield uid
        finally:
            self._free.put(uid)

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
        with self._slot() as uid:
            return self._run(code, limit, uid, started)

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
            f"--fsize={file_bytes}",
            "--core=0",
            "--",
        ]

    def _run(self, code: str, timeout_s: float, uid: int, started: float) -> ToolResult:
        lim = self.limits
        workdir: str | None = None
        python_argv = [self.python, "-I", "-u", "-B", "-c", code]
        if self.backend == "bwrap":
            assert self._bwrap is not None
            argv = [
                *self._limits_argv(timeout_s),
                *_bwrap_argv(self._bwrap, lim.file_mb * 2**20),
                *python_argv,
            ]
            env: dict[str, str] = {"PATH": "/usr/bin:/bin"}
            cwd = "/"
        else:
            workdir = tempfile.mkdtemp(prefix="kpo-sandbox-")
            if self._per_slot_uid:
                os.chown(workdir, uid, uid)
            argv = [*self._limits_argv(timeout_s), *python_argv]
            env = _sandbox_env(workdir)
            cwd = workdir
        user = uid if self._per_slot_uid else None
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=cwd,
                close_fds=True,
                # Its own process group, so a timeout kills the whole tree at once.
                start_new_session=True,
                user=user,
                group=user,
                extra_groups=[] if user is not None else None,
            )
        except OSError as exc:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            return ToolResult(f"sandbox failed to start: {exc}", "error", 0.0)
        try:
            return self._collect(proc, timeout_s, started)
        finally:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)

    def _collect(
        self, proc: subprocess.Popen[bytes], timeout_s: float, started: float
    ) -> ToolResult:
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
            return ToolResult(text[:max_chars], "timeout", seconds, timeout_s)
        if over_cap:
            line = f"OutputLimitExceeded: more than {max_chars} characters of output"
            return ToolResult(_compose(text, line, max_chars), "error", seconds)
        if proc.returncode == 0:
            return ToolResult(text[:max_chars], "ok", seconds)
        line = _last_line(bytes(stderr_tail)) or _signal_line(proc.returncode)
        if proc.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            line = _SIGNAL_LINES[signal.SIGXCPU]
        return ToolResult(_compose(text, line, max_chars), "error", seconds)


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
