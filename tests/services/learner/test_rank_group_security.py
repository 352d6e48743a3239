"""The learner group's rendezvous and collectives give a stranger nothing to execute: `gather`
moves its values without pickle, and a single-host group's store listens on loopback only.

Real torch.distributed ranks (gloo, forked processes: tests/services/learner/ranks.py).
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from services.learner.distributed import RankGroup
from services.weights.auth import new_key
from tests.services.learner.ranks import TIMEOUT_S, free_port, run_ranks


def rows_of(rank: int) -> list[dict[str, Tensor]]:
    """What a rank's `RatioLog.rows_on_host` gives: dicts of CPU tensors, several dtypes."""
    generator = torch.Generator().manual_seed(rank)
    return [
        {
            "log_ratio": torch.randn(2 + rank, 5, generator=generator),
            "mask": torch.rand(2 + rank, 5, generator=generator) > 0.5,
            "row": torch.arange(2 + rank),
            "advantage": torch.randn(2 + rank, generator=generator).to(torch.bfloat16),
            "minibatch": torch.full((2 + rank,), rank, dtype=torch.int64),
        }
        for _ in range(rank + 1)
    ]


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("gather unpickled what a peer sent")


def gather_without_pickle(group: RankGroup) -> list[Any]:
    """Every unpickling entry point torch's object collectives use is made to fail here."""
    pickle.loads = _refuse
    pickle.Unpickler = _refuse  # type: ignore[misc, assignment]
    dist.distributed_c10d._unpickler = _refuse  # type: ignore[attr-defined]
    return group.gather(rows_of(group.rank))


def test_gather_round_trips_every_ranks_rows_without_unpickling() -> None:
    ranks = run_ranks(gather_without_pickle, 2)
    expected = [rows_of(0), rows_of(1)]
    for gathered in ranks:
        assert len(gathered) == 2
        for got_rows, want_rows in zip(gathered, expected, strict=True):
            assert len(got_rows) == len(want_rows)
            for got, want in zip(got_rows, want_rows, strict=True):
                assert got.keys() == want.keys()
                for key, tensor in want.items():
                    assert got[key].dtype == tensor.dtype, key
                    assert torch.equal(got[key], tensor), key


def _listening_rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    group = RankGroup(rank, 2)
    group.join(f"tcp://127.0.0.1:{port}", torch.device("cpu"), TIMEOUT_S)
    try:
        if rank == 0:
            addresses = {
                str(conn.laddr.ip)
                for conn in psutil.Process().net_connections(kind="tcp")
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
            }
            torch.save(addresses, Path(out) / "listening.pt")
        group.barrier()
    finally:
        group.leave()


def test_a_single_host_rendezvous_listens_on_loopback_only() -> None:
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        mp.start_processes(
            _listening_rank, args=(port, out), nprocs=2, join=True, start_method="fork"
        )
        assert torch.load(Path(out) / "listening.pt") == {"127.0.0.1"}


def test_a_forged_gather_payload_is_refused_not_executed() -> None:
    from services.learner.distributed import decode_gathered, encode_gathered

    rows = rows_of(1)
    payload = encode_gathered(rows)
    back = decode_gathered(payload)
    assert all(torch.equal(back[0][k], v) for k, v in rows[0].items())
    # A pickle of anything is not a payload: refused before anything in it is read.
    with pytest.raises(ValueError, match="not a gathered payload"):
        decode_gathered(pickle.dumps(rows))
    # A payload whose tensors claim more bytes than it carries, or a dtype it does not know.
    with pytest.raises(ValueError, match="gathered payload"):
        decode_gathered(payload[:-4])
    forged = payload.replace(b'"float32"', b'"object!"', 1)
    with pytest.raises(ValueError, match="gathered payload"):
        decode_gathered(forged)


def _keyed_rank(rank: int, port: int, out: str, keys: list[bytes]) -> None:
    torch.set_num_threads(1)
    group = RankGroup(rank, 2)
    address = f"tcp://127.0.0.1:{port}"
    try:
        group.join(address, torch.device("cpu"), TIMEOUT_S, key=keys[rank])
        result = f"joined: {group.sum_floats([1.0], torch.device('cpu'))}"
        group.leave()
    except RuntimeError as error:
        result = str(error)
    torch.save(result, Path(out) / f"rank-{rank}.pt")


def keyed_join(keys: list[bytes]) -> list[str]:
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        mp.start_processes(
            _keyed_rank, args=(port, out, keys), nprocs=2, join=True, start_method="fork"
        )
        return [torch.load(Path(out) / f"rank-{rank}.pt") for rank in range(2)]


def test_ranks_that_hold_the_groups_key_join_and_a_stranger_is_refused() -> None:
    key = new_key()
    assert keyed_join([key, key]) == ["joined: [2.0]", "joined: [2.0]"]
    # Rank 1's place taken by a process that was not handed the key (it guessed one).
    # Each side refuses the other: the group does not form (rank 1 sees rank 0 as the one
    # without its key).
    refused = keyed_join([key, new_key()])
    assert "learner group at tcp://127.0.0.1:" in refused[0]
    assert "ranks [1] do not hold the group's key" in refused[0]
    assert "ranks [0] do not hold the group's key" in refused[1]


def test_gather_encodes_json_values_and_tensors_of_any_shape() -> None:
    from services.learner.distributed import decode_gathered, encode_gathered

    item = {
        "values": [1, 2.5, None, True, "text"],
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "nested": [{"mask": torch.tensor([True, False])}, (torch.arange(3, dtype=torch.int8),)],
    }
    back = decode_gathered(encode_gathered(item))
    assert back["values"] == [1, 2.5, None, True, "text"]
    assert back["scalar"].dtype == torch.float64 and float(back["scalar"]) == 3.25
    assert back["empty"].shape == (0, 4) and back["empty"].dtype == torch.bfloat16
    assert torch.equal(back["nested"][0]["mask"], torch.tensor([True, False]))
    assert torch.equal(back["nested"][1][0], torch.arange(3, dtype=torch.int8))
    with pytest.raises(TypeError, match="not set"):
        encode_gathered({"a": {1, 2}})
