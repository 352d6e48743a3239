"""Hub model ids resolved from a real, offline Hugging Face cache laid out here.

The cache holds the built-in tiny model under a made-up id, as `hf download` leaves a
repository: `models--<org>--<name>/refs/<revision>` naming a commit, the files under
`snapshots/<commit>/`. huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported, so
each resolution runs in a fresh interpreter with the environment a user would set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import services.tasks
from services.tasks.models import is_hub_id

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_ARITH = Path(services.tasks.__file__).parent / "assets" / "tiny-arith"
REPO_ID = "kpo-test/tiny-arith"
MAIN_COMMIT = "1" * 40
V1_COMMIT = "2" * 40


def lay_out_cache(hf_home: Path) -> Path:
    """HF_HOME holding REPO_ID at main and at tag v1 (v1's config differs in one field)."""
    repo = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    for revision, commit in (("main", MAIN_COMMIT), ("v1", V1_COMMIT)):
        (repo / "refs" / revision).write_text(commit)
        shutil.copytree(TINY_ARITH, repo / "snapshots" / commit)
    v1_config = repo / "snapshots" / V1_COMMIT / "config.json"
    v1_config.write_text(json.dumps({**json.loads(v1_config.read_text()), "revision_tag": "v1"}))
    return repo


def resolve_offline(hf_home: Path, model: str, revision: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = (
        "import sys\n"
        "from services.tasks.models import ModelDirError, resolve_model\n"
        "try:\n"
        f"    print(resolve_model({model!r}, {revision!r}))\n"
        "except ModelDirError as error:\n"
        "    sys.exit(str(error))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(tmp_path: Path) -> None:
    repo = lay_out_cache(tmp_path / "hf")
    main = resolve_offline(tmp_path / "hf", REPO_ID, None)
    assert main.returncode == 0, main.stderr
    assert Path(main.stdout.strip()) == (repo / "snapshots" / MAIN_COMMIT).resolve()
    v1 = resolve_offline(tmp_path / "hf", REPO_ID, "v1")
    assert v1.returncode == 0, v1.stderr
    config = json.loads((Path(v1.stdout.strip()) / "config.json").read_text())
    assert config["revision_tag"] == "v1"


def test_an_uncached_hub_id_offline_names_the_id_the_cache_and_the_setting(
    tmp_path: Path,
) -> None:
    lay_out_cache(tmp_path / "hf")
    result = resolve_offline(tmp_path / "hf", "kpo-test/not-there", None)
    assert result.returncode == 1
    message = result.stderr.strip()
    assert "hub model kpo-test/not-there@main is not in the Hugging Face cache" in message
    assert str(tmp_path / "hf" / "hub") in message and "HF_HUB_OFFLINE is set" in message
    missing_tag = resolve_offline(tmp_path / "hf", REPO_ID, "v9")
    assert "hub model kpo-test/tiny-arith@v9 is not in the Hugging Face cache" in (
        missing_tag.stderr
    )


@pytest.mark.parametrize(
    ("model", "hub"),
    [
        ("Qwen/Qwen3-4B", True),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", True),
        ("org/name.v2", True),
        ("tiny-arith", False),
        ("/models/qwen", False),
        ("./org/name", False),
        ("org/name/extra", False),
        ("org/..", False),
        ("~/models", False),
    ],
)
def test_hub_ids_are_told_from_paths(model: str, hub: bool) -> None:
    assert is_hub_id(model) is hub


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kpo_run_trains_a_cached_hub_model_offline(tmp_path: Path) -> None:
    """`kpo run` on a hub id: the driver resolves it from the offline cache and the actors
    load the snapshot (no actor is given the id)."""
    repo = lay_out_cache(tmp_path / "hf")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from services.cli import app; app()",
            "run",
            str(REPO_ROOT / "examples" / "demo.yaml"),
            "--out",
            str(out),
            "--set",
            f"model={REPO_ID}",
            "--set",
            "pipeline.steps=1",
            "--set",
            "pipeline.checkpoint_every=0",
            "--set",
            "generation.prompts_per_batch=4",
            "--set",
            "pipeline.batch_groups=4",
        ],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "succeeded"
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["model"] == REPO_ID
    # The exported model is the snapshot's architecture, trained one step.
    exported = json.loads((out / "model" / "config.json").read_text())
    snapshot = json.loads((repo / "snapshots" / MAIN_COMMIT / "config.json").read_text())
    assert exported["architectures"] == snapshot["architectures"]
