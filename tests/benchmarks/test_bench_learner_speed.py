"""The learner speed benchmark's arithmetic and its GPU run's decisions, on CPU (the GPU run
itself needs a GPU: scripts/gpu_check.sh).

Model FLOPs are worked out by hand for a small shape and checked against the issue's figures for
Qwen2.5-0.5B (1.45 s for 64 x 1,152 tokens was 16% of 989 TFLOP/s); the long-tailed lengths
keep their range and mean; the groups carry a learning signal in every group. What keeps a GPU
run going is driven here through the functions that decide it: the memory sizing, the lowering
of the plain step's micro-batches on torch.cuda.OutOfMemoryError (constructed on CPU), the time
budget, and the JSON rewritten after every case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_learner_speed as speed
import pytest
import torch
from bench_learner import QWEN25_05B, ModelShape, param_counts
from bench_learner_speed import (
    GROUP_SIZE,
    H100_BF16_DENSE_FLOPS,
    Case,
    CaseOutcome,
    GpuRun,
    Measured,
    RunLog,
    Timed,
    case_groups,
    case_status,
    estimate_case_seconds,
    estimate_save_seconds,
    fit_plain,
    gpu_cases,
    guarded,
    long_tailed_lengths,
    lowered,
    matmul_params,
    memory_skip_reason,
    model_flops,
    print_gpu_report,
    projected_plain,
    run_cases,
    skip_reason,
    static_bytes,
    summarise,
    variant_record,
)

GiB = 2**30
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SMALL = ModelShape("small", hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10,
                   tied=True)  # fmt: skip
CASES = gpu_cases(0)
PARAMS_15B = param_counts(CASES["b"].shape).total  # 1,543,714,304


def test_model_flops_worked_out_by_hand() -> None:
    # head_dim 4: q, o 8 x 8 each; k, v 8 x 4 each; MLP 3 x 8 x 16; head 10 x 8.
    per_layer = 64 + 64 + 32 + 32 + 384
    assert matmul_params(SMALL) == 2 * per_layer + 80
    # Rows of 3 and 5 tokens: 6 P tokens + 6 L (heads x head_dim) sum(L^2).
    assert model_flops(SMALL, [3, 5]) == 6 * 1232 * 8 + 6 * 2 * 8 * (9 + 25)


def test_the_half_billion_case_gives_the_mfu_measured_before() -> None:
    case = CASES["a"]
    assert case.shape == QWEN25_05B and case.real_tokens == 64 * 1152
    assert case.flops == model_flops(case.shape, [1152] * 64)
    mfu = case.flops / 1.45 / H100_BF16_DENSE_FLOPS
    assert 0.15 < mfu < 0.17


def test_long_tailed_lengths_span_the_range_with_the_mean_asked_for() -> None:
    lengths = long_tailed_lengths(64, 128, 4096, 1091.0, seed=0)
    assert len(lengths) == 64 and min(lengths) >= 128 and max(lengths) == 4096
    assert abs(statistics.mean(lengths) - 1091) < 5
    assert statistics.median(lengths) < 900  # long-tailed: most rows are short
    assert long_tailed_lengths(64, 128, 4096, 1091.0, seed=0) == lengths
    assert long_tailed_lengths(64, 128, 4096, 1091.0, seed=1) != lengths


def test_every_group_of_a_case_has_both_rewards() -> None:
    case = CASES["c"]
    groups = case_groups(case, seed=0)
    assert [len(g.responses) for g in groups] == [GROUP_SIZE] * (64 // GROUP_SIZE)
    lengths = [len(r.response.response_token_ids) for g in groups for r in g.responses]
    assert lengths == list(case.responses)
    assert all({r.reward for r in g.responses} == {0.0, 1.0} for g in groups)


# --- Sizing to the GPU's memory -----------------------------------------------------------------


def test_a_case_is_skipped_only_where_its_static_memory_is_over_nine_tenths() -> None:
    assert static_bytes(1) == 18  # fp32 weights, grads, two AdamW moments; bf16 copies
    assert memory_skip_reason(PARAMS_15B, 79 * GiB) is None  # 25.9 GiB
    reason = memory_skip_reason(PARAMS_15B, 20 * GiB)
    assert reason is not None and "25.9 GiB" in reason and "90% of 20.0 GiB" in reason
    edge = static_bytes(PARAMS_15B) / 0.9
    assert memory_skip_reason(PARAMS_15B, edge) is None
    assert memory_skip_reason(PARAMS_15B, edge - 1024) is not None


def test_lowering_takes_one_widest_row_off_a_micro_batch_at_a_time() -> None:
    b = CASES["b"]  # rows of 128 + 4,096: 3 fit in 16,384 tokens
    assert (b.row_width, b.rows_per_micro_batch) == (4224, 3)
    two = lowered(b)
    assert two is not None and (two.micro_batch_tokens, two.rows_per_micro_batch) == (8448, 2)
    one = lowered(two)
    assert one is not None and (one.micro_batch_tokens, one.rows_per_micro_batch) == (4224, 1)
    assert lowered(one) is None
    a = lowered(CASES["a"])  # 14 rows of 1,152
    assert a is not None and a.micro_batch_tokens == 13 * 1152
    c = CASES["c"]  # long-tailed: its widest row decides
    assert c.row_width == 128 + 4096 and c.rows_per_micro_batch == 3


def out_of_memory_above(
    limit: int, tries: list[int], held: list[weakref.ref[object]]
) -> Callable[[Case], Callable[[], object]]:
    """A step factory: each step holds an object (standing for the model) and raises
    torch.cuda.OutOfMemoryError when its case's micro_batch_tokens are above `limit`."""

    def make(case: Case) -> Callable[[], object]:
        tries.append(case.micro_batch_tokens)
        model = torch.zeros(4)
        held.append(weakref.ref(model))

        def step() -> object:
            if case.micro_batch_tokens > limit:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            return model

        return step

    return make


