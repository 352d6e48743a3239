"""kpo_core's losses inside verl (kpo_core/integrations/verl.py), against verl itself.

Runs in .venv-integrations (scripts/setup_integrations_venv.sh), where verl 0.9.1 from PyPI is
installed: every comparison is with verl's own registered losses and its own loss entry point.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import Tensor
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils import tensordict_utils
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss

from kpo_core.config import KalmanEstimator
from kpo_core.integrations.verl import (
    VERL_LOSSES,
    KpoPolicyLossConfig,
    estimator_config,
    register_verl_losses,
)
from kpo_core.losses import policy_loss

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


class Batch:
    """A verl-shaped micro-batch: right-padded responses, token-level advantages.

    old_log_prob is log_prob moved by noise large enough that the PPO window clips tokens on
    both sides, and that some ratios pass verl's dual-clip bound (3) under a negative advantage.
    """

    def __init__(self, seed: int = 0, batch: int = 8, length: int = 12) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, length + 1, (batch,), generator=generator)
        lengths[0] = length
        self.mask = torch.arange(length) < lengths[:, None]
        self.log_prob = (
            torch.randn(batch, length, generator=generator) * 0.5 - 1.5
        ).requires_grad_()
        noise = torch.randn(batch, length, generator=generator) * 0.4
        noise[1, :2] = -1.5  # ratio e^1.5 > 3
        self.old_log_prob = self.log_prob.detach() + noise
        per_response = torch.randn(batch, 1, generator=generator)
        per_response[1] = -1.0
        self.advantages = per_response.expand(batch, length).clone()
        self.rollout_is_weights = torch.rand(batch, length, generator=generator) * 1.5 + 0.25

    def loss(
        self, fn: Callable[..., tuple[Tensor, dict[str, Any]]], config: Any, mode: str, **extra: Any
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Loss, its gradient w.r.t. log_prob, and the metrics, called as verl's actor calls it."""
        loss, metrics = fn(
            old_log_prob=self.old_log_prob,
            log_prob=self.log_prob,
            advantages=self.advantages,
            response_mask=self.mask,
            loss_agg_mode=mode,
            config=config,
            **extra,
        )
        (gradient,) = torch.autograd.grad(loss, self.log_prob)
        return loss.detach(), gradient, metrics

    def kpo_core_loss(
        self, estimator: str, mode: str, **options: Any
    ) -> tuple[Tensor, Tensor, dict[str, float]]:
        """The same, from kpo_core's own policy_loss (on a copy of log_prob)."""
        log_prob = self.log_prob.detach().clone().requires_grad_()
        loss, metrics = policy_loss(
            estimator,
            log_prob,
            self.old_log_prob,
            self.advantages,
            self.mask,
            loss_agg_mode=mode,  # type: ignore[arg-type]
            **options,
        )
        (gradient,) = torch.autograd.grad(loss, log_prob)
        return loss.detach(), gradient, metrics


def actor_config(clip_low: float, clip_high: float, **fields: Any) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        **fields,
    )


# kpo_core estimator -> verl's own loss, and the clip window each is used with (GSPO's is the
# paper's 3e-4/4e-4, at which sequence ratios of this batch are clipped).
REPRODUCED = {
    "kpo_core.token": ("vanilla", 0.2, 0.28),
    "kpo_core.sequence": ("gspo", 3e-4, 4e-4),
    "kpo_core.geometric": ("geo_mean", 0.4, 0.4),
}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("ours", ["kpo_core.token", "kpo_core.sequence"])
def test_token_and_sequence_reproduce_vanilla_and_gspo(ours: str, mode: str) -> None:
    theirs, low, high = REPRODUCED[ours]
    batch, config = Batch(), actor_config(low, high)
    loss, gradient, metrics = batch.loss(POLICY_LOSS_REGISTRY[ours], config, mode)
    expected, expected_gradient, _ = batch.loss(POLICY_LOSS_REGISTRY[theirs], config, mode)
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)
    assert metrics["actor/pg_clipfrac"] > 0.05, "the window must clip, or the test proves little"


