"""Score responses with a verifier: run its checks in a worker pool, turn outcomes into rewards.

Reward of a verified response: 1 if correct else 0, plus `format_reward` if well formed.
A check that times out or fails scores 0 with `verified=False` and a `failure` of `"timeout"` or
`"error: <ExceptionType>: <message>"`; only that response is affected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from services.messages import Prompt, Response, ScoredGroup, ScoredResponse
from services.reward.base import Verdict, Verifier, VerifierConfig
from services.reward.pool import Done, Outcome, Raised, TimedOut, WorkerPool

CORRECT_REWARD = 1.0
TIMEOUT_FAILURE = "timeout"
ERROR_PREFIX = "error: "


def make_pool(verifier: Verifier, num_workers: int = 1) -> WorkerPool[Verdict]:
    """A worker pool that runs `verifier`'s check; reuse it across batches, close it at the end."""
    return WorkerPool(verifier, num_workers)


def compose_reward(verdict: Verdict, config: VerifierConfig) -> float:
    """Correctness reward plus, for a well-formed answer, the format reward."""
    reward = CORRECT_REWARD if verdict.correct else 0.0
    return reward + (config.format_reward if verdict.well_formed else 0.0)


def is_correct(scored: ScoredResponse) -> bool:
    """Whether the response was verified correct (format reward is < 1, see VerifierConfig)."""
    return scored.verified and scored.reward >= CORRECT_REWARD


def to_scored(
    response: Response, outcome: Outcome[Verdict], config: VerifierConfig
) -> ScoredResponse:
    """The scored response for one check outcome."""
    match outcome:
        case Done(value=verdict):
            return ScoredResponse(response, compose_reward(verdict, config), verified=True)
        case TimedOut():
            return ScoredResponse(response, 0.0, verified=False, failure=TIMEOUT_FAILURE)
        case Raised(error=error):
            return ScoredResponse(response, 0.0, verified=False, failure=ERROR_PREFIX + error)
    raise TypeError(f"not an outcome: {outcome!r}")


def _score(
    verifier: Verifier,
    items: Sequence[tuple[Response, str]],
    pool: WorkerPool[Verdict] | None,
) -> list[ScoredResponse]:
    """Score (response, reference answer) pairs, in order."""
    if not items:
        return []
    if pool is None:
        with make_pool(verifier) as own_pool:
            return _score(verifier, items, own_pool)
    if pool.target != verifier:
        raise ValueError(f"the pool runs {pool.target!r}, not verifier {verifier.name!r}")
    outcomes = pool.run([(r.text, answer) for r, answer in items], verifier.config.timeout_s)
    return [
        to_scored(response, outcome, verifier.config)
        for (response, _), outcome in zip(items, outcomes, strict=True)
    ]


def score_batch(
    verifier: Verifier,
    responses: Sequence[Response],
    prompts: Mapping[str, Prompt],
    *,
    pool: WorkerPool[Verdict] | None = None,
) -> list[ScoredResponse]:
    """Score each response against the answer of its prompt (`prompts[response.prompt_id]`).

    Without `pool`, a one-off pool is started and closed (seconds of start-up): pass a pool from
    `make_pool` when scoring more than once. Raises ValueError when a prompt is missing.
    """
    missing = sorted({r.prompt_id for r in responses} - prompts.keys())
    if missing:
        raise ValueError(f"no prompt for prompt_id(s): {', '.join(missing)}")
    return _score(verifier, [(r, prompts[r.prompt_id].answer) for r in responses], pool)


def score_groups(
    verifier: Verifier,
    groups: Sequence[tuple[Prompt, Sequence[Response]]],
    *,
    pool: WorkerPool[Verdict] | None = None,
) -> list[ScoredGroup]:
    """Score every group's responses against its prompt, as one batch; groups keep their order.

    Raises ValueError when a response belongs to another prompt than its group's.
    """
    items: list[tuple[Response, str]] = []
    for prompt, responses in groups:
        for response in responses:
            if response.prompt_id != prompt.prompt_id:
                raise ValueError(
                    f"response for prompt {response.prompt_id!r} "
                    f"in the group of prompt {prompt.prompt_id!r}"
                )
            items.append((response, prompt.answer))
    scored = iter(_score(verifier, items, pool))
    return [ScoredGroup(prompt, [next(scored) for _ in responses]) for prompt, responses in groups]


def count_outcomes(scored: Iterable[ScoredResponse]) -> dict[str, int]:
    """Counts of scored, correct, timed-out and failed (error) responses."""
    counts = {"scored": 0, "correct": 0, "timeouts": 0, "errors": 0}
    for item in scored:
        counts["scored"] += 1
        counts["correct"] += is_correct(item)
        counts["timeouts"] += item.failure == TIMEOUT_FAILURE
        counts["errors"] += item.failure is not None and item.failure.startswith(ERROR_PREFIX)
    return counts
