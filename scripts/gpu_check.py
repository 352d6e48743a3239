"""The pipeline part of the GPU check (scripts/gpu_check.sh): a short real run on one GPU, timed.

1. Builds a random-initialised Qwen2 model of about 0.5B parameters (Qwen2.5-0.5B's decoder
   layer, 32 of them, with the tiny model's tokenizer and vocabulary; nothing is downloaded) and
   saves it in bfloat16.
2. Runs `kpo run scripts/gpu_check.yaml --set model=<it>`: 3 learner steps on CUDA, vLLM
   generation with in-flight weight updates (`pipeline.weight_transport: collective`: with the
   learner and the engine sharing the one GPU, which NCCL refuses, it hands buckets over as CUDA
   IPC handles).
3. Prints the time of each stage (the build, the start-up to the first learner step, each step,
   the end of the run with its final checkpoint) and every timing the run recorded per step
   (`*_seconds`, `*_per_s` keys of metrics.jsonl), and the GPU memory in use at its peak.

Hugging Face, vLLM and Ray run offline and without usage reports. The whole check has a deadline
(`--deadline-s`, default 480); a stage that would pass it is stopped and named. Exit status: 0
when the run succeeded with every step recorded, 1 otherwise.

    python scripts/gpu_check.py [--out DIR] [--deadline-s 480]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Run from a checkout without installing the package: make the repository root importable.
sys.path.insert(0, str(REPO))

from services.pipeline.specs import SpecError, load_run_spec, preflight  # noqa: E402
from services.spec import RunSpec  # noqa: E402

SPEC = REPO / "scripts" / "gpu_check.yaml"
TINY_MODEL = REPO / "services" / "tasks" / "assets" / "tiny-arith"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Qwen2.5-0.5B's decoder layer (hidden 896, 14 heads over 2 KV heads, MLP 4864, biased QKV),
# 32 layers instead of 24 so that, without its 151,936-token embedding, the model still has about
# 0.5B parameters. The vocabulary is the tiny model's tokenizer's: every sampled id decodes.
SHAPE: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 32,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
}
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}
TIMING_SUFFIXES = ("_seconds", "_per_s")


class DeadlineExceeded(RuntimeError):
    """A stage of the check would have run past the check's deadline."""


@dataclass
class Clock:
    """The check's deadline and the seconds each finished stage took."""

    deadline_s: float
    started: float = field(default_factory=time.monotonic)
    stages: list[tuple[str, float]] = field(default_factory=list)

    def left(self, stage: str) -> float:
        left = self.deadline_s - (time.monotonic() - self.started)
        if left <= 0:
            raise DeadlineExceeded(f"no time left for {stage} ({self.deadline_s:.0f} s deadline)")
        return left

    def record(self, stage: str, seconds: float) -> None:
        self.stages.append((stage, seconds))
        print(f"gpu_check: {stage}: {seconds:.1f} s", flush=True)


def model_config(vocab_size: int, **overrides: Any) -> Any:
    """The check's Qwen2 config for a tokenizer of `vocab_size` tokens (`overrides` replace
    keys of SHAPE, for a smaller model built by the same code)."""
    from transformers import Qwen2Config

    tiny = json.loads((TINY_MODEL / "config.json").read_text(encoding="utf-8"))
    special = {key: tiny[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return Qwen2Config(vocab_size=vocab_size, **{**SHAPE, **overrides}, **special)


def count_parameters(config: Any) -> int:
    """Parameters of a model of `config` (tied tensors once), without allocating its weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return sum(p.numel() for p in model.parameters())


def build_model(out_dir: Path, config: Any, seed: int = 0) -> int:
    """A random-initialised model of `config` with the tiny model's tokenizer, saved to
    `out_dir` in bfloat16 (what the learner computes in and publishes); its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_MODEL / name, out_dir / name)
    return sum(p.numel() for p in model.parameters())


def tokenizer_vocab_size() -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(TINY_MODEL)))


class GpuMemoryPeak:
    """The most GPU memory in use (MiB, all processes, from nvidia-smi) while it runs; a
    measurement taken every `every_s`, not a synchronisation."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.peak_mib: int | None = None
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> GpuMemoryPeak:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            result = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                check=False,
            )
            values = [int(v) for v in result.stdout.split() if v.isdigit()]
            if values:
                self.peak_mib = max(self.peak_mib or 0, max(values))
            self._stop.wait(self._every_s)


def model_override(model_dir: Path) -> str:
    """The `--set` that points the check's spec at the model it built."""
    return f"model={model_dir}"