def test_token_estimator_applies_verls_dual_clip() -> None:
    batch = Batch()
    dual_clipped = (batch.advantages < 0) & (batch.old_log_prob < batch.log_prob - 1.1) & batch.mask
    assert dual_clipped.any()
    loose = actor_config(0.2, 0.28, clip_ratio_c=100.0)
    for config in (actor_config(0.2, 0.28), loose):
        loss, gradient, _ = batch.loss(POLICY_LOSS_REGISTRY["kpo_core.token"], config, "token-mean")
        expected, expected_gradient, _ = batch.loss(
            POLICY_LOSS_REGISTRY["vanilla"], config, "token-mean"
        )
        torch.testing.assert_close(loss, expected, **TOLERANCE)
        torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)
    capped, _, _ = batch.loss(
        POLICY_LOSS_REGISTRY["kpo_core.token"], actor_config(0.2, 0.28), "token-mean"
    )
    uncapped, _, _ = batch.loss(POLICY_LOSS_REGISTRY["kpo_core.token"], loose, "token-mean")
    assert float(capped) < float(uncapped)


def test_geometric_reproduces_geo_mean() -> None:
    # verl's geo_mean ignores loss_agg_mode and averages over responses: seq-mean-token-mean.
    _, low, high = REPRODUCED["kpo_core.geometric"]
    batch, config = Batch(), actor_config(low, high)
    loss, gradient, metrics = batch.loss(
        POLICY_LOSS_REGISTRY["kpo_core.geometric"], config, "seq-mean-token-mean"
    )
    expected, expected_gradient, _ = batch.loss(
        POLICY_LOSS_REGISTRY["geo_mean"], config, "seq-mean-token-mean"
    )
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)
    assert metrics["actor/pg_clipfrac"] > 0.05


@pytest.mark.parametrize("ours", sorted(REPRODUCED))
def test_rollout_is_weights_are_applied_as_verl_applies_them(ours: str) -> None:
    theirs, low, high = REPRODUCED[ours]
    mode = "seq-mean-token-mean"
    batch, config = Batch(seed=1), actor_config(low, high)
    weights = {"rollout_is_weights": batch.rollout_is_weights}
    loss, gradient, _ = batch.loss(POLICY_LOSS_REGISTRY[ours], config, mode, **weights)
    expected, expected_gradient, _ = batch.loss(
        POLICY_LOSS_REGISTRY[theirs], config, mode, **weights
    )
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)
    unweighted, _, _ = batch.loss(POLICY_LOSS_REGISTRY[ours], config, mode)
    assert abs(float(loss) - float(unweighted)) > 1e-3


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_global_batch_info_normalises_like_verl(mode: str) -> None:
    # Data-parallel ranks and micro-batches: verl divides by the global token/response counts.
    batch, config = Batch(), actor_config(0.2, 0.28, loss_scale_factor=32)
    config.global_batch_info.update(
        dp_size=4, batch_num_tokens=400, global_batch_size=20, loss_scale_factor=32
    )
    loss, gradient, _ = batch.loss(POLICY_LOSS_REGISTRY["kpo_core.token"], config, mode)
    expected, expected_gradient, _ = batch.loss(POLICY_LOSS_REGISTRY["vanilla"], config, mode)
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)
    local, _, _ = batch.loss(POLICY_LOSS_REGISTRY["kpo_core.token"], actor_config(0.2, 0.28), mode)
    assert abs(float(loss) - float(local)) > 1e-4


# verl's response limit in these configs: KPO's `reference_length: auto` resolves to it.
RESPONSE_LENGTH = 12


def kpo_actor_config(loss_mode: str, mode: str, options: dict[str, Any]) -> ActorConfig:
    return actor_config(
        3e-4,
        4e-4,
        loss_agg_mode=mode,
        policy_loss=KpoPolicyLossConfig(
            loss_mode=loss_mode, estimator_options=options, response_length=RESPONSE_LENGTH
        ),
    )


def resolved(estimator: str, options: dict[str, Any], length: int = RESPONSE_LENGTH) -> dict:
    """kpo_core's options for `estimator` with KPO's `auto` length resolved as verl's is."""
    return {"reference_length": length, **options} if estimator == "kalman" else options


