"""The weight-sync benchmark end to end at a tiny size (a real Ray instance, both transports).

The benchmark itself fails unless every worker ends with the learner's weights, bitwise; here
the figures' structure and the bytes that must be exact are checked.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import bench_weight_sync

# fmt: off
TINY_FLAGS = [
    "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
    "--vocab", "1000", "--bucket-mb", "1", "--repeats", "1", "--timeout-s", "300",
    "--idle-steps", "3",
]
# fmt: on


def test_both_transports_deliver_and_are_measured(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = bench_weight_sync.main([*TINY_FLAGS, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(returned))
    (shape,) = returned["shapes"]
    object_store, collective = shape["transports"]
    assert (object_store["transport"], collective["transport"]) == ("object_store", "collective")
    for result in (object_store, collective):
        assert math.isfinite(result["seconds"]) and result["seconds"] > 0
        assert result["learner_extra_peak_bytes"] >= 0
        assert result["receiver_extra_peak_bytes"] >= 0
    assert object_store["vs_object_store"]["seconds"] == 1.0
    # Delta against dense (each checked bit for bit inside): the demo's float32 publish moves
    # nearly every word and stays whole; bf16 at 1e-6 sends a small part of the bytes.
    demo, small, large = returned["delta"]
    assert [case["lr"] for case in (small, large)] == [1e-6, 1e-5]
    assert demo["object_store_delta"]["changed"] > 0.5
    for transport in ("object_store", "collective"):
        assert small[f"{transport}_delta"]["bytes"] < small[f"{transport}_dense"]["bytes"] / 4
        assert demo[f"{transport}_delta"]["bytes"] >= demo[f"{transport}_dense"]["bytes"] * 0.9
    assert math.isfinite(collective["vs_object_store"]["seconds"])
    # A new worker's whole copy, from the learner's node and from a peer's on its own (two
    # nodes of a Ray cluster), of the small model's bf16 publish: every byte, digests checked.
    peer = returned["peer_copy"]
    assert peer["bytes"] == 2 * shape["model"]["params"]
    assert peer["learner_seconds"] > 0 and peer["peer_seconds"] > 0
    assert "from a peer on its node" in printed.getvalue()
    # bfloat16, the tied head sent once: exactly two bytes a parameter went into the store.
    assert object_store["object_store_bytes"] == shape["model"]["publish_bytes"]
    assert shape["model"]["publish_bytes"] == 2 * shape["model"]["params"]
    assert collective["object_store_bytes"] == 0 and collective["group_setup_seconds"] > 0
    report = printed.getvalue()
    assert "object_store" in report and "collective" in report and "vs obj" in report
    # The learner's idle time per transport, sequential then overlapped, from its own records
    # of the steps after the first (the benchmark fails unless the workers hold the last
    # publish bitwise).
    measured = [(result["transport"], result["overlap"]) for result in shape["idle"]]
    assert measured == [
        ("object_store", False), ("object_store", True), ("collective", False), ("collective", True)
    ]  # fmt: skip
    for result in shape["idle"]:
        assert len(result["idle_seconds"]) == 2 and all(s >= 0 for s in result["idle_seconds"])
        assert result["seconds_per_step"] > 0
        assert result["vs_sequential"]["idle_seconds_mean"] == 1.0 or result["overlap"]
    assert "learner idle s/step" in report
