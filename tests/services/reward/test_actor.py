"""VerifierActor end to end on a real local Ray instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from services.messages import ScoredGroup
from services.reward.actor import start_verifier_actor
from tests.services.reward.builders import prompt, response
from tests.services.reward.pathological import PATHOLOGICAL

# A pool that stopped enforcing deadlines would hang the run: fail instead.
pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    # PYTHONPATH so that actors (and their worker processes) import `services` and `tests` from
    # this checkout whatever directory pytest was started from.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    yield
    ray.shutdown()


def test_actor_scores_groups_end_to_end() -> None:
    actor = start_verifier_actor("exact", {"format_reward": 0.5})
    p, q = prompt("p", "23"), prompt("q", "7")
    groups = [
        (p, [response("p", "#### 23", version=4), response("p", "#### 22", version=3)]),
        (q, [response("q", "seven"), response("q", "#### 7.0</s>")]),
    ]
    scored: list[ScoredGroup] = ray.get(actor.score.remote(groups), timeout=60)
    assert [g.prompt for g in scored] == [p, q]
    assert [[r.reward for r in g.responses] for g in scored] == [[1.5, 0.5], [0.0, 1.5]]
    assert [r.response for r in scored[0].responses] == groups[0][1]
    assert scored[0].policy_version == 3
    assert ray.get(actor.stats.remote()) == {
        "scored": 4,
        "correct": 2,
        "timeouts": 0,
        "errors": 0,
        "worker_restarts": 0,
    }
    ray.kill(actor)


def test_actor_counts_timeouts_and_errors_and_recovers() -> None:
    actor = start_verifier_actor(
        PATHOLOGICAL,
        {"timeout_s": 1.0},
        plugin_modules=["tests.services.reward.pathological"],
    )
    p = prompt("p", "5")
    first: list[ScoredGroup] = ray.get(
        actor.score.remote([(p, [response("p", "sleep"), response("p", "raise")])]), timeout=60
    )
    assert [r.failure for r in first[0].responses] == ["timeout", "error: RuntimeError: boom"]
    second: list[ScoredGroup] = ray.get(
        actor.score.remote([(p, [response("p", "#### 5"), response("p", "#### 6")])]), timeout=60
    )
    assert [(r.reward, r.verified) for r in second[0].responses] == [(1.0, True), (0.0, True)]
    assert ray.get(actor.stats.remote()) == {
        "scored": 4,
        "correct": 1,
        "timeouts": 1,
        "errors": 1,
        "worker_restarts": 1,
    }
    ray.kill(actor)


def test_actor_with_unknown_verifier_fails_listing_names() -> None:
    actor = start_verifier_actor("nope")
    with pytest.raises(ray.exceptions.RayActorError, match="valid names: exact, math"):
        ray.get(actor.stats.remote(), timeout=60)