@pytest.mark.parametrize(
    ("loss_mode", "estimator", "options"),
    [
        ("kpo", "kalman", {}),
        ("kpo", "kalman", {"q": 1e-3, "r": 0.1, "x0": 0.05}),
        ("kpo", "kalman", {"q": 1e-2, "r": 0.5, "gradient": "through_filter"}),
        ("ctpo", "cumulative", {}),
        ("ctpo", "cumulative", {"dual_clip_c": 0.1, "max_log_ratio": 5.0}),
    ],
)
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_kpo_and_ctpo_in_verl_equal_kpo_core(
    loss_mode: str, estimator: str, options: dict[str, Any], mode: str
) -> None:
    batch = Batch(seed=2)
    config = kpo_actor_config(loss_mode, mode, options)
    loss, gradient, metrics = batch.loss(POLICY_LOSS_REGISTRY[loss_mode], config, mode)
    expected, expected_gradient, expected_metrics = batch.kpo_core_loss(
        estimator, mode, clip_low=3e-4, clip_high=4e-4, **resolved(estimator, options)
    )
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)
    assert metrics["actor/kpo/ratio_mean"] == pytest.approx(expected_metrics["ratio_mean"])
    vanilla, _, _ = batch.loss(POLICY_LOSS_REGISTRY["vanilla"], config, mode)
    assert abs(float(loss) - float(vanilla)) > 1e-4, "the estimator must change the loss"


def test_estimator_options_change_the_kpo_loss() -> None:
    batch = Batch(seed=2)
    default, _, _ = batch.loss(
        POLICY_LOSS_REGISTRY["kpo"], kpo_actor_config("kpo", "token-mean", {}), "token-mean"
    )
    tuned, _, metrics = batch.loss(
        POLICY_LOSS_REGISTRY["kpo"],
        kpo_actor_config("kpo", "token-mean", {"q": 1e-2, "r": 0.1}),
        "token-mean",
    )
    assert abs(float(default) - float(tuned)) > 1e-4
    assert metrics["actor/kpo/kalman_gain_mean"] > 0.1


