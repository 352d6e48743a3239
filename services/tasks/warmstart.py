"""Supervised warm-start: teacher forcing on prompt + reference + EOS, loss on the response only.

A reference may be a demonstration of a tool-using response (`services.tasks.demonstration`):
the tool's observations are in the context but carry no loss, as in RL, so that the model learns
to read a tool's output and never to write one.

Training stops as soon as the accuracy sampled at temperature 1 enters a target band, so that the
model is competent enough to get rewards but leaves RL room to improve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from services.messages import Prompt
from services.tasks.demonstration import Demonstration, segments_of

IGNORE = -100  # label of positions that carry no loss (prompt, observations and padding)


@dataclass(frozen=True)
class WarmStartSettings:
    """Optimiser, schedule and stopping rule of the warm-start."""

    batch_size: int = 32  # smaller batches learn more per example here; 64 needs ~1.7x the data
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    # Cosine decay to `final_lr_fraction` of the peak by this step, then constant: the late,
    # smaller steps settle the arithmetic instead of oscillating around it.
    decay_steps: int = 500
    final_lr_fraction: float = 0.1
    max_steps: int = 1500
    eval_every: int = 20
    # Evaluate only once the smoothed loss is below this: above it, sampled accuracy has stayed
    # under 0.1 in every build we ran, so evaluating earlier only costs time.
    eval_gate_loss: float = 0.25
    target_accuracy: float = 0.25  # stop at the first evaluation at or above this...
    band: tuple[float, float] = (0.1, 0.6)  # ...provided it lies in this band


@dataclass(frozen=True)
class Evaluation:
    """What an evaluation measured: the accuracy the band is about, and other rates to record
    (e.g. a tool-using model's call rate)."""

    accuracy: float
    details: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation during training."""

    step: int
    loss: float  # smoothed training loss at that step
    accuracy: float
    details: dict[str, float] = field(default_factory=dict)


@dataclass
class WarmStartResult:
    """Where the warm-start stopped. `steps` and `accuracy` describe the weights left in place."""

    steps: int
    accuracy: float
    in_band: bool
    history: list[EvalPoint] = field(default_factory=list)


def learning_rate(settings: WarmStartSettings, step: int) -> float:
    """Linear warm-up, cosine decay, then a constant tail."""
    peak = settings.learning_rate
    if step <= settings.warmup_steps:
        return peak * step / settings.warmup_steps
    span = max(1, settings.decay_steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    floor = peak * settings.final_lr_fraction
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def encode_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    responses: list[Demonstration],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids` of prompt + response + EOS, and labels that mask the prompt and
    every observation segment of a response (each segment is tokenized on its own, as a
    multi-turn rollout appends an observation's tokens to the context)."""
    prompt_ids = tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sequences: list[list[int]] = []
    targets: list[list[int]] = []
    for prompt, response in zip(prompt_ids, responses, strict=True):
        sequence, target = list(prompt), [IGNORE] * len(prompt)
        segments = segments_of(response)
        texts = [segment.text for segment in segments]
        for segment, ids in zip(
            segments, tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True
        ):
            sequence += ids
            target += [IGNORE] * len(ids) if segment.observation else ids
        sequences.append([*sequence, eos])
        targets.append([*target, eos])
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
    for row, (seq, target) in enumerate(zip(sequences, targets, strict=True)):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(target)] = torch.tensor(target)
    return input_ids, labels


def response_loss(
    model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (response) positions."""
    # Padding is on the right, so causal attention never lets a real token see it; no mask needed.
    logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
    )


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Iterator[Prompt],
    solve: Callable[[Prompt], Demonstration],
    evaluate: Callable[[], float | Evaluation],
    settings: WarmStartSettings,
    progress: bool = True,
) -> WarmStartResult:
    """Train on `prompts` (in order) against `solve(prompt)` until `evaluate()` is in band.

    The weights left in `model` are those of the last evaluation inside the band (so an
    evaluation that overshoots the band is undone), or the final weights when none was.
    """
    low, high = settings.band
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.98), weight_decay=0.0
    )
    history: list[EvalPoint] = []
    snapshot: tuple[int, float, dict[str, torch.Tensor]] | None = None
    smoothed: float | None = None
    model.train()
    bar = tqdm(total=settings.max_steps, desc="warm-start", unit="step", disable=not progress)
    step = 0
    try:
        for step in range(1, settings.max_steps + 1):
            batch = list(islice(prompts, settings.batch_size))
            input_ids, labels = encode_batch(tokenizer, batch, [solve(p) for p in batch])
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(settings, step)
            loss = response_loss(model, input_ids, labels)
            torch.autograd.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()
            smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
            bar.update(1)
            bar.set_postfix(loss=f"{smoothed:.3f}")
            if step % settings.eval_every or smoothed > settings.eval_gate_loss:
                continue
            measured = _evaluation(evaluate())
            accuracy = measured.accuracy
            history.append(
                EvalPoint(step=step, loss=smoothed, accuracy=accuracy, details=measured.details)
            )
            if progress:
                bar.write(f"step {step:5d}  loss {smoothed:.4f}  sampled accuracy {accuracy:.3f}")
            if low <= accuracy <= high:
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                snapshot = (step, accuracy, state)
            if accuracy >= settings.target_accuracy:
                break
    finally:
        bar.close()
    if snapshot is None:
        final = _evaluation(evaluate())
        return WarmStartResult(steps=step, accuracy=final.accuracy, in_band=False, history=history)
    snap_step, snap_accuracy, state = snapshot
    model.load_state_dict(state)
    return WarmStartResult(steps=snap_step, accuracy=snap_accuracy, in_band=True, history=history)


def _evaluation(measured: float | Evaluation) -> Evaluation:
    return measured if isinstance(measured, Evaluation) else Evaluation(accuracy=measured)
