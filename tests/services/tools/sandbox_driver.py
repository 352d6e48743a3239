"""A SandboxRunner in a process of its own, for the tests that need that process to be something
pytest is not: PID 1 of a pid namespace (`unshare --pid --fork`), or a child subreaper.

    python -m tests.services.tools.sandbox_driver '{"calls": 12, "codes": ["print(1)"], ...}'

runs `calls` calls one after another (through `codes` in turn) and prints one JSON line: each
call's status and output, and how many zombie children this process has at the end (a zombie
nobody reaps keeps counting against its uid's RLIMIT_NPROC).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any

from services.tools.sandbox import SandboxLimits, SandboxRunner

PR_SET_CHILD_SUBREAPER = 36


def zombie_children(pid: int | str = "self") -> list[int]:
    """The children of process `pid` (this one by default; of every thread) that have exited
    and not been reaped."""
    zombies = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as children:
                listed = children.read().split()
        except FileNotFoundError:  # a thread that has ended since
            continue
        for child in listed:
            try:
                with open(f"/proc/{child}/stat", encoding="utf-8", errors="replace") as stat:
                    # The state follows the command name, which is in parentheses.
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                        zombies.append(int(child))
            except FileNotFoundError:
                continue
    return zombies


def main(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("subreaper"):
        # As `kpo sandbox serve` does (services.tools.reaper.become_subreaper), by hand: what
        # is under test is the runner's reaping, with or without that module.
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, ctypes.get_errno()
    runner = SandboxRunner(
        config.get("backend", "bwrap"),
        SandboxLimits(**config.get("limits", {})),
        allow_unsafe_process=config.get("backend") == "process",
        slots=1,
        uid_base=config["uid_base"],
        check=False,
    )
    codes = config["codes"]
    results = [runner.run(codes[index % len(codes)]) for index in range(config["calls"])]
    return {
        "pid": os.getpid(),
        "results": [[result.status, result.output] for result in results],
        "zombies": len(zombie_children()),
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