def micro_batch_tensordict(batch: Batch, prompt_length: int = 3) -> tuple[Tensor, Any]:
    """The batch as verl's actor hands it to ppo_loss: a flat log-prob row per sequence.

    ppo_loss reads each response's log-probs from the model output one position to the left of
    the response tokens (prompt and response concatenated, no padding).
    """
    rows, lengths = [], batch.mask.sum(-1)
    generator = torch.Generator().manual_seed(5)
    for index, length in enumerate(lengths.tolist()):
        row = torch.randn(prompt_length + length, generator=generator)
        row[prompt_length - 1 : prompt_length - 1 + length] = batch.log_prob.detach()[
            index, :length
        ]
        rows.append(row)
    size, response_length = batch.mask.shape
    data = tensordict_utils.get_tensordict(
        {
            "prompts": torch.ones(size, prompt_length, dtype=torch.long),
            "responses": torch.ones(size, response_length, dtype=torch.long),
            "attention_mask": torch.cat(
                [torch.ones(size, prompt_length, dtype=torch.long), batch.mask.long()], dim=1
            ),
            "response_mask": batch.mask.long(),
            "old_log_probs": batch.old_log_prob,
            "advantages": batch.advantages,
        },
        non_tensor_dict={"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None},
    )
    return torch.cat(rows).requires_grad_(), data


def test_hydra_config_and_verls_ppo_loss_run_kpo_with_its_options() -> None:
    # The path of a real run: the actor config built from Hydra YAML by verl's own converter
    # (with kpo_core's policy-loss config class as _target_), then verl's actor loss function.
    yaml = OmegaConf.create(
        {
            "_target_": "verl.workers.config.ActorConfig",
            "strategy": "fsdp",
            "rollout_n": 4,
            "ppo_micro_batch_size_per_gpu": 2,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "loss_agg_mode": "seq-mean-token-mean",
            "policy_loss": {
                "_target_": "kpo_core.integrations.verl.KpoPolicyLossConfig",
                "loss_mode": "kpo",
                "estimator_options": {"q": 1e-3, "r": 0.1},
                "response_length": RESPONSE_LENGTH,
            },
        }
    )
    config = omega_conf_to_dataclass(yaml)
    assert isinstance(config.policy_loss, KpoPolicyLossConfig)
    batch = Batch(seed=3)
    model_log_probs, data = micro_batch_tensordict(batch)
    loss, metrics = ppo_loss(config, {"log_probs": model_log_probs}, data)
    expected, _, _ = batch.kpo_core_loss(
        "kalman",
        "seq-mean-token-mean",
        clip_low=0.2,
        clip_high=0.28,
        **resolved("kalman", {"q": 1e-3, "r": 0.1}),
    )
    torch.testing.assert_close(loss.detach(), expected, **TOLERANCE)
    assert "actor/kpo/kalman_gain_mean" in metrics
    (gradient,) = torch.autograd.grad(loss, model_log_probs)
    assert int((gradient != 0).sum()) == int(batch.mask.sum())


@pytest.mark.parametrize(
    ("loss_mode", "options", "message"),
    [
        ("kpo", {"q": -1.0}, "estimator_options: q: "),
        ("kpo", {"kalman_gain": 0.5}, "estimator_options: kalman_gain: "),
        ("kpo", {"clip_low": 0.1}, "actor_rollout_ref.actor.clip_ratio_low"),
        ("kpo_core.token", {"dual_clip_c": 2.0}, "actor_rollout_ref.actor.clip_ratio_c"),
        ("ctpo", {"gradient": "through_filter"}, "estimator_options: gradient: "),
    ],
)
def test_bad_estimator_options_name_the_option(
    loss_mode: str, options: dict[str, Any], message: str
) -> None:
    batch = Batch()
    config = kpo_actor_config(loss_mode, "token-mean", options)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        batch.loss(POLICY_LOSS_REGISTRY[loss_mode], config, "token-mean")


def test_a_clip_window_kpo_core_refuses_names_verls_setting() -> None:
    batch = Batch()
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.clip_ratio_low"):
        batch.loss(POLICY_LOSS_REGISTRY["kpo"], actor_config(1.5, 0.2), "token-mean")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"truncated_sampling": "replay", "rollout_top_p": 0.9},
            r"policy_loss\.truncated_sampling='replay': actor_rollout_ref\.rollout\.top_p=0\.9 "
            "truncates training sampling, and this framework's generation does not record",
        ),
        (
            {"truncated_sampling": "refuse", "rollout_top_k": 20},
            r"actor_rollout_ref\.rollout\.top_k=20 truncates training sampling, which "
            r"actor_rollout_ref\.actor\.policy_loss\.truncated_sampling='refuse' refuses",
        ),
        ({"truncated_sampling": "maybe"}, "'maybe': must be one of"),
    ],
)
def test_replay_or_refuse_of_truncated_rollouts_is_refused_naming_the_settings(
    section: dict[str, Any], message: str
) -> None:
    batch = Batch()
    policy = KpoPolicyLossConfig(loss_mode="kpo", response_length=32, **section)
    with pytest.raises(ValueError, match=message):
        batch.loss(
            POLICY_LOSS_REGISTRY["kpo"], actor_config(3e-4, 4e-4, policy_loss=policy), "token-mean"
        )
    # verl's defaults (top-p 1, top-k -1) truncate nothing: any mode trains; so does `allow`.
    for fields in (
        {"truncated_sampling": "replay", "rollout_top_p": 1.0, "rollout_top_k": -1},
        {"truncated_sampling": "allow", "rollout_top_p": 0.9},
        {"rollout_top_k": 20},
    ):
        policy = KpoPolicyLossConfig(loss_mode="kpo", response_length=32, **fields)
        config = actor_config(3e-4, 4e-4, policy_loss=policy)
        loss, _, _ = batch.loss(POLICY_LOSS_REGISTRY["kpo"], config, "token-mean")
        assert torch.isfinite(loss)