def test_the_plain_step_is_lowered_until_its_first_step_fits() -> None:
    tries: list[int] = []
    held: list[weakref.ref[object]] = []
    freed: list[bool] = []

    def free() -> None:  # what was built for the failed try is gone before the memory is freed
        freed.append(all(ref() is None for ref in held))

    fitted, step = fit_plain(CASES["b"], out_of_memory_above(9000, tries, held), free)
    assert tries == [16_384, 8448]
    assert fitted.micro_batch_tokens == 8448 and step is not None
    assert freed == [True]
    assert held[-1]() is not None  # the step that fits keeps its model


def test_the_status_says_where_the_plain_step_was_lowered() -> None:
    b, two, one = CASES["b"], lowered(CASES["b"]), lowered(lowered(CASES["b"]) or CASES["b"])
    assert two is not None and one is not None
    assert case_status(b, b, True, 79 * GiB) == {"status": "done", "micro_batch_tokens": 16_384}
    assert case_status(b, two, True, 79 * GiB) == {
        "status": "done", "micro_batch_tokens": 8448,
        "note": "micro_batch_tokens lowered from 16,384 to 8,448: the plain step did not fit "
                "in 79.0 GiB",
    }  # fmt: skip
    # Not even one row fitted: ours still runs, at the case's own settings.
    gave_up = case_status(b, one, False, 79 * GiB)
    assert gave_up["micro_batch_tokens"] == 16_384
    assert gave_up["note"].endswith("at one row per micro-batch either; ours ran at 16,384")


def test_the_plain_step_gives_up_after_one_row_per_micro_batch_fails() -> None:
    tries: list[int] = []
    held: list[weakref.ref[object]] = []
    frees: list[int] = []
    fitted, step = fit_plain(CASES["b"], out_of_memory_above(1000, tries, held),
                             lambda: frees.append(1))  # fmt: skip
    assert step is None and tries == [16_384, 8448, 4224]
    assert fitted.micro_batch_tokens == 4224 and len(frees) == 3


