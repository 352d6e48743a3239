"""The seccomp filter bwrap installs before it execs the model's code: the kernel interfaces a
sandboxed program has no use for, and that are where kernel exploits live (io_uring, bpf,
perf_event_open, userfaultfd, keyrings, ptrace, mounting, namespaces), fail with EPERM, as do
memfd_create and System V shared memory (memory outside the address-space limit); ordinary
programs (printing, threads, fork, subprocesses, multiprocessing, asyncio) still run."""

from __future__ import annotations

import errno
import json
import platform

import pytest

from services.tools.sandbox import SandboxLimits, SandboxRunner
from tests.services.tools.sandbox_server import needs_bwrap

pytestmark = needs_bwrap

UID_BASE = 213_000
MACHINE = platform.machine()

# Numbers of the denied calls (those from 424 on are the same on every architecture).
DENIED = {
    "x86_64": {
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kexec_load": 246,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsmount": 432,
        "unshare": 272,
        "setns": 308,
        "personality": 135,
        "memfd_create": 319,
        "shmget": 29,
        "msgget": 68,
    },
    "aarch64": {
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kexec_load": 104,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsmount": 432,
        "unshare": 97,
        "setns": 268,
        "personality": 92,
        "memfd_create": 279,
        "shmget": 194,
        "msgget": 186,
    },
}

# Each call with arguments of zero (harmless where it is allowed), its errno printed as JSON.
ERRNOS = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
found = {}
for name, number in NUMBERS.items():
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(0)] * 5)
    found[name] = ctypes.get_errno() if result == -1 else 0
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def runner() -> SandboxRunner:
    return SandboxRunner(
        "bwrap", SandboxLimits(timeout_s=10.0, max_output_chars=4000), slots=1, uid_base=UID_BASE
    )


def errnos(runner: SandboxRunner, numbers: dict[str, int]) -> dict[str, int]:
    result = runner.run(f"NUMBERS = {numbers!r}\n{ERRNOS}")
    assert result.status == "ok", result
    found: dict[str, int] = json.loads(result.output)
    return found


def test_the_denied_calls_fail_with_eperm(runner: SandboxRunner) -> None:
    if MACHINE not in DENIED:
        pytest.skip(f"no syscall numbers here for {MACHINE}")
    found = errnos(runner, DENIED[MACHINE])
    assert {name: code for name, code in found.items() if code != errno.EPERM} == {}


def test_clone_into_a_new_namespace_is_refused_and_clone3_is_unknown(
    runner: SandboxRunner,
) -> None:
    """clone3 takes its flags in memory a filter cannot read: it answers ENOSYS, and libc falls
    back to clone, whose flags the filter does read."""
    if MACHINE not in DENIED:
        pytest.skip(f"no syscall numbers here for {MACHINE}")
    clone = {"x86_64": 56, "aarch64": 220}[MACHINE]
    code = f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
for flags in (CLONE_NEWUSER | signal.SIGCHLD, CLONE_NEWNET | signal.SIGCHLD):
    ctypes.set_errno(0)
    pid = libc.syscall(ctypes.c_long({clone}), ctypes.c_long(flags), *[ctypes.c_long(0)] * 4)
    if pid == 0:
        os._exit(0)
    print(ctypes.get_errno() if pid == -1 else "created")
    if pid > 0:
        os.waitpid(pid, 0)
ctypes.set_errno(0)
libc.syscall(ctypes.c_long(435), ctypes.c_long(0), ctypes.c_long(0))
print(ctypes.get_errno())
"""
    result = runner.run(code)
    assert (result.status, result.output.split()) == ("ok", ["1", "1", "38"]), result


def test_the_x32_abi_is_killed(runner: SandboxRunner) -> None:
    """x86_64 also takes x32 calls (number | 0x40000000), which a filter of x86_64 numbers
    would let through: the filter kills the process instead."""
    if MACHINE != "x86_64":
        pytest.skip("the x32 ABI exists on x86_64 only")
    code = "import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39); print('returned')"
    result = runner.run(code)
    assert (result.status, result.output) == ("error", "killed by SIGSYS"), result


ORDINARY = """
import asyncio, math, multiprocessing, os, subprocess, sys, threading
pid = os.fork()
if pid == 0:
    os._exit(7)
forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
child = subprocess.run([sys.executable, "-c", "print(6*7)"], capture_output=True, text=True)
results = []
thread = threading.Thread(target=lambda: results.append(math.factorial(10)))
thread.start()
thread.join()
with multiprocessing.Pool(2) as pool:
    pooled = sum(pool.map(abs, [-1, -2, -3]))
asyncio.run(asyncio.sleep(0))
with open("scratch.txt", "w") as scratch:
    scratch.write("x")
print(forked, child.stdout.strip(), results[0], pooled, os.path.getsize("scratch.txt"))
"""


def test_ordinary_programs_still_run(runner: SandboxRunner) -> None:
    result = runner.run(ORDINARY)
    assert (result.status, result.output) == ("ok", "7 42 3628800 6 1"), result
