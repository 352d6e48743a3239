"""Real process kills of a run's actors (SIGKILL, SIGSTOP) in the middle of `kpo run`.

Every run here must end where it would have without the fault: all steps, numbered without a
gap or a repeat, and every prompt accounted for exactly once (`assert_ledger_balances`).
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import pytest

from services.pipeline.outputs import read_metrics
from tests.chaos.runs import (
    KpoRun,
    actor_pid,
    assert_ledger_balances,
    kill,
    status_of,
    steps_in,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)

BATCH_GROUPS = 4  # TINY_RUN's


def last_record(run: KpoRun) -> dict[str, float]:
    return read_metrics(run.out)[-1]


def test_a_killed_generation_actor_is_replaced_and_its_prompts_are_issued_again(
    tmp_path: Path,
) -> None:
    with KpoRun(tmp_path, "pipeline.steps=6") as run:
        run.wait_for_steps(2)
        kill(actor_pid(run.out, "generation"))
        assert run.finish() == 0, run.output
    assert steps_in(run.out) == [1, 2, 3, 4, 5, 6]
    assert last_record(run)["generation_replacements"] == 1
    assert status_of(run.out)["state"] == "succeeded"
    assert_ledger_balances(run.out, BATCH_GROUPS)


def test_a_killed_verifier_actor_is_replaced(tmp_path: Path) -> None:
    with KpoRun(tmp_path, "pipeline.steps=6") as run:
        run.wait_for_steps(2)
        old = actor_pid(run.out, "verifiers")
        kill(old)
        assert run.finish() == 0, run.output
    assert steps_in(run.out) == [1, 2, 3, 4, 5, 6]
    assert last_record(run)["verifier_replacements"] == 1
    new = actor_pid(run.out, "verifiers")
    assert new != old  # status.json names the replacement
    assert_ledger_balances(run.out, BATCH_GROUPS)


def test_a_hung_verifier_actor_is_replaced_and_its_batch_scored_again(tmp_path: Path) -> None:
    # SIGSTOP: the process is alive and holds its calls, but never answers.
    with KpoRun(tmp_path, "pipeline.steps=6", "reward.call_timeout_s=8") as run:
        run.wait_for_steps(2)
        kill(actor_pid(run.out, "verifiers"), signal.SIGSTOP)
        assert run.finish() == 0, run.output
    assert steps_in(run.out) == [1, 2, 3, 4, 5, 6]
    record = last_record(run)
    assert record["verifier_replacements"] == 1 and record["rescored_groups"] >= 1
    assert record["unverified_groups"] == 0
    assert "taking it for hung" in run.output
    assert_ledger_balances(run.out, BATCH_GROUPS)


# A single learner, and rank 1 of a 2-rank FSDP2 group: rank 0, still alive, waits in a
# collective for it, so the driver must notice rank 1's death itself.
LEARNER_GROUPS = [
    pytest.param((), 0, id="single"),
    pytest.param(("learner.strategy=fsdp2", "learner.world_size=2"), 1, id="fsdp2-rank-1"),
]


@pytest.mark.parametrize(("group", "rank"), LEARNER_GROUPS)
def test_a_killed_learner_resumes_the_run_from_its_checkpoint(
    tmp_path: Path, group: tuple[str, ...], rank: int
) -> None:
    with KpoRun(tmp_path, "pipeline.steps=6", "pipeline.checkpoint_every=2", *group) as run:
        run.wait_for_steps(3)
        kill(actor_pid(run.out, "learner", rank))
        assert run.finish() == 0, run.output
    records = read_metrics(run.out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # The new learner went on from the checkpoint's version: no version repeated or skipped.
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["learner_restarts"] == 1
    assert records[-1]["tokens_trained_total"] == sum(r["tokens_trained"] for r in records)
    status = status_of(run.out)
    assert [t["state"] for t in status["transitions"]] == ["running", "running", "succeeded"]
    assert status["resumed_from"] in (2, 4)
    assert "Traceback" not in run.output
    assert_ledger_balances(run.out, BATCH_GROUPS)


def test_faults_beyond_the_budget_fail_the_run_with_the_reason(tmp_path: Path) -> None:
    with KpoRun(tmp_path, "pipeline.steps=200", "pipeline.actor_replacements=0") as run:
        run.wait_for_steps(1)
        kill(actor_pid(run.out, "generation"))
        assert run.finish() == 1, run.output
    status = status_of(run.out)
    assert status["state"] == "failed"
    assert "pipeline.actor_replacements" in status["error"]
    assert "Traceback" not in run.output


COLLECTIVE = ("pipeline.weight_transport=collective", "generation.num_workers=2")


def test_a_generation_actor_killed_under_the_collective_transport_costs_one_replacement(
    tmp_path: Path,
) -> None:
    """Between two publishes: the replacement joins a re-formed weight group before the next
    version is sent, so it is not replaced again, the surviving worker keeps its prompts, and
    the learner is never restarted."""
    with KpoRun(tmp_path, "pipeline.steps=6", *COLLECTIVE) as run:
        run.wait_for_steps(2)
        kill(actor_pid(run.out, "generation", 1))
        assert run.finish() == 0, run.output
    assert steps_in(run.out) == [1, 2, 3, 4, 5, 6]
    record = last_record(run)
    assert record["generation_replacements"] == 1
    assert record["learner_restarts"] == 0
    assert [r["policy_version"] for r in read_metrics(run.out)] == [1, 2, 3, 4, 5, 6]
    assert "Traceback" not in run.output
    assert_ledger_balances(run.out, BATCH_GROUPS)


def test_a_generation_actor_killed_during_a_collective_publish_costs_one_replacement(
    tmp_path: Path,
) -> None:
    """Stopped at step 2, it acknowledges no receive from then on: by the time two more steps
    were recorded (or it was taken for hung), a version was sent to it that it never received.
    Killed then, mid-delivery: one replacement, and no learner restart."""
    with KpoRun(tmp_path, "pipeline.steps=6", *COLLECTIVE) as run:
        run.wait_for_steps(2)
        pid = actor_pid(run.out, "generation", 1)
        kill(pid, signal.SIGSTOP)
        wait_for(
            lambda: len(steps_in(run.out)) >= 4 or actor_pid(run.out, "generation", 1) != pid,
            240,
            "a publish to the stopped worker",
        )
        with contextlib.suppress(ProcessLookupError):  # taken for hung and killed already
            kill(pid)
        assert run.finish() == 0, run.output
    assert steps_in(run.out) == [1, 2, 3, 4, 5, 6]
    record = last_record(run)
    assert record["generation_replacements"] == 1
    assert record["learner_restarts"] == 0
    assert "Traceback" not in run.output
    assert_ledger_balances(run.out, BATCH_GROUPS)