def load_spec(model_dir: Path) -> RunSpec:
    """The check's spec on `model_dir`, validated as `kpo run` validates it (a SpecError names
    the key otherwise); `preflight` then checks the model directory once it exists."""
    return load_run_spec(SPEC, [model_override(model_dir)])


def run_command(model_dir: Path, run_dir: Path) -> list[str]:
    """`kpo run` of the check's spec on `model_dir`, into `run_dir`."""
    return [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        str(SPEC),
        "--set",
        model_override(model_dir),
        "--out",
        str(run_dir),
    ]


def run_pipeline(model_dir: Path, run_dir: Path, timeout_s: float) -> tuple[int, float]:
    """Run the check's spec, its output streamed with the seconds since it started; (exit
    status, epoch time it started)."""
    env = {**os.environ, **OFFLINE_ENV}
    env.pop("RAY_ADDRESS", None)  # a local Ray instance on this machine, never a cluster
    launched = time.time()
    start = time.monotonic()
    # A session of its own, so that at the deadline the run goes with everything it started
    # (Ray's processes, the engine's), and no process is left holding the GPU or the pipe.
    process = subprocess.Popen(
        run_command(model_dir, run_dir),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout_s, os.killpg, (process.pid, signal.SIGKILL))
    timer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            print(f"[{time.monotonic() - start:6.1f} s] {line}", end="", flush=True)
        status = process.wait()
    finally:
        timer.cancel()
    if status == -signal.SIGKILL and time.monotonic() - start >= timeout_s:
        raise DeadlineExceeded(f"kpo run did not finish within {timeout_s:.0f} s")
    return status, launched


def step_timings(records: Sequence[dict[str, Any]], launched: float) -> list[dict[str, float]]:
    """Per learner step: the seconds since the run started and since the previous step, and
    every timing the run recorded (keys ending in _seconds or _per_s)."""
    rows = []
    previous = launched
    for record in records:
        row = {"step": float(record["step"]), "since_start_s": record["time"] - launched}
        row["since_previous_s"] = record["time"] - previous
        previous = record["time"]
        for key, value in record.items():
            if key.endswith(TIMING_SUFFIXES) and isinstance(value, int | float):
                row[key] = float(value)
        rows.append(row)
    return rows


def print_step_table(rows: Sequence[dict[str, float]]) -> None:
    keys = sorted({key for row in rows for key in row} - {"step"})
    print("gpu_check: per learner step (seconds unless per_s):")
    for key in keys:
        values = "  ".join(f"{row[key]:10.3f}" if key in row else f"{'-':>10}" for row in rows)
        print(f"  {key:36s} {values}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="working directory (default: a new temporary)")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="the whole check's limit")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kpo-gpu-check-"))
    model_dir, run_dir = out / "model", out / "run"
    clock = Clock(args.deadline_s)
    from services.pipeline.launch import ERROR_FILE
    from services.pipeline.outputs import read_metrics

    try:
        spec = load_spec(model_dir)  # a typo in the spec fails here, before the build
        started = time.monotonic()
        parameters = build_model(model_dir, model_config(tokenizer_vocab_size()))
        preflight(spec, str(SPEC))
        clock.record(
            f"build a random {parameters / 1e9:.2f}B-parameter Qwen2 model",
            time.monotonic() - started,
        )
        with GpuMemoryPeak() as memory:
            started = time.monotonic()
            status, launched = run_pipeline(model_dir, run_dir, clock.left("kpo run"))
            total = time.monotonic() - started
    except (DeadlineExceeded, SpecError) as error:
        print(f"gpu_check: FAILED: {error}", file=sys.stderr)
        return 1
    rows = step_timings(read_metrics(run_dir), launched)
    if rows:
        clock.record("kpo run: start-up to the first learner step", rows[0]["since_start_s"])
        for row in rows[1:]:
            clock.record(f"kpo run: learner step {row['step']:.0f}", row["since_previous_s"])
        clock.record(
            "kpo run: after the last step (final checkpoint, shutdown)",
            total - rows[-1]["since_start_s"],
        )
        print_step_table(rows)
    clock.record("kpo run in all", total)
    if memory.peak_mib is not None:
        print(f"gpu_check: GPU memory in use at its peak: {memory.peak_mib / 1024:.1f} GiB")
    print(f"gpu_check: run directory {run_dir}")
    if status != 0 or len(rows) < spec.pipeline.steps:
        print(
            f"gpu_check: FAILED: kpo run exited {status} with {len(rows)} of "
            f"{spec.pipeline.steps} steps recorded (see {run_dir / ERROR_FILE} and the log above)",
            file=sys.stderr,
        )
        return 1
    print(f"gpu_check: pipeline check passed in {time.monotonic() - clock.started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
