"""The committed tiny model loads like any model, matches its spec, and is warm-started."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from services.generation.hf_backend import HFBackend
from services.tasks import arith, tiny_model
from services.tasks.sampling_eval import sampled_accuracy
from services.tasks.tiny_model import (
    BUILD_INFO,
    DEFAULT_MODEL_DIR,
    BuildSettings,
    TinyModelSpec,
    build_tiny_model,
    ensure_tiny_model,
    is_model_dir,
    qwen2_config,
)
from services.tasks.tokenizer import build_tokenizer
from services.tasks.warmstart import WarmStartSettings, learning_rate, warm_start

MODEL_DIR = DEFAULT_MODEL_DIR
SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "build_tiny_model.py"


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def info() -> dict[str, object]:
    data: dict[str, object] = json.loads((MODEL_DIR / BUILD_INFO).read_text())
    return data


def test_committed_dir_is_complete_and_small() -> None:
    assert is_model_dir(MODEL_DIR)
    total = sum(f.stat().st_size for f in MODEL_DIR.iterdir())
    assert total < 4_000_000


def test_config_is_qwen2_with_wide_heads(model: PreTrainedModel) -> None:
    config = model.config
    assert isinstance(config, Qwen2Config)
    assert config.model_type == "qwen2"
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.head_dim >= 32
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    assert config.tie_word_embeddings


def test_special_ids_agree(model: PreTrainedModel) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert model.config.vocab_size == len(tokenizer)
    for config in (model.config, model.generation_config):
        assert config.eos_token_id == tokenizer.eos_token_id
        assert config.pad_token_id == tokenizer.pad_token_id
        assert config.bos_token_id == tokenizer.bos_token_id


def test_build_info_in_band(info: dict[str, object]) -> None:
    accuracy = info["eval_accuracy"]
    assert isinstance(accuracy, float)
    assert 0.1 <= accuracy <= 0.6
    assert info["in_band"] is True
    assert info["difficulty"] == arith.DEFAULT_DIFFICULTY
    assert isinstance(info["build_seconds"], float) and info["build_seconds"] < 120


def test_sampled_accuracy_in_loose_band(info: dict[str, object]) -> None:
    difficulty = info["difficulty"]
    assert isinstance(difficulty, int)
    # Eval prompts of another seed than the build's, so the check is not the set that stopped
    # training.
    prompts = arith.generate_prompts(32, seed=1, difficulty=difficulty, split="eval")
    backend = HFBackend(MODEL_DIR)
    accuracy = sampled_accuracy(backend, prompts, seed=0, max_new_tokens=96)
    # The same seed draws the same samples: the accuracy is a function of the weights.
    assert sampled_accuracy(backend, prompts, seed=0, max_new_tokens=96) == accuracy
    # The build measured ~0.26 on 128 prompts. With 32 samples the binomial spread is about
    # +-0.08, so (0.02, 0.8) only fails for a model that is untrained or broken (0/32 right:
    # chance guessing of a 0..45 answer is ~5%) or one warm-started into saturation, which
    # would leave RL nothing to learn.
    assert 0.02 < accuracy < 0.8


def weights_equal(a: Path, b: Path) -> bool:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def quick_settings() -> BuildSettings:
    defaults = BuildSettings()
    return dataclasses.replace(
        defaults,
        eval_size=4,
        warm_start=dataclasses.replace(defaults.warm_start, max_steps=3, batch_size=8),
    )


def test_builder_is_bit_reproducible(tmp_path: Path) -> None:
    settings = quick_settings()
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        build_tiny_model(
            tmp_path / name, seed=seed, settings=settings, progress=False, strict=False
        )
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    assert weights_equal(tmp_path / "a", tmp_path / "b")
    assert not weights_equal(tmp_path / "a", tmp_path / "c")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert loaded.config.model_type == "qwen2"
    built = json.loads((tmp_path / "a" / BUILD_INFO).read_text())
    assert built["steps"] == 3 and built["in_band"] is False


def test_strict_build_that_misses_the_band_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="outside"):
        build_tiny_model(tmp_path / "m", settings=quick_settings(), progress=False)
    assert not (tmp_path / "m").exists()
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind


def test_ensure_returns_existing_models(tmp_path: Path) -> None:
    assert ensure_tiny_model() == DEFAULT_MODEL_DIR
    copy = tmp_path / "copy"
    shutil.copytree(MODEL_DIR, copy)
    assert ensure_tiny_model(copy, progress=False) == copy  # found, so nothing is rebuilt
    assert not is_model_dir(tmp_path)


def scripted_warm_start(accuracies: list[float], max_steps: int) -> tuple[int, float, bool, int]:
    """Run warm_start on a minute model with scripted accuracies, evaluating every step.

    Returns steps, accuracy and in_band of the result, and the step whose weights were kept
    (0 when they match no evaluation).
    """
    tokenizer = build_tokenizer()
    spec = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=32)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(spec, tokenizer))
    seen: list[torch.Tensor] = []  # weights at each evaluation
    scripted: Iterator[float] = iter(accuracies)

    def evaluate() -> float:
        seen.append(model.model.embed_tokens.weight.detach().clone())
        return next(scripted)

    settings = WarmStartSettings(
        batch_size=2, max_steps=max_steps, eval_every=1, eval_gate_loss=float("inf")
    )
    result = warm_start(
        model,
        tokenizer,
        arith.iter_prompts(0, difficulty=1),
        arith.reference_solution,
        evaluate,
        settings,
        progress=False,
    )
    final = model.model.embed_tokens.weight
    kept = next((i + 1 for i, w in enumerate(seen) if torch.equal(w, final)), 0)
    return result.steps, result.accuracy, result.in_band, kept


def test_warm_start_stops_at_target() -> None:
    assert scripted_warm_start([0.0, 0.15, 0.3, 0.5], max_steps=4) == (3, 0.3, True, 3)


def test_warm_start_undoes_an_overshoot() -> None:
    # Step 3 jumps past the band: the weights of step 2, the last in band, are restored.
    assert scripted_warm_start([0.05, 0.12, 0.9], max_steps=4) == (2, 0.12, True, 2)


def test_warm_start_reports_a_miss() -> None:
    # Never in band: the final weights (those of step 4) stay, and are evaluated once more.
    result = scripted_warm_start([0.0, 0.01, 0.02, 0.03, 0.04], max_steps=4)
    assert result == (4, 0.04, False, 4)


def test_learning_rate_schedule() -> None:
    s = WarmStartSettings(learning_rate=1.0, warmup_steps=10, decay_steps=110)
    assert learning_rate(s, 5) == pytest.approx(0.5)
    assert learning_rate(s, 10) == pytest.approx(1.0)
    assert learning_rate(s, 60) == pytest.approx(0.55)
    assert learning_rate(s, 110) == pytest.approx(0.1)
    assert learning_rate(s, 500) == pytest.approx(0.1)


def test_ensure_builds_a_missing_model_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Path, int]] = []

    def fake_build(out: Path, seed: int = 0, *args: object, **kwargs: object) -> None:
        calls.append((Path(out), seed))
        shutil.copytree(MODEL_DIR, out)

    monkeypatch.setattr(tiny_model, "DEFAULT_MODEL_DIR", tmp_path / "not-committed")
    monkeypatch.setattr(tiny_model, "build_tiny_model", fake_build)
    monkeypatch.setenv("KPO_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_model.ensure_tiny_model(progress=False)
    assert path == tmp_path / "cache" / "tiny-arith-seed0"
    assert calls == [(path, 0)]
    assert tiny_model.ensure_tiny_model(progress=False) == path
    assert len(calls) == 1  # built once, then found


def test_cli_reports_a_failed_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("build_tiny_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "m"
    assert cli.main(["--out", str(out), "--max-steps", "2", "--quiet"]) == 1
    assert "build failed" in capsys.readouterr().err
    assert not out.exists()
