"""Fixtures of the deploy checks: the tools (helm, promtool, prometheus), the chart rendered with
every ci/*.yaml, and a live control plane with a finished tiny run scraped by a real Prometheus.

Every tool is real and must be present (a missing one fails, it never skips): `helm` comes from
scripts/fetch_helm.sh (or $HELM), `promtool` and `prometheus` from Debian's `prometheus` package,
`hadolint` and `kubernetes-validate` from PyPI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.live import LiveStack, live_stack
from tests.deploy.manifests import CI_VALUES, REPO, Manifest, render

PROMETHEUS_HINT = "install Debian's `prometheus` package (promtool, prometheus)"


@pytest.fixture(scope="session")
def helm() -> str:
    """A helm 3 binary: $HELM, or the one scripts/fetch_helm.sh caches (fetched once)."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_helm.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"scripts/fetch_helm.sh failed:\n{result.stderr}"
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    assert path, f"promtool is not on PATH: {PROMETHEUS_HINT}"
    return path


@pytest.fixture(scope="session")
def rendered(helm: str) -> dict[str, list[Manifest]]:
    """The chart's objects for each ci/*.yaml, by file name (rendered once per session), with
    the secrets the chart generates (`secrets.requireExisting=false`): the tests follow each
    secret from its Secret to the processes that read it. test_helm_security.py renders every
    ci/*.yaml with existing Secrets, the default, as well."""
    return {path.name: render(helm, [path], secrets="generated") for path in CI_VALUES}


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    """A control plane with a finished run, and a Prometheus on loopback scraping it."""
    prometheus = shutil.which("prometheus")
    assert prometheus, f"prometheus is not on PATH: {PROMETHEUS_HINT}"
    with live_stack(tmp_path_factory.mktemp("live"), Path(prometheus)) as stack:
        yield stack
