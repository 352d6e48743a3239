"""kpo_core's estimators inside TRL (kpo_core/integrations/trl.py), against TRL itself.

Runs in .venv-integrations (scripts/setup_integrations_venv.sh) with TRL 1.16 from PyPI and the
project's tiny model (services/tasks/assets/tiny-arith): every comparison is with TRL's own
GRPOTrainer computing its loss on the same model and batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl import GRPOConfig, GRPOTrainer, TrlParser

from kpo_core.config import KalmanEstimator
from kpo_core.integrations.trl import KpoGRPOConfig, KpoGRPOTrainer
from kpo_core.losses import NonFiniteInputError, token_policy_loss

MODEL = Path(__file__).resolve().parents[2] / "services/tasks/assets/tiny-arith"
COMPLETION_LENGTH = 10
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}
PROMPTS = ["12+7=", "3*4=", "40-15=", "9+9="]


def digit_reward(completions: list[str], **_: Any) -> list[float]:
    """Rewards that differ between completions, so advantages are not all zero."""
    return [float(sum(char.isdigit() for char in text)) for text in completions]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture
def model() -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(MODEL)


def trainer_args(config_type: type[GRPOConfig], tmp_path: Path, **fields: Any) -> GRPOConfig:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": COMPLETION_LENGTH,
        "report_to": [],
        "use_cpu": True,
        "beta": 0.0,
    }
    return config_type(**{**base, **fields})


def make_trainer(
    trainer_type: type[GRPOTrainer],
    config_type: type[GRPOConfig],
    model: PreTrainedModel,
    tokenizer: Any,
    tmp_path: Path,
    **fields: Any,
) -> GRPOTrainer:
    trainer = trainer_type(
        model=model,
        reward_funcs=digit_reward,
        args=trainer_args(config_type, tmp_path, **fields),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=tokenizer,
    )
    # As inside TRL's training loop: the loss is scaled for 2 accumulated micro-batches.
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()
    return trainer


def make_inputs(trainer: GRPOTrainer, tokenizer: Any, seed: int = 0) -> dict[str, Tensor]:
    """A GRPO micro-batch as TRL's generation step leaves it, with stale old log-probs.

    The old log-probs are the model's own moved by noise whose size grows across the batch, so
    some tokens and sequences stay inside narrow clip windows and others leave them.
    """
    generator = torch.Generator().manual_seed(seed)
    prompts = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    batch = len(PROMPTS)
    vocab = trainer.model.config.vocab_size
    completion_ids = torch.randint(4, vocab, (batch, COMPLETION_LENGTH), generator=generator)
    lengths = torch.tensor([COMPLETION_LENGTH, 3, 7, 1])
    completion_mask = (torch.arange(COMPLETION_LENGTH) < lengths[:, None]).long()
    inputs = {
        "prompt_ids": prompts.input_ids,
        "prompt_mask": prompts.attention_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
        "num_items_in_batch": completion_mask.sum() * 2.0,
    }
    with torch.no_grad():
        logps = completion_logps(trainer, inputs)
    scale = torch.tensor([1e-5, 0.05, 0.3, 0.8])[:, None]
    noise = torch.randn(batch, COMPLETION_LENGTH, generator=generator)
    return {
        **inputs,
        "old_per_token_logps": logps + noise * scale,
        "ref_per_token_logps": logps + torch.randn(logps.shape, generator=generator) * 0.2,
        "importance_sampling_ratio": torch.rand(logps.shape, generator=generator) + 0.5,
    }


def completion_logps(trainer: GRPOTrainer, inputs: dict[str, Tensor]) -> Tensor:
    """The model's log-probs of the completion tokens, from TRL's own forward pass."""
    completion = inputs["completion_ids"]
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model,
        torch.cat([inputs["prompt_ids"], completion], dim=1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        completion.size(1),
    )
    return logps


def loss_and_gradients(
    trainer: GRPOTrainer, inputs: dict[str, Tensor]
) -> tuple[Tensor, list[Tensor], dict[str, float]]:
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]
    gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return (
        loss.detach(),
        [
            g if g is not None else torch.zeros_like(p)
            for g, p in zip(gradients, parameters, strict=True)
        ],
        metrics,
    )


def assert_same(
    ours: tuple[Tensor, list[Tensor], Any], theirs: tuple[Tensor, list[Tensor], Any]
) -> None:
    torch.testing.assert_close(ours[0], theirs[0], **TOLERANCE)
    assert len(ours[1]) == len(theirs[1])
    for gradient, expected in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(gradient, expected, **TOLERANCE)
    assert any(bool(g.abs().sum() > 0) for g in ours[1]), "a zero gradient proves little"


# kpo_core estimator -> TRL's importance_sampling_level, and the clip window each is used with.
REPRODUCED = {"token": ("token", 0.2, 0.28), "sequence": ("sequence", 0.05, 0.06)}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("estimator", ["token", "sequence"])
def test_token_and_sequence_reproduce_trl(
    estimator: str, loss_type: str, model: PreTrainedModel, tokenizer: Any, tmp_path: Path
) -> None:
    level, low, high = REPRODUCED[estimator]
    window = {"epsilon": low, "epsilon_high": high, "loss_type": loss_type}
    ours = make_trainer(
        KpoGRPOTrainer,
        KpoGRPOConfig,
        model,
        tokenizer,
        tmp_path,
        ratio_estimator=estimator,
        **window,
    )
    theirs = make_trainer(
        GRPOTrainer,
        GRPOConfig,
        model,
        tokenizer,
        tmp_path,
        importance_sampling_level=level,
        **window,
    )
    inputs = make_inputs(theirs, tokenizer)
    our_result = loss_and_gradients(ours, inputs)
    their_result = loss_and_gradients(theirs, inputs)
    assert_same(our_result, their_result)
    # TRL counts sequence-level clipping per sequence; ours is always a fraction of tokens.
    same_metrics = ["entropy"]
    if estimator == "token":
        same_metrics += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    for key in same_metrics:
        assert our_result[2][key] == pytest.approx(their_result[2][key], abs=1e-6), key
    clipped = our_result[2]["clip_ratio/region_mean"]
    assert 0.0 < clipped < 1.0, "the window must clip some tokens and not others"


def test_trl_masks_kl_and_vllm_correction_apply_as_in_trl(
    model: PreTrainedModel, tokenizer: Any, tmp_path: Path
) -> None:
    fields = {
        "epsilon": 0.2,
        "beta": 0.04,
        "top_entropy_quantile": 0.5,
        "off_policy_mask_threshold": 0.05,
        "use_bias_correction_kl": True,
    }
    ours = make_trainer(
        KpoGRPOTrainer, KpoGRPOConfig, model, tokenizer, tmp_path, ratio_estimator="token", **fields
    )
    theirs = make_trainer(GRPOTrainer, GRPOConfig, model, tokenizer, tmp_path, **fields)
    inputs = make_inputs(theirs, tokenizer, seed=1)
    plain = loss_and_gradients(theirs, inputs)
    for trainer in (ours, theirs):
        # The vLLM correction only reads these two attributes and the batch's ratios; no vLLM
        # engine is involved in computing the loss.
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    our_result, their_result = loss_and_gradients(ours, inputs), loss_and_gradients(theirs, inputs)
    assert_same(our_result, their_result)
    assert our_result[2]["kl"] == pytest.approx(their_result[2]["kl"], abs=1e-6)
    assert float(their_result[0]) != pytest.approx(float(plain[0]), abs=1e-6)


def test_kalman_is_kpo_core_under_trls_aggregation(
    model: PreTrainedModel, tokenizer: Any, tmp_path: Path
) -> None:
    options = {"q": 1e-4, "r": 0.5}
    trainer = make_trainer(
        KpoGRPOTrainer,
        KpoGRPOConfig,
        model,
        tokenizer,
        tmp_path,
        ratio_estimator="kalman",
        estimator_options=options,
        epsilon=0.01,
        epsilon_high=0.02,
        loss_type="grpo",
    )
    inputs = make_inputs(trainer, tokenizer)
    loss, gradients, metrics = loss_and_gradients(trainer, inputs)

    token_loss = token_policy_loss(
        trainer.kpo_estimator,
        completion_logps(trainer, inputs),
        inputs["old_per_token_logps"],
        inputs["advantages"],
        inputs["completion_mask"],
    )
    mask = token_loss.mask.float()
    expected = ((token_loss.per_token.sum(-1) / mask.sum(-1)).mean()) / 2  # grpo, 2 micro-batches
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]
    expected_gradients = torch.autograd.grad(expected, parameters, allow_unused=True)
    torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
    for gradient, want in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(
            gradient, torch.zeros_like(gradient) if want is None else want, **TOLERANCE
        )
    assert trainer.kpo_estimator.q == 1e-4 and trainer.kpo_estimator.clip_high == 0.02
    assert {"kpo/clip_fraction", "kpo/nonfinite_tokens"} <= metrics.keys()

    token = make_trainer(
        KpoGRPOTrainer,
        KpoGRPOConfig,
        model,
        tokenizer,
        tmp_path,
        ratio_estimator="token",
        epsilon=0.01,
        epsilon_high=0.02,
        loss_type="grpo",
    )
    token_value, _, _ = loss_and_gradients(token, inputs)
    assert abs(float(loss) - float(token_value)) > 1e-4, "the filter must change the loss"


def test_clip_window_defaults_to_the_estimators_own(tmp_path: Path) -> None:
    def window(**fields: Any) -> tuple[float, float]:
        config = trainer_args(KpoGRPOConfig, tmp_path, **fields)
        return config.epsilon, config.epsilon_high

    assert window() == (3e-4, 4e-4)  # kalman, as the KPO paper
    assert window(ratio_estimator="cumulative") == (0.025, 0.05)
    assert window(ratio_estimator="token") == (0.2, 0.2)
    assert window(epsilon=0.1) == (0.1, None)  # TRL's rule: epsilon_high follows epsilon
    assert window(epsilon_high=0.3) == (3e-4, 0.3)
    config = trainer_args(KpoGRPOConfig, tmp_path, epsilon=0.1)
    assert config.estimator_config().clip_high == 0.1


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"estimator_options": {"q": -1.0}}, "estimator_options: q: "),
        ({"estimator_options": {"bogus": 1}}, "estimator_options: bogus: "),
        ({"estimator_options": {"clip_low": 0.1}}, "use epsilon instead"),
        ({"estimator_options": '{"q": '}, "estimator_options: not a JSON object"),
        ({"ratio_estimator": "nope"}, "ratio_estimator: unknown estimator 'nope'"),
        ({"epsilon": 1.5}, "epsilon:"),
        ({"loss_type": "cispo"}, "loss_type='cispo'"),
        ({"importance_sampling_level": "sequence"}, "ratio_estimator='sequence'"),
        ({"delta": 2.0}, "delta"),
        ({"entropy_coef": 0.01}, "entropy_coef"),
        ({"truncated_sampling": "sometimes"}, "truncated_sampling='sometimes': must be one of"),
        (
            {"top_p": 0.9, "truncated_sampling": "replay"},
            "truncated_sampling='replay': top_p=0.9 truncates training sampling",
        ),
        (
            {"generation_kwargs": {"top_k": 20}, "truncated_sampling": "replay"},
            "top_k=20 truncates",
        ),
        ({"min_p": 0.05, "truncated_sampling": "refuse"}, "min_p=0.05 truncates"),
    ],
)
def test_bad_settings_are_refused_naming_them(
    fields: dict[str, Any], named: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")) as error:
        trainer_args(KpoGRPOConfig, tmp_path, **fields)
    assert "Traceback" not in str(error.value)


def test_truncated_sampling_is_trained_on_as_trl_does_unless_refused(tmp_path: Path) -> None:
    """Unset or `allow`, a truncating setting is TRL's own behaviour; untruncated, every mode
    is accepted (there is nothing to replay)."""
    for mode in (None, "allow"):
        config = trainer_args(KpoGRPOConfig, tmp_path, top_p=0.9, truncated_sampling=mode)
        assert config.top_p == 0.9
    for mode in ("refuse", "replay"):
        assert trainer_args(KpoGRPOConfig, tmp_path, truncated_sampling=mode).top_p == 1.0


def test_command_line_parses_estimator_and_options(tmp_path: Path) -> None:
    (config,) = TrlParser((KpoGRPOConfig,)).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--ratio_estimator",
            "cumulative",
            "--estimator_options",
            '{"dual_clip_c": 0.1}',
            "--report_to",
            "none",
            "--use_cpu",
            "true",
        ]
    )
    estimator = config.estimator_config()
    assert estimator.name == "cumulative" and estimator.dual_clip_c == 0.1
    assert (estimator.clip_low, estimator.clip_high) == (0.025, 0.05)


def test_nonfinite_log_probs_raise_or_are_masked(
    model: PreTrainedModel, tokenizer: Any, tmp_path: Path
) -> None:
    strict = make_trainer(KpoGRPOTrainer, KpoGRPOConfig, model, tokenizer, tmp_path)
    inputs = make_inputs(strict, tokenizer)
    inputs["old_per_token_logps"][0, 2] = float("nan")
    with pytest.raises(NonFiniteInputError, match="ref_logp"):
        strict._compute_loss(strict.model, inputs)
    masking = make_trainer(
        KpoGRPOTrainer, KpoGRPOConfig, model, tokenizer, tmp_path, nonfinite="mask"
    )
    loss, gradients, metrics = loss_and_gradients(masking, inputs)
    assert torch.isfinite(loss)
    assert all(bool(torch.isfinite(g).all()) for g in gradients)
    assert metrics["kpo/nonfinite_tokens"] == 1.0


def test_trainer_needs_the_kpo_config(
    model: PreTrainedModel, tokenizer: Any, tmp_path: Path
) -> None:
    with pytest.raises(TypeError, match="KpoGRPOConfig"):
        make_trainer(KpoGRPOTrainer, GRPOConfig, model, tokenizer, tmp_path)


def parameter_snapshot(model: PreTrainedModel) -> Iterator[Tensor]:
    return (p.detach().clone() for p in model.parameters())


def test_kpo_trains_end_to_end(model: PreTrainedModel, tokenizer: Any, tmp_path: Path) -> None:
    args = trainer_args(
        KpoGRPOConfig,
        tmp_path,
        max_steps=4,
        num_iterations=2,  # the second pass over a batch is off-policy: the filter has work
        learning_rate=1e-3,
        temperature=1.5,
        logging_steps=1,
        save_strategy="no",
        epsilon=0.01,
        epsilon_high=0.02,
    )
    before = list(parameter_snapshot(model))
    trainer = KpoGRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 4
    # Steps alternate between a fresh batch (ratio 1) and its second, off-policy pass.
    assert [entry["kpo/approx_kl"] == 0.0 for entry in logs] == [True, False, True, False]
    assert all("kpo/kalman_gain_mean" in entry for entry in logs)
    assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    moved = [
        not torch.equal(old, new)
        for old, new in zip(before, parameter_snapshot(model), strict=True)
    ]
    assert any(moved), "training must update the model"


def test_the_documented_example_trains(
    doc_block: Callable[[str, str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The docs' script as pasted, but with the project's tiny model in place of the Hub's,
    # on CPU and for two steps instead of an epoch.
    script = doc_block("python", "KpoGRPOTrainer(")
    assert script.count('"Qwen/Qwen2.5-0.5B-Instruct"') == 1
    script = script.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(MODEL)))
    script = script.replace(
        "KpoGRPOConfig(\n",
        'KpoGRPOConfig(\n    use_cpu=True, max_steps=2, report_to=[], save_strategy="no",\n',
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(script, "docs/integrations.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, KpoGRPOTrainer)
    assert trainer.state.global_step == 2
    assert trainer.kpo_estimator.name == "kalman"
    assert (trainer.kpo_estimator.clip_low, trainer.kpo_estimator.clip_high) == (3e-4, 4e-4)
    assert any("kpo/clip_fraction" in entry for entry in trainer.state.log_history)


def test_kpos_auto_length_resolves_to_trls_max_completion_length(tmp_path: Path) -> None:
    # TRL's own GRPOConfig field is the response limit KPO's `reference_length: auto` uses.
    config = trainer_args(KpoGRPOConfig, tmp_path, max_completion_length=96)
    estimator = config.estimator_config()
    assert isinstance(estimator, KalmanEstimator) and estimator.reference_length == 96
    assert estimator.effective_q == pytest.approx(1e-6 * (4096 / 96) ** 2)
    # TRL's default limit, when the run does not set one.
    default = KpoGRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    assert default.max_completion_length is not None
    assert default.estimator_config().reference_length == default.max_completion_length
    # Unset, `auto` is refused at configuration naming the field; a length needs none.
    with pytest.raises(ValueError, match="max_completion_length is not set"):
        trainer_args(KpoGRPOConfig, tmp_path, max_completion_length=None)
    explicit = trainer_args(
        KpoGRPOConfig,
        tmp_path,
        max_completion_length=None,
        estimator_options={"reference_length": 512},
    )
    assert explicit.estimator_config().reference_length == 512