def test_a_step_that_fits_is_not_lowered() -> None:
    tries: list[int] = []
    fitted, step = fit_plain(CASES["a"], out_of_memory_above(10**9, tries, []), lambda: None)
    assert fitted == CASES["a"] and step is not None and tries == [16_384]


def test_only_out_of_memory_is_caught() -> None:
    def oom() -> int:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    def broken() -> int:
        raise RuntimeError("a real failure")

    assert guarded(oom) is None
    assert guarded(lambda: 3) == 3
    with pytest.raises(RuntimeError, match="a real failure"):
        guarded(broken)


def test_a_variant_out_of_memory_is_recorded_with_the_memory() -> None:
    record = variant_record(CASES["b"], "plain", None, H100_BF16_DENSE_FLOPS, 79.5 * GiB)
    assert record == {"case": "b", "name": CASES["b"].name, "variant": "plain",
                      "micro_batch_tokens": 16_384, "error": "out of memory",
                      "memory_gib": 79.5}  # fmt: skip


def test_the_measured_peak_of_case_b_projects_a_lowering_on_an_h100() -> None:
    static = static_bytes(PARAMS_15B)
    per_row = (81.1 * GiB - static) / 3
    on_h100 = projected_plain(CASES["b"], PARAMS_15B, 79 * GiB)
    assert on_h100 is not None
    assert on_h100[0].micro_batch_tokens == 8448
    assert on_h100[1] == pytest.approx(static + 2 * per_row)
    on_h200 = projected_plain(CASES["b"], PARAMS_15B, 139 * GiB)
    assert on_h200 is not None and on_h200[0] == CASES["b"]
    assert on_h200[1] == pytest.approx(81.1 * GiB)
    assert projected_plain(CASES["a"], 494_032_768, 79 * GiB) is None  # never measured


# --- The time budget ----------------------------------------------------------------------------


def test_a_case_is_estimated_from_each_variant_of_the_cases_before() -> None:
    history = [Timed("plain", 10.0, 1e15), Timed("ours", 5.0, 1e15)]
    # 2e14 FLOPs a step x 4 steps: plain 8 s, ours 4 s, and 3 s to save the model.
    assert estimate_case_seconds(history, 2e14, 4, 3.0) == pytest.approx(15.0)
    # A variant without figures (it ran out of memory) goes at the pooled rate.
    only_ours = [Timed("ours", 5.0, 1e15)]
    assert estimate_case_seconds(only_ours, 2e14, 4, 0.0) == pytest.approx(8.0)
    assert estimate_case_seconds([], 2e14, 4, 3.0) is None
    assert estimate_save_seconds([(4.0, 500), (2.0, 1500)], 1000) == pytest.approx(3.0)
    assert estimate_save_seconds([], 1000) == 0.0


def test_a_case_is_skipped_for_memory_first_then_for_the_budget() -> None:
    assert skip_reason(PARAMS_15B, 79 * GiB, 100.0, 120.0) is None
    assert skip_reason(PARAMS_15B, 79 * GiB, 130.0, 120.0) == "budget: needs ~130 s, 120 s left"
    assert skip_reason(PARAMS_15B, 79 * GiB, 130.0, -5.0) == "budget: needs ~130 s, 0 s left"
    assert skip_reason(PARAMS_15B, 79 * GiB, 130.0, None) is None  # no budget
    assert skip_reason(PARAMS_15B, 79 * GiB, None, 1.0) is None  # the first case: no estimate
    reason = skip_reason(PARAMS_15B, 20 * GiB, 130.0, 120.0)
    assert reason is not None and reason.startswith("memory:")


