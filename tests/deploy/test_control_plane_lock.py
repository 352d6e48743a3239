"""The control-plane image's Python packages: exactly deploy/docker/control-plane.lock.txt, one
version and one wheel hash each, and no training stack (torch and the rest stay in the GPU image).

The lock is checked against what it is made from (control-plane.in, pyproject.toml's ranges, the
Dockerfile's Ray), and `kpo serve` is run, serving over HTTP, with every installed package that
the lock does not name made unimportable (tests/deploy/lock_only_python.py): what the server
imports, at start and per request, is in the lock.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from services.jobs.ray_head import free_port
from tests.deploy.manifests import REPO
from tests.deploy.test_dockerfile import IMAGE_PYTHON as GPU_IMAGE_PYTHON
from tests.deploy.test_dockerfile import read_lock, stages

LOCK = REPO / "deploy" / "docker" / "control-plane.lock.txt"
REQUIREMENTS_IN = REPO / "deploy" / "docker" / "control-plane.in"
# What the control plane must never carry: the training stack (several GB with torch's CUDA).
TRAINING_ONLY = {"torch", "transformers", "tokenizers", "datasets", "pyarrow", "peft", "numpy"}
# The GPU image's platform markers, with the control plane's Python.
IMAGE_PYTHON = {**GPU_IMAGE_PYTHON, "python_version": "3.11", "python_full_version": "3.11.7"}
TOKEN = "lock-only-test-token-0123456789"


def named_in_requirements_in() -> set[str]:
    names = set()
    for line in REQUIREMENTS_IN.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonicalize_name(line))
    return names


def test_the_control_plane_installs_exactly_its_lock_and_no_torch() -> None:
    stage = stages()["control-plane"]
    runs = " ".join(stage.values("RUN"))
    assert "--require-hashes --no-deps -r /tmp/control-plane.lock.txt" in runs
    assert "pip install --no-cache-dir --no-deps /wheels/kpo_rl-" in runs
    assert "download.pytorch.org" not in runs and "torch" not in runs
    copied = "deploy/docker/control-plane.lock.txt /tmp/control-plane.lock.txt"
    assert copied in stage.values("COPY")
    assert "python:3.11" in stage.base and "CPython 3.11" in LOCK.read_text(encoding="utf-8")
    entries = read_lock(LOCK)
    names = [canonicalize_name(name) for name, _, _ in entries]
    assert len(names) == len(set(names)), "a package pinned twice"
    for name, _, hashes in entries:
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name
    assert not TRAINING_ONLY & set(names)


def test_the_lock_agrees_with_the_project_and_rays_pin() -> None:
    """Each package control-plane.in names is a dependency of kpo-rl, locked at a version in
    pyproject.toml's range; Ray is the Dockerfile's, with every requirement of its `default`
    extra (this environment's Ray is that release)."""
    pins = {canonicalize_name(name): version for name, version, _ in read_lock(LOCK)}
    assert pins["ray"] == stages()["control-plane"].arg("RAY_VERSION")
    assert importlib.metadata.version("ray") == pins["ray"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    ranges = {
        canonicalize_name(Requirement(text).name): Requirement(text)
        for text in project["project"]["dependencies"]
    }
    wanted = named_in_requirements_in()
    assert wanted <= ranges.keys(), wanted - ranges.keys()
    requirements = [ranges[name] for name in wanted]
    for text in importlib.metadata.requires("ray") or []:
        marker = Requirement(text).marker
        if marker is None or marker.evaluate({**IMAGE_PYTHON, "extra": "default"}):
            requirements.append(Requirement(text))
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in the lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"the lock's {name}=={pins[name]} does not satisfy {requirement}"
        )


def test_kpo_serve_serves_with_only_the_locked_packages_importable(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "KPO_DATA_DIR": str(tmp_path / "data"),
        "KPO_API_TOKEN": TOKEN,
        # A cluster that is never reached: no local Ray head is started for this.
        "RAY_ADDRESS": "http://127.0.0.1:1",
    }
    env.pop("KPO_STORE_URL", None)
    wrapper = REPO / "tests" / "deploy" / "lock_only_python.py"
    server = subprocess.Popen(
        [sys.executable, str(wrapper), str(LOCK), "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=10) as client:
            _wait_for_health(client, server)
            assert client.get("/v1/runs").json()["runs"] == []
            assert client.get("/metrics").status_code == 200
            assert "<html" in client.get("/").text.lower()
            refused = client.post("/v1/runs", json={"learner": {"lr": "fast"}})
            assert refused.status_code == 422, refused.text
            assert "learner.lr" in refused.text
            # A hub model: its family is checked where its config can be read (the job).
            hub = client.post("/v1/runs", json={"model": "Qwen/Qwen3-4B"})
            assert hub.status_code == 201, hub.text
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 0, stderr
    refused_line = [line for line in stderr.splitlines() if line.startswith("refused:")]
    assert len(refused_line) == 1, stderr
    refused_modules = set(refused_line[0].removeprefix("refused:").replace(",", " ").split())
    # Imports the server tried and went without, as it will in the image: none of kpo's own
    # needs, only optional accelerations and extras of its libraries.
    assert not refused_modules & {"torch", "transformers", "datasets", "peft", "matplotlib"}


def _wait_for_health(client: httpx.Client, server: subprocess.Popen[str]) -> None:
    for _ in range(600):
        if server.poll() is not None:
            pytest.fail(f"kpo serve exited {server.returncode}: {server.communicate()[1]}")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        try:
            server.wait(timeout=0.1)  # the server's exit ends the wait at once
        except subprocess.TimeoutExpired:
            continue
    pytest.fail("kpo serve did not answer /healthz within a minute")
