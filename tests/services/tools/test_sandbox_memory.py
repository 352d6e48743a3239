"""What one call can hold. RLIMIT_AS bounds one process, not a call: without a cgroup of its
own a call holds at most its process budget times the address-space limit, plus its two
tmpfs, plus kernel buffers behind its file descriptors (docs/tools.md). So the process budget
is small by default, file descriptors are few, and the ways of holding memory outside any
address space (memfd_create, System V shared memory and message queues) are refused.

Where the server has a delegated cgroup v2 (KPO_SANDBOX_CGROUP), each call runs in a cgroup of
its own whose memory.max is the call's memory: forked allocators together stay under it."""

from __future__ import annotations

import os

import pytest

from services.tools.cgroup import configured_base
from services.tools.sandbox import SandboxLimits, SandboxRunner
from tests.services.tools.sandbox_server import needs_bwrap

pytestmark = [needs_bwrap, pytest.mark.timeout(120)]

UID_BASE = 214_000

HOARD = """
import os, resource
print(resource.getrlimit(resource.RLIMIT_NOFILE))
try:
    # Many of them, each up to the file-size limit, held by its descriptor: memory that no
    # address space counts.
    os.memfd_create("hoard")
    print("memfd")
except PermissionError:
    print("no memfd")
"""


def test_few_file_descriptors_and_no_memfd() -> None:
    runner = SandboxRunner("bwrap", SandboxLimits(timeout_s=10.0), slots=1, uid_base=UID_BASE)
    result = runner.run(HOARD)
    assert result.status == "ok", result
    nofile, memfd = result.output.splitlines()
    soft, hard = (int(n) for n in nofile.strip("()").split(","))
    assert soft == hard <= 64
    assert memfd == "no memfd"


FORK_AND_HOLD = """
import os, time
held = 0
while True:
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        block = bytearray(32 * 2**20)  # touched: resident, not only reserved
        time.sleep(60)
        os._exit(0)
    held += 1
print(held)
"""


def test_the_default_process_budget_bounds_forked_allocators() -> None:
    """By default a call holds at most `nproc` processes of `memory_mb` each: 16 (the budget
    counts the call's python too), not the 64 that let one call hold 64 GiB."""
    if os.geteuid() != 0:
        pytest.skip("a process budget per call needs per-slot uids (root)")
    limits = SandboxLimits(timeout_s=10.0)
    assert limits.nproc <= 16
    runner = SandboxRunner("bwrap", limits, slots=1, uid_base=UID_BASE + 1)
    result = runner.run(FORK_AND_HOLD)
    assert result.status == "ok", result
    # bwrap, its namespace init and the call's python are three of the budget.
    assert 0 < int(result.output) <= limits.nproc - 3


FOUR_ALLOCATORS = """
import os, time
for _ in range(4):
    if os.fork() == 0:
        block = bytearray(200 * 2**20)  # zero-filled: every page touched
        time.sleep(60)
        os._exit(0)
time.sleep(2)
print("held")
"""


def test_with_a_cgroup_forked_allocators_together_stay_under_memory_mb() -> None:
    """Four children of 200 MiB each under memory_mb 256: each is within its address space,
    together they are three times the call's memory. The cgroup's memory.max holds them to it
    (memory.oom.group: the call is killed whole)."""
    if configured_base() is None:
        pytest.skip("no delegated cgroup v2 here (KPO_SANDBOX_CGROUP names one)")
    limits = SandboxLimits(timeout_s=10.0, memory_mb=256)
    runner = SandboxRunner("bwrap", limits, slots=1, uid_base=UID_BASE + 2)
    assert runner.cgroups is not None
    result = runner.run(FOUR_ALLOCATORS)
    assert result.output != "held", result
    peak = runner.cgroups.peak_bytes(0)
    assert peak is not None and peak <= limits.memory_mb * 2**20