def test_nonfinite_inputs_raise_by_default_and_are_counted_when_masked() -> None:
    batch = Batch()
    batch.old_log_prob[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf in valid tokens"):
        batch.loss(
            POLICY_LOSS_REGISTRY["kpo"], kpo_actor_config("kpo", "token-mean", {}), "token-mean"
        )
    config = actor_config(
        3e-4,
        4e-4,
        policy_loss=KpoPolicyLossConfig(
            loss_mode="kpo", nonfinite="mask", response_length=RESPONSE_LENGTH
        ),
    )
    loss, gradient, metrics = batch.loss(POLICY_LOSS_REGISTRY["kpo"], config, "token-mean")
    assert torch.isfinite(loss) and bool(torch.isfinite(gradient).all())
    assert metrics["actor/kpo/nonfinite_tokens"] == 1.0


def test_registration_is_idempotent_and_keeps_verls_own_names() -> None:
    assert register_verl_losses() == list(VERL_LOSSES)
    assert POLICY_LOSS_REGISTRY["vanilla"].__module__ == "verl.trainer.ppo.core_algos"
    POLICY_LOSS_REGISTRY["kpo"] = POLICY_LOSS_REGISTRY["vanilla"]
    try:
        with pytest.warns(UserWarning, match="verl already has a policy loss called 'kpo'"):
            registered = register_verl_losses()
        assert "kpo" not in registered and "kpo_core.kalman" in registered
        assert POLICY_LOSS_REGISTRY["kpo"] is POLICY_LOSS_REGISTRY["vanilla"]
    finally:
        del POLICY_LOSS_REGISTRY["kpo"]
        register_verl_losses()


def registry_in_fresh_interpreter(**environment: str) -> dict[str, str]:
    """verl's policy-loss registry, name -> defining module, right after `import verl`."""
    code = (
        "import json, verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as registry\n"
        "print(json.dumps({name: fn.__module__ for name, fn in registry.items()}))\n"
    )
    env = {**os.environ, **environment}
    output = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    return dict(json.loads(output.strip().splitlines()[-1]))


def test_verl_loads_the_plugin_by_itself_through_the_entry_point() -> None:
    registry = registry_in_fresh_interpreter()
    assert {name: registry.get(name) for name in VERL_LOSSES} == dict.fromkeys(
        VERL_LOSSES, "kpo_core.integrations.verl"
    )
    without_plugins = registry_in_fresh_interpreter(VERL_USE_EXTERNAL_PLUGINS="none")
    assert "vanilla" in without_plugins and not set(VERL_LOSSES) & set(without_plugins)


def test_importing_kpo_core_imports_no_framework() -> None:
    code = (
        "import sys, kpo_core, kpo_core.losses, kpo_core.ratios, kpo_core.integrations\n"
        "print(sorted(m for m in ('verl', 'trl', 'transformers') if m in sys.modules))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert output.stdout.strip() == "[]"


def test_the_documented_command_composes_with_verls_config_and_runs_kpo(
    doc_block: Callable[[str, str], str],
) -> None:
    # Every override of the docs' command, checked by Hydra against verl's own ppo_trainer
    # config (a misspelt key fails here), then the actor config verl builds from it.
    command = shlex.split(doc_block("bash", "verl.trainer.main_ppo").replace("\\\n", " "))
    overrides = command[command.index("verl.trainer.main_ppo") + 1 :]
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        composed = compose(config_name="ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(composed.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, KpoPolicyLossConfig)
    assert actor.policy_loss.loss_mode == "kpo"
    batch = Batch(seed=5)
    loss, gradient, _ = batch.loss(POLICY_LOSS_REGISTRY["kpo"], actor, actor.loss_agg_mode)
    # KPO's `auto` length is verl's own response limit: the rollout's, from data's.
    length = composed.actor_rollout_ref.rollout.response_length
    assert length == composed.data.max_response_length == 1024
    assert actor.policy_loss.response_length == length
    expected, expected_gradient, _ = batch.kpo_core_loss(
        "kalman",
        "seq-mean-token-mean",
        clip_low=3e-4,
        clip_high=4e-4,
        **resolved("kalman", actor.policy_loss.estimator_options, length),
    )
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)
    assert actor.policy_loss.estimator_options == {"q": 1e-6, "r": 1.0}


def test_kpos_auto_length_resolves_to_verls_response_length_from_its_real_config() -> None:
    # verl's own ppo_trainer config, composed by Hydra: the response limit is the rollout's
    # response_length (from data.max_response_length), handed to the policy loss section.
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    overrides = [
        "data.max_response_length=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=kpo",
        "actor_rollout_ref.actor.policy_loss._target_="
        "kpo_core.integrations.verl.KpoPolicyLossConfig",
        "+actor_rollout_ref.actor.policy_loss.response_length="
        "${actor_rollout_ref.rollout.response_length}",
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        composed = compose(config_name="ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(composed.actor_rollout_ref.actor)
    config = estimator_config("kalman", actor)
    assert isinstance(config, KalmanEstimator)
    assert config.reference_length == 256
    assert config.effective_q == pytest.approx(1e-6 * (4096 / 256) ** 2)
    # Without it, `auto` is refused naming the setting to add, not left at 4,096 tokens.
    unset = actor_config(3e-4, 4e-4, policy_loss=KpoPolicyLossConfig(loss_mode="kpo"))
    with pytest.raises(ValueError, match=r"policy_loss\.response_length .* is not set"):
        estimator_config("kalman", unset)
    # An explicit length or the paper's constants need none.
    paper = KpoPolicyLossConfig(loss_mode="kpo", estimator_options={"reference_length": None})
    explicit = actor_config(3e-4, 4e-4, policy_loss=paper)
    assert estimator_config("kalman", explicit).reference_length is None
