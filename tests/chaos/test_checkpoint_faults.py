"""A run killed outright (SIGKILL of the whole process group), its newest checkpoint then
corrupted, and a leftover of an interrupted checkpoint write: `kpo resume` must skip both, say
so, and go on from the newest intact checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from services.pipeline.checkpoints import LEARNER_DIR, list_checkpoints
from services.pipeline.outputs import read_metrics
from tests.chaos.runs import KpoRun, assert_ledger_balances, kpo, status_of, steps_in

pytestmark = pytest.mark.timeout(600)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "group", [(), ("learner.strategy=fsdp2", "learner.world_size=2")], ids=["single", "fsdp2"]
)
def test_resume_skips_a_corrupt_checkpoint_and_falls_back_to_the_previous(
    tmp_path: Path, group: tuple[str, ...]
) -> None:
    with KpoRun(tmp_path, "pipeline.steps=12", "pipeline.checkpoint_every=2", *group) as run:
        run.wait_for_steps(5)
        os.killpg(run.process.pid, signal.SIGKILL)
        run.finish()
    # Two checkpoints are kept: those of steps 2 and 4, or later ones if steps went on before
    # the kill landed.
    (previous, _), (_, newest) = list_checkpoints(run.out / "checkpoints")
    assert previous >= 2 and steps_in(run.out)[-1] < 12
    weights = max((newest / LEARNER_DIR).rglob("*"), key=lambda p: p.stat().st_size)
    flip_a_byte(weights)
    leftover = run.out / "checkpoints" / ".tmp-step-000099-1"
    leftover.mkdir()
    (leftover / "driver_state.json").write_text("{")

    resumed = subprocess.run(
        kpo("resume", str(run.out)), capture_output=True, text=True, timeout=400, check=False
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert f"skipping checkpoint {newest}" in output and "SHA-256" in output
    assert status_of(run.out)["resumed_from"] == previous
    records = read_metrics(run.out)
    assert steps_in(run.out) == list(range(1, 13))
    assert [r["policy_version"] for r in records] == list(range(1, 13))
    assert not leftover.exists()  # pruned with the other leftovers
    assert_ledger_balances(run.out, batch_groups=4)
