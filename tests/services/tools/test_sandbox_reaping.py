"""Nothing a call leaves behind outlives it or keeps counting against its uid.

bwrap's outer process exits without reaping its namespace's init, which then goes to the
nearest reaper: PID 1 or a child subreaper. A sandbox server that is PID 1 (a container without
an init, as the chart runs it) must reap those itself, or every one of them stays a zombie
counting against its uid's RLIMIT_NPROC until no call can fork ("bwrap: Can't fork" or
"Creating new namespace failed"). And the `process` backend (no pid namespace) must end every
process of the call's uid after the call, or a `setsid` grandchild outlives its timeout with
the slot's uid and the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.tools.sandbox import SandboxLimits, SandboxRunner, SandboxUnavailable
from tests.services.tools.sandbox_driver import zombie_children
from tests.services.tools.sandbox_server import (
    REPO_ROOT,
    free_port,
    needs_bwrap,
    subprocess_server,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(180)

ROOT = os.geteuid() == 0
# As an ordinary user every call shares one uid and a budget of nproc * slots + 512: too large
# to exhaust in a test. As root each slot has a uid and a budget of its own.
needs_root = pytest.mark.skipif(
    not ROOT, reason="per-slot uids (as root) are what gives each call a small process budget"
)
NPROC = 6
# Each call holds three processes (bwrap, its namespace's init, python); every unreaped
# namespace init is one more. Twice the budget in calls exhausts it several times over.
CALLS = 2 * NPROC
# uid bases no other test uses: a uid's process count is machine-wide, and other tests (and
# other test runs on this machine) use the default 200000.
PID1_UID_BASE = 211_000
SUBREAPER_UID_BASE = 211_100
PROCESS_UID_BASE = 211_200


def drive(config: dict[str, Any], *prefix: str) -> dict[str, Any]:
    completed = subprocess.run(
        [*prefix, sys.executable, "-m", "tests.services.tools.sandbox_driver", json.dumps(config)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert completed.returncode == 0, completed.stderr
    result: dict[str, Any] = json.loads(completed.stdout.splitlines()[-1])
    return result


def budget_config(uid_base: int) -> dict[str, Any]:
    # Calls that end on their own and calls killed at their timeout alternate: both leave the
    # namespace init to the reaper. The last call is an ordinary one.
    return {
        "uid_base": uid_base,
        "limits": {"nproc": NPROC, "timeout_s": 1.0},
        "calls": CALLS,
        "codes": ["import time; time.sleep(30)", "print('ok')"],
    }


def assert_every_call_ran(result: dict[str, Any]) -> None:
    statuses = [status for status, _ in result["results"]]
    assert statuses == ["timeout", "ok"] * (CALLS // 2), result["results"]
    assert result["results"][-1] == ["ok", "ok"]
    assert result["zombies"] == 0


@needs_bwrap
@needs_root
def test_as_pid_1_twice_the_process_budget_in_calls() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    result = drive(budget_config(PID1_UID_BASE), "unshare", "--pid", "--fork", "--mount-proc")
    assert result["pid"] == 1
    assert_every_call_ran(result)


@needs_bwrap
@needs_root
def test_as_a_subreaper_twice_the_process_budget_in_calls() -> None:
    """A server that is not PID 1 makes itself a subreaper (`kpo sandbox serve` does): the
    orphans come to it rather than to an init that may not reap (or to one that does, but
    only after a while)."""
    result = drive({**budget_config(SUBREAPER_UID_BASE), "subreaper": True})
    assert result["pid"] != 1
    assert_every_call_ran(result)


@needs_bwrap
def test_kpo_sandbox_serve_is_a_subreaper() -> None:
    """`kpo sandbox serve`, neither PID 1 nor under an init here, makes itself a subreaper:
    otherwise what its calls leave goes to an init that may never reap it, and the runner,
    which reaps only as a reaper, leaves it to count against the slot's process budget."""
    port = free_port()
    token = "sandbox-reaper-token-0123456789"
    with subprocess_server(port, {"KPO_SANDBOX_TOKEN": token}) as server:
        url = f"http://127.0.0.1:{port}"
        health = wait_healthy(url)
        assert health["reaps_orphans"] is True, health
        call = httpx.post(
            f"{url}/v1/run",
            json={"code": "print('ran')"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        assert (call.status_code, call.json()["output"]) == (200, "ran"), call.text
        # bwrap's namespace init came to the server as an orphan, and was reaped before the
        # answer: nothing of the call is left as a zombie of the server.
        assert zombie_children(server.pid) == []


def test_become_subreaper() -> None:
    code = (
        "from services.tools.reaper import become_subreaper, is_reaper\n"
        "print(is_reaper())\nbecome_subreaper()\nprint(is_reaper())"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.stdout.split() == ["False", "True"], completed.stderr


def live_processes_of(uid: int) -> list[int]:
    """Processes (not zombies) whose real uid is `uid`, anywhere this process can see."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            found.append(int(entry.name))
    return found


# The grandchild leaves the call's session and process group (the timeout's kill reaches
# those) and sleeps on; a double fork daemonises another the classic way.
SETSID_GRANDCHILD = """
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        import time; time.sleep(120)
    os._exit(0)
os.wait()
print("left behind")
"""


def process_runner() -> SandboxRunner:
    """The process backend with one slot of its own uid (root only)."""
    return SandboxRunner(
        "process",
        SandboxLimits(timeout_s=5.0),
        allow_unsafe_process=True,
        slots=1,
        uid_base=PROCESS_UID_BASE,
    )


@needs_root
def test_process_backend_ends_every_process_of_the_calls_uid() -> None:
    runner = process_runner()
    result = runner.run(SETSID_GRANDCHILD)
    assert (result.status, result.output) == ("ok", "left behind")
    assert live_processes_of(PROCESS_UID_BASE) == []
    # Also after a timeout, when the code is killed mid-way.
    result = runner.run(SETSID_GRANDCHILD + "\nimport time; time.sleep(30)", timeout_s=1.0)
    assert result.status == "timeout"
    assert live_processes_of(PROCESS_UID_BASE) == []


@needs_root
def test_process_backend_ends_a_calls_leftovers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each end of a call's leftovers starts a python as the slot's uid: once per call, whether
    the code ended on its own (then as soon as it has) or was stopped at its timeout."""
    runner = process_runner()
    ends: list[int] = []
    end_leftovers = runner._end_leftovers

    def counted(slot: int) -> None:
        ends.append(slot)
        end_leftovers(slot)

    monkeypatch.setattr(runner, "_end_leftovers", counted)
    assert runner.run("print(1)").status == "ok"
    assert ends == [0]
    assert runner.run("import time; time.sleep(30)", timeout_s=1.0).status == "timeout"
    assert ends == [0, 0]


REFUSAL = """
import sys
from services.tools.sandbox import SandboxRunner, SandboxUnavailable
try:
    SandboxRunner("process", allow_unsafe_process=True, slots=1)
except SandboxUnavailable as error:
    print(error)
    sys.exit(0)
sys.exit("the process backend started with one uid for every call")
"""


def test_process_backend_is_refused_with_one_shared_uid() -> None:
    """Without per-slot uids nothing can tell a call's leftover processes from the server's,
    so the process backend cannot end them: it refuses to start, and says why."""
    if not ROOT:
        with pytest.raises(SandboxUnavailable, match="per-slot uids"):
            SandboxRunner("process", allow_unsafe_process=True, slots=1)
        return
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot drop to an ordinary user")
    nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    completed = subprocess.run(
        [*nobody, sys.executable, "-c", REFUSAL],
        cwd=REPO_ROOT,
        env={"PATH": os.environ["PATH"], "HOME": "/tmp"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert "per-slot uids" in completed.stdout
