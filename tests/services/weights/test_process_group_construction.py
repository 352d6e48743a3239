"""The weight group sets NCCL's error handling in the environment only around its own process
group's construction, under the one lock every process group construction here takes: the
learner's training group (`RankGroup.join`) is not built while the variable is set.

A real gloo group of one rank, joined through a real rendezvous on a free loopback port.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

from services.learner.distributed import RankGroup
from services.weights.collective import (
    NCCL_ABORT_AND_RAISE,
    NCCL_ERROR_HANDLING,
    process_group_construction,
)
from tests.services.learner.ranks import free_port

WAIT_S = 60.0
# How long a join held by the lock is watched not completing: a gloo group of one rank joins in
# milliseconds, so one that has not after this is waiting (a negative check can only be bounded).
NOT_YET_S = 1.0
ABORT = {NCCL_ERROR_HANDLING: NCCL_ABORT_AND_RAISE}


def test_the_variable_is_set_inside_and_unset_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    with process_group_construction(ABORT):
        assert os.environ[NCCL_ERROR_HANDLING] == NCCL_ABORT_AND_RAISE
    assert NCCL_ERROR_HANDLING not in os.environ


def test_a_value_set_before_is_restored_after_also_when_construction_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "3")
    with process_group_construction(ABORT):
        assert os.environ[NCCL_ERROR_HANDLING] == NCCL_ABORT_AND_RAISE
    assert os.environ[NCCL_ERROR_HANDLING] == "3"
    with (
        pytest.raises(RuntimeError, match="construction failed"),
        process_group_construction(ABORT),
    ):
        raise RuntimeError("construction failed")
    assert os.environ[NCCL_ERROR_HANDLING] == "3"


def test_a_training_group_joins_only_once_the_weight_group_s_construction_ended() -> None:
    holding, release, joined = threading.Event(), threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def construct_weight_group() -> None:
        with process_group_construction(ABORT):
            holding.set()
            release.wait(WAIT_S)

    def join() -> None:
        try:
            RankGroup(0, 1).join(f"tcp://127.0.0.1:{free_port()}", torch.device("cpu"), WAIT_S)
            joined.set()
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    holder = threading.Thread(target=construct_weight_group, daemon=True)
    joiner = threading.Thread(target=join, daemon=True)
    holder.start()
    try:
        assert holding.wait(WAIT_S)
        joiner.start()
        assert not joined.wait(NOT_YET_S), "joined while the weight group was being built"
        assert not dist.is_initialized()
        release.set()
        assert joined.wait(WAIT_S), failures
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    finally:
        release.set()
        holder.join(WAIT_S)
        joiner.join(WAIT_S)
        RankGroup(0, 1).leave()
    assert not failures
