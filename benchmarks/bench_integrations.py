"""kpo_core's losses inside verl and TRL, timed against the frameworks' own losses in the same run.

verl: each policy loss, forward+backward on [B, T] log-probs, relative to verl's `vanilla`.
TRL: one loss step (the tiny model's forward, the loss, the backward) of KpoGRPOTrainer,
relative to TRL's own GRPOTrainer on the same batch.

Runs in .venv-integrations: `make bench-integrations`, or
    .venv-integrations/bin/python benchmarks/bench_integrations.py [--batch 64] [--length 2048]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.config import ActorConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_seconds, print_table

from kpo_core.integrations.trl import KpoGRPOConfig, KpoGRPOTrainer
from kpo_core.integrations.verl import KpoPolicyLossConfig

MODEL = Path(__file__).resolve().parents[1] / "services" / "tasks" / "assets" / "tiny-arith"
# verl loss name and the clip window it runs with (the papers' windows).
VERL_LOSSES = [
    ("vanilla", 0.2, 0.28),
    ("kpo_core.token", 0.2, 0.28),
    ("gspo", 3e-4, 4e-4),
    ("kpo_core.sequence", 3e-4, 4e-4),
    ("geo_mean", 0.4, 0.4),
    ("kpo_core.geometric", 0.4, 0.4),
    ("kpo", 3e-4, 4e-4),
    ("ctpo", 0.025, 0.05),
]
TRL_VARIANTS: list[tuple[str, str | None]] = [
    ("GRPOTrainer", None),
    ("KpoGRPOTrainer token", "token"),
    ("KpoGRPOTrainer kalman (KPO)", "kalman"),
    ("KpoGRPOTrainer cumulative (CTPO)", "cumulative"),
]


def bench_verl(batch: int, length: int, repeats: int) -> None:
    torch.manual_seed(0)
    log_prob = -1.0 + 0.3 * torch.randn(batch, length)
    old_log_prob = log_prob + 0.05 * torch.randn(batch, length)
    advantages = torch.randn(batch, 1).expand(batch, length)
    lengths = torch.randint(length // 2, length + 1, (batch,))
    mask = torch.arange(length)[None] < lengths[:, None]

    def step(name: str, low: float, high: float) -> Callable[[], None]:
        config = ActorConfig(
            strategy="fsdp",
            rollout_n=4,
            ppo_micro_batch_size_per_gpu=2,
            clip_ratio_low=low,
            clip_ratio_high=high,
            # The response limit KPO's `reference_length: auto` resolves to, as in a run.
            policy_loss=KpoPolicyLossConfig(loss_mode=name, response_length=length),
        )

        def run() -> None:
            leaf = log_prob.clone().requires_grad_()
            loss, _ = POLICY_LOSS_REGISTRY[name](
                old_log_prob, leaf, advantages, mask, "seq-mean-token-mean", config
            )
            loss.backward()

        return run

    times = [(name, best_seconds(step(name, lo, hi), repeats)) for name, lo, hi in VERL_LOSSES]
    baseline = times[0][1]
    print(f"verl policy loss forward+backward, B={batch}, T={length}, {int(mask.sum())} tokens")
    print_table(
        ["loss", "ms", "time vs vanilla"],
        [[name, f"{s * 1e3:.2f}", f"{s / baseline:.2f}x"] for name, s in times],
    )


def bench_trl(prompts: int, completion_length: int, repeats: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    generator = torch.Generator().manual_seed(0)
    texts = [f"{a}+{a * 7 % 50}=" for a in range(prompts)]
    encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    completion_ids = torch.randint(4, model.config.vocab_size, (prompts, completion_length))
    inputs: dict[str, Any] = {
        "prompt_ids": encoded.input_ids,
        "prompt_mask": encoded.attention_mask,
        "completion_ids": completion_ids,
        "completion_mask": torch.ones(prompts, completion_length, dtype=torch.long),
        "advantages": torch.randn(prompts, generator=generator),
    }

    def make_trainer(output_dir: str, estimator: str | None) -> GRPOTrainer:
        fields: dict[str, Any] = {
            "output_dir": output_dir,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": completion_length,
            "report_to": [],
            "use_cpu": True,
            "beta": 0.0,
            "loss_type": "grpo",
        }
        trainer_type, args = (
            (GRPOTrainer, GRPOConfig(**fields))
            if estimator is None
            else (KpoGRPOTrainer, KpoGRPOConfig(ratio_estimator=estimator, **fields))
        )
        trainer = trainer_type(
            model=model,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": texts}),
            processing_class=tokenizer,
        )
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        return trainer

    def step(trainer: GRPOTrainer) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            trainer._compute_loss(trainer.model, inputs).backward()

        return run

    with tempfile.TemporaryDirectory() as output_dir:
        trainers = [(label, make_trainer(output_dir, name)) for label, name in TRL_VARIANTS]
    with torch.no_grad():
        logps = trainers[0][1]._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_length,
        )[0]
    inputs["old_per_token_logps"] = logps + 0.05 * torch.randn(logps.shape, generator=generator)
    times = [(label, best_seconds(step(trainer), repeats)) for label, trainer in trainers]
    baseline = times[0][1]
    print(
        f"\nTRL loss step (tiny model forward + loss + backward), {prompts} completions of "
        f"{completion_length} tokens"
    )
    print_table(
        ["trainer", "ms", "time vs GRPOTrainer"],
        [[label, f"{s * 1e3:.1f}", f"{s / baseline:.2f}x"] for label, s in times],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bench_verl(args.batch, args.length, args.repeats)
    bench_trl(args.completions, args.completion_length, args.repeats)


if __name__ == "__main__":
    main()
