"""score_batch / score_groups with real worker pools: rewards, timeouts, errors, recovery."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator

import pytest

from services.messages import ScoredResponse
from services.reward.base import Verdict, Verifier, VerifierConfig
from services.reward.pool import WorkerPool, WorkerStartupError
from services.reward.registry import build_verifier
from services.reward.scoring import count_outcomes, make_pool, score_batch, score_groups
from tests.services.reward.builders import prompt, response
from tests.services.reward.pathological import PATHOLOGICAL

# A pool that stopped enforcing deadlines would hang the run: fail instead.
pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 1.0
PROMPTS = {"p": prompt("p", "23"), "q": prompt("q", "-4")}


def warm(verifier: Verifier, pool: WorkerPool[Verdict]) -> None:
    """Start the workers before a test times anything, and check one call end to end."""
    pool.wait_ready()
    scored = score_batch(verifier, [response("p", "#### 23")], PROMPTS, pool=pool)
    assert [s.reward for s in scored] == [1.0]


@pytest.fixture(scope="module")
def flaky() -> Iterator[tuple[Verifier, WorkerPool[Verdict]]]:
    verifier = build_verifier(PATHOLOGICAL, {"timeout_s": TIMEOUT_S})
    with make_pool(verifier, num_workers=2) as pool:
        warm(verifier, pool)
        yield verifier, pool


def outcomes(scored: list[ScoredResponse]) -> list[tuple[float, bool, str | None]]:
    return [(s.reward, s.verified, s.failure) for s in scored]


def test_exact_rewards_with_format_reward() -> None:
    verifier = build_verifier("exact", {"format_reward": 0.25})
    batch = [
        response("p", "#### 23"),
        response("q", "#### 4"),  # well formed, wrong sign
        response("q", "-4"),  # right number, no marker
        response("p", "#### 12\n#### 23</s>"),
    ]
    scored = score_batch(verifier, batch, PROMPTS)  # with a one-off pool
    assert outcomes(scored) == [
        (1.25, True, None),
        (0.25, True, None),
        (0.0, True, None),
        (1.25, True, None),
    ]
    assert [s.response for s in scored] == batch
    assert count_outcomes(scored) == {"scored": 4, "correct": 2, "timeouts": 0, "errors": 0}


def test_math_batch_and_pathological_latex_times_out() -> None:
    verifier = build_verifier("math", {"timeout_s": TIMEOUT_S})
    prompts = {"half": prompt("half", r"\frac{1}{2}"), "two": prompt("two", "2")}
    with make_pool(verifier) as pool:
        right_wrong = [
            response("half", r"so $\boxed{0.5}$"),
            response("two", r"\boxed{3}"),
            response("two", r"\boxed{\frac{"),
        ]
        warm_scored = score_batch(verifier, right_wrong, prompts, pool=pool)
        assert outcomes(warm_scored) == [(1.0, True, None), (0.0, True, None), (0.0, True, None)]
        # A power tower that sympy tries to evaluate: it never finishes on its own.
        start = time.monotonic()
        scored = score_batch(
            verifier, [response("two", r"\boxed{9^{9^{9^{9}}}}")], prompts, pool=pool
        )
        assert time.monotonic() - start < 3 * TIMEOUT_S
        assert outcomes(scored) == [(0.0, False, "timeout")]
        assert outcomes(score_batch(verifier, right_wrong, prompts, pool=pool)) == outcomes(
            warm_scored
        )
        assert pool.restarts == 1


@pytest.mark.parametrize("command", ["sleep", "spin"])
def test_hung_check_times_out_and_pool_recovers(
    flaky: tuple[Verifier, WorkerPool[Verdict]], command: str
) -> None:
    verifier, pool = flaky
    pool.wait_ready()  # time the hung call, not the start of a worker replaced earlier
    restarts = pool.restarts
    start = time.monotonic()
    scored = score_batch(
        verifier,
        [response("p", "#### 23"), response("p", command), response("q", "#### -4")],
        PROMPTS,
        pool=pool,
    )
    assert time.monotonic() - start < 3 * TIMEOUT_S
    assert outcomes(scored) == [(1.0, True, None), (0.0, False, "timeout"), (1.0, True, None)]
    assert pool.restarts == restarts + 1
    # The next batch is scored normally by the replacement worker.
    again = score_batch(
        verifier, [response("q", "#### -4"), response("p", "#### 2")], PROMPTS, pool=pool
    )
    assert outcomes(again) == [(1.0, True, None), (0.0, True, None)]
    assert count_outcomes(scored + again) == {
        "scored": 5,
        "correct": 3,
        "timeouts": 1,
        "errors": 0,
    }


def test_several_hung_checks_in_one_batch(flaky: tuple[Verifier, WorkerPool[Verdict]]) -> None:
    verifier, pool = flaky
    batch = [response("p", "sleep"), response("p", "spin"), response("p", "sleep")]
    batch += [response("p", "#### 23")]
    # Two workers: the third hung call waits for a replacement worker, then for its deadline.
    scored = score_batch(verifier, batch, PROMPTS, pool=pool)
    assert [s.failure for s in scored] == ["timeout", "timeout", "timeout", None]
    assert scored[3].reward == 1.0


def test_exception_marks_only_that_response(flaky: tuple[Verifier, WorkerPool[Verdict]]) -> None:
    verifier, pool = flaky
    restarts = pool.restarts
    batch = [response("p", "#### 23"), response("p", "raise"), response("q", "not-a-verdict")]
    batch.append(response("q", "#### -4"))
    scored = score_batch(verifier, batch, PROMPTS, pool=pool)
    assert outcomes(scored) == [
        (1.0, True, None),
        (0.0, False, "error: RuntimeError: boom"),
        (
            0.0,
            False,
            f"error: TypeError: verifier {PATHOLOGICAL!r} returned float, expected Verdict",
        ),
        (1.0, True, None),
    ]
    assert pool.restarts == restarts  # an exception does not cost the worker
    assert count_outcomes(scored)["errors"] == 2


def test_crashed_worker_fails_its_response_and_is_replaced(
    flaky: tuple[Verifier, WorkerPool[Verdict]],
) -> None:
    verifier, pool = flaky
    restarts = pool.restarts
    scored = score_batch(
        verifier, [response("p", "exit"), response("p", "#### 23")], PROMPTS, pool=pool
    )
    assert scored[0].failure == "error: WorkerCrashed: worker process exited with code 3"
    assert (scored[0].reward, scored[0].verified) == (0.0, False)
    assert outcomes(scored[1:]) == [(1.0, True, None)]
    assert pool.restarts == restarts + 1
    assert outcomes(score_batch(verifier, [response("p", "#### 23")], PROMPTS, pool=pool)) == [
        (1.0, True, None)
    ]


def test_score_groups_keeps_groups_and_order(flaky: tuple[Verifier, WorkerPool[Verdict]]) -> None:
    verifier, pool = flaky
    groups = [
        (PROMPTS["p"], [response("p", "#### 23", version=3), response("p", "#### 1", version=2)]),
        (PROMPTS["q"], [response("q", "raise", version=5)]),
        (PROMPTS["p"], []),
    ]
    scored = score_groups(verifier, groups, pool=pool)
    assert [g.prompt for g in scored] == [p for p, _ in groups]
    assert [[r.reward for r in g.responses] for g in scored] == [[1.0, 0.0], [0.0], []]
    assert scored[0].policy_version == 2
    assert scored[1].responses[0].failure == "error: RuntimeError: boom"
    with pytest.raises(ValueError, match="in the group of prompt 'p'"):
        score_groups(verifier, [(PROMPTS["p"], [response("q", "#### -4")])], pool=pool)


def test_contract_errors(flaky: tuple[Verifier, WorkerPool[Verdict]]) -> None:
    verifier, pool = flaky
    with pytest.raises(ValueError, match="no prompt for prompt_id"):
        score_batch(verifier, [response("missing", "#### 1")], PROMPTS, pool=pool)
    with pytest.raises(ValueError, match="not verifier 'exact'"):
        score_batch(build_verifier("exact"), [response("p", "#### 23")], PROMPTS, pool=pool)
    assert score_batch(verifier, [], PROMPTS, pool=pool) == []


def _unimportable_check(response_text: str, reference: str, config: VerifierConfig) -> Verdict:
    return Verdict(correct=True, well_formed=True)


def test_unimportable_verifier_fails_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    # A module that exists only in this process: it pickles here, but no worker can import it.
    module = types.ModuleType("reward_tests_ephemeral")
    monkeypatch.setattr(_unimportable_check, "__module__", module.__name__)
    module._unimportable_check = _unimportable_check  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    verifier = Verifier("ephemeral", _unimportable_check, VerifierConfig())
    pool = make_pool(verifier)
    with pytest.raises(WorkerStartupError, match="No module named 'reward_tests_ephemeral'"):
        score_batch(verifier, [response("p", "#### 23")], PROMPTS, pool=pool)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([("x", "y")], 1.0)