def test_the_run_decides_from_the_cases_it_ran(tmp_path: Path) -> None:
    args = argparse.Namespace(budget_s=1e9, seed=0)
    run = GpuRun(args, CASES, 79 * GiB, tmp_path, warmup=1, steps=2)
    args.budget_s = 1.0  # long spent: the process started more than a second ago
    assert run.decide("a") is None  # nothing run yet, nothing to estimate from
    run.history = [Timed("plain", 30.0, CASES["a"].flops * 4), Timed("ours", 20.0, 1e15)]
    reason = run.decide("c")
    assert reason is not None and reason.startswith("budget: needs ~") and "0 s left" in reason
    args.budget_s = 1e9
    assert run.decide("c") is None
    assert run.decide("b") is None
    small = GpuRun(args, CASES, 20 * GiB, tmp_path, warmup=1, steps=2)
    reason = small.decide("b")
    assert reason is not None and reason.startswith("memory:")


def test_the_budget_counts_from_the_process_start_not_from_the_imports() -> None:
    code = ("import time; t0 = time.monotonic(); import bench_learner_speed as b; "
            "print(b.process_seconds(), time.monotonic() - t0)")  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "PYTHONPATH": str(BENCHMARKS)},
    )  # fmt: skip
    wall = time.monotonic() - start
    since_start, importing = map(float, result.stdout.split())
    assert importing <= since_start <= wall


# --- The JSON after every case, and the report --------------------------------------------------


def measured(seconds: float) -> Measured:
    return Measured([seconds, seconds], int(30 * GiB), {"tolist": 2}, 1)


def outcome(key: str, plain_s: float, ours_s: float) -> CaseOutcome:
    case = CASES[key]
    plain = summarise(case, "plain", measured(plain_s), H100_BF16_DENSE_FLOPS)
    ours = summarise(case, "ours", measured(ours_s), H100_BF16_DENSE_FLOPS)
    ours["vs_plain_time"] = ours_s / plain_s
    return CaseOutcome([plain, ours], {"status": "done", "micro_batch_tokens": 16_384}, [])


