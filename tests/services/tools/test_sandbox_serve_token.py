"""`kpo sandbox serve --backend process` needs a token wherever it listens.

The process backend runs a call's code as the server's own user, without namespaces: on a
user's machine, a loopback server without a token would run the code of anything that can reach
the port. So the command refuses to start without one, on loopback too, and says which
variables give it; `--insecure` (a network policy guards the port) does not lift it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.tools.sandbox_server import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(120)

# A refusal comes before the server would start; a server that starts is still running here.
EXIT_WITHIN_S = 30


def serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`kpo sandbox serve` with `args`, in an environment without the sandbox's token."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KPO_SANDBOX_")}
    command = [sys.executable, "-m", "services.cli", "sandbox", "serve", "--port"]
    command += [str(free_port()), *args]
    try:
        return subprocess.run(
            command,
            cwd=REPO_ROOT,
            env={**clean, **env},
            capture_output=True,
            text=True,
            timeout=EXIT_WITHIN_S,
        )
    except subprocess.TimeoutExpired:  # run() has killed it
        pytest.fail(f"`kpo sandbox serve {' '.join(args)}` started without a token")


@pytest.mark.parametrize(
    "args",
    [
        ["--backend", "process", "--allow-unsafe-process"],
        ["--backend", "process", "--allow-unsafe-process", "--host", "::1"],
        ["--backend", "process", "--allow-unsafe-process", "--host", "0.0.0.0", "--insecure"],
    ],
)
def test_the_process_backend_without_a_token_is_refused(args: list[str]) -> None:
    result = serve(args, {})
    assert result.returncode == 2, result.stderr
    assert "KPO_SANDBOX_TOKEN" in result.stderr and "process" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_the_process_backend_from_the_environment_and_an_empty_token_file(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    env = {
        "KPO_SANDBOX_BACKEND": "process",
        "KPO_SANDBOX_ALLOW_UNSAFE_PROCESS": "true",
        "KPO_SANDBOX_TOKEN_FILE": str(empty),
    }
    result = serve([], env)
    assert result.returncode == 2, result.stderr
    assert "KPO_SANDBOX_TOKEN_FILE" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
