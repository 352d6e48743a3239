"""Resume waits on the learner's ranks with a deadline that names the ranks that stayed silent."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from services.learner.group import LearnerGroup, LearnerRanksSilent, wait_all
from services.spec import LearnerConfig, RunSpec

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.timeout(300)]

DEADLINE_S = 5.0


def test_a_rank_that_never_answers_on_resume_fails_within_the_deadline_named(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = LearnerConfig(
        lr=1e-2, num_cpus=0.5, strategy="fsdp2", world_size=2, resume_timeout_s=DEADLINE_S
    )
    group = LearnerGroup(RunSpec(learner=config), str(tiny_model_dir))
    hung_pid = 0
    try:
        wait_all(group.setup())
        checkpoint = str(tmp_path / "learner")
        group.save_checkpoint(checkpoint)()  # start, then wait for every rank
        # Rank 1's process is frozen (as by a hung device or filesystem): it is alive to Ray,
        # never answers, and rank 0 waits for it in the load's collectives.
        hung_pid = group.pids()[1]
        os.kill(hung_pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(LearnerRanksSilent) as raised:
            group.load_checkpoint(checkpoint)
        waited = time.monotonic() - started
        assert DEADLINE_S <= waited < DEADLINE_S + 30
        assert 1 in raised.value.ranks
        message = str(raised.value)
        assert "rank" in message and "1" in message and "load_checkpoint" in message
        assert f"{DEADLINE_S:g} s" in message
    finally:
        if hung_pid:
            os.kill(hung_pid, signal.SIGCONT)
        group.kill()


def test_ranks_that_answer_in_time_return_rank_0s_result(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = LearnerConfig(num_cpus=0.5, resume_timeout_s=DEADLINE_S * 20)
    group = LearnerGroup(RunSpec(learner=config), str(tiny_model_dir))
    try:
        wait_all(group.setup())
        group.save_checkpoint(str(tmp_path / "learner"))()
        assert group.load_checkpoint(str(tmp_path / "learner")) == 0
    finally:
        group.kill()


def test_a_wait_that_wakes_early_still_gives_the_ranks_their_whole_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ray.wait may return empty-handed a little before its timeout (its timer's granularity);
    the deadline is a promise to the ranks, so `wait_all` waits out the rest of it."""
    wakes = []

    def early_wait(pending: list[object], num_returns: int, timeout: float) -> tuple[list, list]:
        wakes.append(timeout)
        return [], pending  # at once, whatever the timeout

    monkeypatch.setattr("services.learner.group.ray.wait", early_wait)
    deadline_s = 0.2
    started = time.monotonic()
    with pytest.raises(LearnerRanksSilent) as raised:
        wait_all(["rank 0", "rank 1"], deadline_s, "load_checkpoint")
    assert time.monotonic() - started >= deadline_s
    assert len(wakes) > 1 and raised.value.ranks == [0, 1]