def on_disk(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_a_case_that_fails_leaves_the_figures_of_those_before_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "out" / "speed.json"
    log = RunLog(path, {"memory_gib": 79.0}, {key: {"status": "pending"} for key in "abc"})
    seen_before_c: list[dict[str, Any]] = []

    def run_one(key: str) -> CaseOutcome:
        if key == "c":
            seen_before_c.append(on_disk(path))
            raise RuntimeError("CUDA error: an illegal memory access")
        return outcome(key, 2.0, 1.0)

    def decide(key: str) -> str | None:
        return "budget: needs ~90 s, 10 s left" if key == "b" else None

    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_cases(["a", "b", "c"], decide, run_one, log)
    [before_c] = seen_before_c
    assert before_c["cases"]["c"] == {"status": "running"}
    assert [r["variant"] for r in before_c["records"]] == ["plain", "ours"]
    data = on_disk(path)
    assert data["complete"] is False and data["settings"] == {"memory_gib": 79.0}
    assert [(r["case"], r["variant"]) for r in data["records"]] == [("a", "plain"), ("a", "ours")]
    assert data["records"][1]["seconds"] == 1.0
    assert data["cases"] == {
        "a": {"status": "done", "micro_batch_tokens": 16_384},
        "b": {"status": "skipped", "reason": "budget: needs ~90 s, 10 s left"},
        "c": {"status": "failed", "error": "RuntimeError: CUDA error: an illegal memory access"},
    }
    assert data["skipped"] == {"b": "budget: needs ~90 s, 10 s left"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["speed.json"]  # no temporary left


def test_a_run_to_the_end_is_marked_complete(tmp_path: Path) -> None:
    path = tmp_path / "speed.json"
    log = RunLog(path, {}, {"a": {"status": "pending"}})
    run_cases(["a"], lambda key: None, lambda key: outcome(key, 2.0, 1.0), log)
    assert on_disk(path)["complete"] is False
    log.save(complete=True)
    assert on_disk(path)["complete"] is True and len(on_disk(path)["records"]) == 2


def test_the_report_names_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    settings = {"device_name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "compile": False,
                "pack_rows": "auto", "peak_flops": H100_BF16_DENSE_FLOPS}  # fmt: skip
    a, c = outcome("a", 2.0, 1.5), outcome("c", 4.0, 2.0)
    b_plain = variant_record(CASES["b"], "plain", None, H100_BF16_DENSE_FLOPS, 79.2 * GiB)
    note = "micro_batch_tokens lowered from 16,384 to 4,224: the plain step did not fit in 79.2 GiB"
    log = RunLog(None, settings, {
        "a": {"status": "done"}, "c": {"status": "done"},
        "b": {"status": "done", "note": note},
    }, [*a.records, *c.records, b_plain])  # fmt: skip
    print_gpu_report(log)
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3 (79.2 GiB)" in out
    for figure in ("s/step", "tokens/s", "MFU", "peak GiB", "host reads", "CUDA syncs"):
        assert figure in out
    assert "1.00x (baseline)" in out and "0.75x" in out and "0.50x" in out
    assert "out of memory" in out and f"case b: done: {note}" in out
    # c's real tokens per second against a's: (real_c / 2.0) / (real_a / 1.5)
    rate = CASES["c"].real_tokens / 2.0 / (CASES["a"].real_tokens / 1.5)
    assert f"long-tailed (c) real-token rate vs fixed-length (a): {rate:.2f}x" in out
    assert "host reads, a ours: {'tolist': 2}" in out


def test_the_report_of_a_run_that_skipped_everything(capsys: pytest.CaptureFixture[str]) -> None:
    settings = {"device_name": "GPU", "memory_gib": 10.0, "compile": False, "pack_rows": "auto",
                "peak_flops": H100_BF16_DENSE_FLOPS}  # fmt: skip
    log = RunLog(None, settings, {"b": {"status": "skipped", "reason": "memory: too large"}})
    print_gpu_report(log)
    assert "case b: skipped: memory: too large" in capsys.readouterr().out


def test_the_flags_keep_the_cases_in_the_order_given() -> None:
    args = speed.parse_args(["--cases", "a,c,b,a", "--budget-s", "240", "--memory-gib", "79"])
    assert args.cases == ["a", "c", "b"] and args.budget_s == 240 and args.memory_gib == 79
    with pytest.raises(SystemExit):
        speed.parse_args(["--device", "cpu", "--dry-run"])
    with pytest.raises(SystemExit):
        speed.parse_args(["--warmup", "0"])  # the plain step's first step is a warm-up one


# --- The CPU run ----------------------------------------------------------------------------------


def test_the_cpu_run_reports_the_heads_and_the_host_reads_in_one_run(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    flags = ["--device", "cpu", "--positions", "24", "--hidden", "32", "--vocab", "500",
             "--chunk", "8", "--vocab-chunk", "128", "--repeats", "1", "--rounds", "1",
             "--threads", "1", "--json", str(out)]  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_learner_speed.py"), *flags],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Log-prob head, forward + backward: 24 positions" in result.stdout
    assert "Host reads of one train_step" in result.stdout
    data = on_disk(out)
    heads = {h["path"]: h for h in data["heads"]}
    assert list(heads) == list(speed.PATHS)  # plain, the fused heads, the old ones
    assert heads["plain"]["vs_plain_time"] == 1.0 and heads["plain"]["products"] == 3.0
    for path in ("fused", "fused+entropy"):
        fused = heads[path]
        assert fused["products"] == pytest.approx(4.0) and fused["goals"]["products"] is True
        assert set(fused["goals"]) == {"time", "peak", "bytes", "products"}
        assert fused["vs_plain_bytes"] <= 1.2  # counted, so the same on any machine
    for head in heads.values():
        assert "logp" not in head and head["logp_gap"] < 1e-5  # same values as the plain head
        assert head["grad_gap"] < 1e-5 and head["grad_hidden_gap"] < 1e-5
    assert [s["micro_batches"] for s in data["steps"]] == [1, 8]
