"""The GPU check (scripts/gpu_check.sh, scripts/gpu_check.py, scripts/gpu_check.yaml), on CPU.

The check itself needs a GPU and never runs in CI; what can fail before it reaches one is checked
here, so that a typo does not wait for a GPU machine: its run spec validates as a RunSpec and
fits one GPU, what the generation actor would be constructed with binds to the real worker and
vLLM backend constructors, its model is a ~0.5B Qwen2 whose vocabulary is its tokenizer's, the
same builder's output passes `kpo run`'s preflight, and the shell script refuses to skip.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gpu_check
import pytest

from services.generation.vllm_backend import VLLMBackend
from services.generation.worker import GenerationWorkerImpl
from services.pipeline.actors import generation_worker_args
from services.pipeline.specs import SpecError, load_run_spec, preflight
from services.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model built by the check's own builder, at a shape small enough for CPU."""
    out = tmp_path_factory.mktemp("gpu-check") / "model"
    config = gpu_check.model_config(
        gpu_check.tokenizer_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    gpu_check.build_model(out, config)
    return out


def test_the_checks_spec_is_a_one_gpu_vllm_run_with_in_flight_updates(
    small_model: Path,
) -> None:
    spec = gpu_check.load_spec(small_model)
    assert isinstance(spec, RunSpec)
    assert spec.model == str(small_model)
    assert spec.generation.backend == "vllm"
    assert spec.learner.device == "cuda" and spec.learner.compute_dtype == "bfloat16"
    # The learner and the engine share the GPU: the collective transport hands the buckets over
    # as CUDA IPC handles (NCCL refuses two ranks on one device).
    assert spec.pipeline.weight_transport == "collective"
    assert spec.pipeline.in_flight_updates
    assert spec.pipeline.steps == 3
    # The learner's ranks and the generation workers share one GPU.
    gpus = spec.learner.num_gpus * spec.learner.world_size
    gpus += spec.generation.num_gpus * spec.generation.num_workers
    assert 0 < gpus <= 1
    # What `kpo run` checks before any actor starts.
    assert preflight(spec, str(gpu_check.SPEC)) == small_model


def test_the_spec_fails_at_its_model_unless_the_script_sets_it() -> None:
    spec = load_run_spec(gpu_check.SPEC)
    with pytest.raises(SpecError, match="model"):
        preflight(spec, str(gpu_check.SPEC))


def test_the_generation_actor_would_be_constructed_with_nested_engine_arguments(
    small_model: Path,
) -> None:
    spec = gpu_check.load_spec(small_model)
    args = generation_worker_args(spec, small_model)
    assert args.actor_options["num_gpus"] == spec.generation.num_gpus
    worker = inspect.signature(GenerationWorkerImpl.__init__).bind(
        None, args.backend, args.model_path, **args.worker_options
    )
    (options_name,) = [
        name
        for name, p in inspect.signature(GenerationWorkerImpl.__init__).parameters.items()
        if p.kind is inspect.Parameter.VAR_KEYWORD
    ]
    backend_options: dict[str, Any] = worker.arguments[options_name]
    backend = inspect.signature(VLLMBackend.__init__).bind(None, args.model_path, **backend_options)
    assert backend.arguments["engine_kwargs"] == {
        "compilation_config": {"max_cudagraph_capture_size": 64}
    }
    assert backend.arguments["kv_cache_memory_bytes"] == 4 * 2**30


def test_the_checks_model_is_a_half_billion_parameter_qwen2() -> None:
    vocab = gpu_check.tokenizer_vocab_size()
    config = gpu_check.model_config(vocab)
    assert config.model_type == "qwen2" and config.vocab_size == vocab
    assert 0.45e9 <= gpu_check.count_parameters(config) <= 0.55e9


def test_the_built_model_is_what_vllm_and_the_learner_load(small_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(small_model)
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert str(config.dtype).removeprefix("torch.") == "bfloat16"
    assert config.vocab_size == len(tokenizer)  # every sampled id decodes
    assert config.eos_token_id == tokenizer.eos_token_id
    assert (small_model / "model.safetensors").is_file()


def test_step_timings_are_read_from_the_metrics_records() -> None:
    records = [
        {"step": 1, "time": 130.0, "step_seconds": 2.5, "generation_tokens_per_s": 900, "x": 1},
        {"step": 2, "time": 134.0, "step_seconds": 2.0, "weight_sync_seconds": 0.4},
    ]
    rows = gpu_check.step_timings(records, launched=100.0)
    assert rows[0] == {
        "step": 1.0,
        "since_start_s": 30.0,
        "since_previous_s": 30.0,
        "step_seconds": 2.5,
        "generation_tokens_per_s": 900.0,
    }
    assert rows[1]["since_previous_s"] == 4.0 and rows[1]["weight_sync_seconds"] == 0.4


def test_the_clock_names_the_stage_past_the_deadline() -> None:
    clock = gpu_check.Clock(deadline_s=0.0)
    with pytest.raises(gpu_check.DeadlineExceeded, match="kpo run"):
        clock.left("kpo run")


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_the_script_fails_without_a_gpu_rather_than_skip() -> None:
    for part in ("tests", "learner"):
        result = run_script(part)
        assert result.returncode != 0
        assert "gpu_check: no CUDA device visible" in result.stderr
    unknown = run_script("pipelin")
    assert unknown.returncode == 2 and "unknown part 'pipelin'" in unknown.stderr


def test_ci_never_runs_the_gpu_check() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and "--ignore=tests/gpu" in recipe.group(1)
    assert "gpu-check" not in recipe.group(0)
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "gpu-check" not in ci and "gpu_check" not in ci and "tests/gpu" not in ci
    assert re.search(r"^gpu-check:", makefile, re.M)


# What a bare CUDA machine lacks: the pipeline part needs them, the learner part must not.
PIPELINE_ONLY = ("ray", "vllm", "fastapi", "redis")
LEARNER_PART_MODULES = (
    "tests.conftest",
    "tests.gpu.conftest",
    "tests.gpu.test_learner_cuda",
    "tests.gpu.test_weights_ipc",
    "bench_learner_speed",
)


def test_the_learner_part_imports_neither_ray_nor_vllm_nor_the_control_plane() -> None:
    # None in sys.modules makes any import of the name fail, as on a machine without it.
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in PIPELINE_ONLY)
    imports = "; ".join(f"import {module}" for module in LEARNER_PART_MODULES)
    python_path = os.pathsep.join([str(REPO), str(REPO / "benchmarks")])
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; {blocked}; {imports}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": python_path},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
