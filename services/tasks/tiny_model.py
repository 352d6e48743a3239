"""Build the tiny warm-started arithmetic models that demos and tests run RL on.

Two built-in models, one per built-in task (`services.tasks.registry.BUILTIN_MODEL_TASKS`):
`tiny-arith`, warm-started on `arith`'s worked solutions, and `tiny-arith-tool`, warm-started on
`arith-tool` with a mix of demonstrations, some calling the Python tool and some answering
directly, so that calls are in its repertoire but not yet reliable (its accuracy is measured
with the calls executed: `services.tasks.tool_eval`). Every evaluation of the warm start samples
through the `hf` generation backend, as RL runs do (`services.tasks.sampling_eval`).

The result is an ordinary Hugging Face model directory (Qwen2 architecture, safetensors weights,
`tokenizer.json`), loaded with `from_pretrained` exactly like a user's own model, and small
enough to commit. The build is reproducible: the same seed gives bit-identical weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from services.generation.hf_backend import HFBackend
from services.messages import Prompt
from services.tasks import arith, arith_tool
from services.tasks.demonstration import Demonstration
from services.tasks.registry import BUILTIN_MODEL_TASKS, get_task
from services.tasks.sampling_eval import sampled_accuracy
from services.tasks.tokenizer import build_tokenizer, save_tokenizer
from services.tasks.tool_eval import ArithmeticRunner, evaluate_with_tool
from services.tasks.warmstart import EvalPoint, Evaluation, WarmStartSettings, warm_start
from services.tools.config import ToolsConfig

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL_DIR = ASSETS / "tiny-arith"
TOOL_MODEL_DIR = ASSETS / "tiny-arith-tool"
DEFAULT_MODEL = "tiny-arith"
BUILD_INFO = "build_info.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Sampling seed of every evaluation: the same draws each time, so successive evaluations differ
# only through the weights.
EVAL_SAMPLING_SEED = 1234
EVAL_MARGIN_TOKENS = 16  # room beyond the longest reference before a sample counts as too long


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture. Head dimension 32 and standard Qwen2 layers keep it servable by vLLM."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 512


@dataclass(frozen=True)
class BuildSettings:
    """Everything besides the seed that decides the built weights."""

    difficulty: int = arith.DEFAULT_DIFFICULTY  # of the eval prompts (and arith's training)
    eval_size: int = 128
    # A fixed count, not the machine's core count: in our checks 1 and 2 threads give
    # bit-identical weights but 4 do not.
    threads: int = 2
    spec: TinyModelSpec = field(default_factory=TinyModelSpec)
    warm_start: WarmStartSettings = field(default_factory=WarmStartSettings)
    task: str = arith.TASK_NAME
    # arith-tool only: training difficulties (drawn uniformly; None: `difficulty` alone), the
    # fraction of demonstrations that call the tool (the others answer directly), and model
    # turns per sampled response.
    train_difficulties: tuple[int, int] | None = None
    tool_fraction: float = 0.5
    max_turns: int = 3


# arith-tool's warm start. Copying the operands into the call and the printed result into the
# answer is learnt in a sudden transition (around step 600-900 in our builds, at the peak rate
# held longer than arith's); direct answers to long operations are targets no model of this size
# fits, so the loss levels off above arith's, and evaluations start below 0.35. One training
# difficulty (fixed-length prompts) learns the copying about twice as fast as the 1..5 mix. The
# band is on the accuracy with the calls executed; its top stays well below what reliable calls
# give, and with half the responses answering directly RL has both to make the model call and to
# make its calls right.
TOOL_WARM_START = WarmStartSettings(
    decay_steps=1000,
    max_steps=1500,
    eval_every=50,
    eval_gate_loss=0.35,
    target_accuracy=0.3,
    band=(0.15, 0.6),
)


def default_settings(task: str = arith.TASK_NAME) -> BuildSettings:
    """The settings that reproduce the committed model of `task`."""
    if task == arith.TASK_NAME:
        return BuildSettings()
    if task == arith_tool.TASK_NAME:
        return BuildSettings(
            task=task, difficulty=arith_tool.DEFAULT_DIFFICULTY, warm_start=TOOL_WARM_START
        )
    get_task(task)  # ValueError naming the tasks
    raise ValueError(f"no tiny model is built for task {task!r}")


@dataclass(frozen=True)
class BuildInfo:
    """What `build_info.json` records about a build."""

    seed: int
    difficulty: int
    steps: int
    eval_accuracy: float
    eval_size: int
    in_band: bool
    band: tuple[float, float]
    build_seconds: float
    parameters: int
    threads: int
    torch_version: str
    transformers_version: str
    history: list[EvalPoint]
    task: str = arith.TASK_NAME
    # arith-tool: the other rates of the kept evaluation (call rate, accuracy without the
    # tool), and the mix of demonstrations.
    eval_details: dict[str, float] = field(default_factory=dict)
    tool_fraction: float | None = None

    def to_json(self) -> str:
        """Pretty JSON of every field (empty details and unset tool fields left out)."""
        data = asdict(self)
        for point in data["history"]:
            if not point["details"]:
                del point["details"]
        if not data["eval_details"]:
            del data["eval_details"]
        if data["tool_fraction"] is None:
            del data["tool_fraction"]
        return json.dumps(data, indent=2) + "\n"


class TinyModelBuildError(RuntimeError):
    """The warm-start ended without its sampled accuracy entering the band."""


def qwen2_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """The model config for `spec`, with the tokenizer's vocabulary and special ids."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Not a declared argument of Qwen2Config, but read by the model and written to config.json,
    # so servers need not infer it from hidden_size / num_heads.
    config.head_dim = spec.head_dim
    return config


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Run with `count` intra-op threads, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def _quiet_progress(quiet: bool) -> Iterator[None]:
    """Silence transformers' own progress bars (the weight writer's) while `quiet`."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _save(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    info: BuildInfo,
    out: Path,
    progress: bool,
) -> None:
    """Write the model directory at `out` in one rename, so no reader sees half of it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with _quiet_progress(not progress):
            model.save_pretrained(staging)
        save_tokenizer(tokenizer, staging)
        (staging / BUILD_INFO).write_text(info.to_json())
        # mkdtemp makes the folder private; the model is meant to be shared and committed.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def sampling_backend(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, tools: ToolsConfig | None
) -> HFBackend:
    """An `hf` backend holding a copy of `model` (load its weights into it before sampling),
    with `tools` enabled through an `ArithmeticRunner` when given. The global RNG is left as
    it was, so that building it changes nothing of the warm start."""
    with (
        tempfile.TemporaryDirectory() as directory,
        torch.random.fork_rng(devices=[]),
        _quiet_progress(True),
    ):
        model.save_pretrained(directory)
        save_tokenizer(tokenizer, Path(directory))
        backend = HFBackend(directory)
    if tools is not None:
        backend.enable_tools(tools, ArithmeticRunner())
    return backend


def uses_tool(prompt: Prompt, seed: int, fraction: float) -> bool:
    """Whether `prompt`'s demonstration calls the tool: a stable draw from its text and the
    build seed, true for `fraction` of prompts (whatever the order they come in)."""
    digest = hashlib.blake2b(f"{seed}|{prompt.text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def tool_demonstration(prompt: Prompt, seed: int, fraction: float) -> Demonstration:
    """arith-tool's warm-start target: the call, its observation (no loss) and the answer, or
    the direct answer (right, but out of the model's reach for long operands)."""
    if uses_tool(prompt, seed, fraction):
        return arith_tool.tool_segments(prompt)
    return arith_tool.direct_solution(prompt)


def _evaluator(
    sampler: HFBackend,
    model: Qwen2ForCausalLM,
    eval_prompts: list[Prompt],
    max_new_tokens: int,
    tools: bool,
) -> Callable[[], float | Evaluation]:
    """The warm start's evaluation: the model's current weights loaded into `sampler`, then its
    sampled accuracy on `eval_prompts` (with the tool's calls executed, for `tools`)."""
    evaluations = 0

    def evaluate() -> float | Evaluation:
        nonlocal evaluations
        evaluations += 1
        sampler.load_weights(model.state_dict(), evaluations)
        if not tools:
            return sampled_accuracy(
                sampler, eval_prompts, seed=EVAL_SAMPLING_SEED, max_new_tokens=max_new_tokens
            )
        measured = evaluate_with_tool(
            sampler, eval_prompts, seed=EVAL_SAMPLING_SEED, max_new_tokens=max_new_tokens
        )
        return Evaluation(accuracy=measured.accuracy, details=measured.details())

    return evaluate


def _demonstrations(
    settings: BuildSettings, seed: int, tools: bool
) -> tuple[Iterator[Prompt], Callable[[Prompt], Demonstration]]:
    """The warm start's training prompts and how each is solved: worked solutions, or for
    `tools` a mix of answers that call the tool and answers that do not."""
    if tools:
        low, high = settings.train_difficulties or (settings.difficulty, settings.difficulty)

        def solve(prompt: Prompt) -> Demonstration:
            return tool_demonstration(prompt, seed, settings.tool_fraction)

        return arith_tool.iter_mixed_prompts(seed, low, high, "train"), solve
    return arith.iter_prompts(seed, settings.difficulty, "train"), arith.reference_solution


def build_tiny_model(
    out: str | Path = DEFAULT_MODEL_DIR,
    seed: int = 0,
    settings: BuildSettings | None = None,
    *,
    progress: bool = True,
    strict: bool = True,
) -> BuildInfo:
    """Initialise, warm-start and save the tiny model of `settings.task` into `out` (replacing
    what is there).

    With `strict`, a warm-start that never enters the accuracy band raises TinyModelBuildError
    and writes nothing; without it the model is saved anyway and `in_band` records the miss.
    """
    settings = settings or BuildSettings()
    tools = settings.task == arith_tool.TASK_NAME
    if settings.task not in (arith.TASK_NAME, arith_tool.TASK_NAME):
        default_settings(settings.task)  # raises, naming what is built
    started = time.perf_counter()
    out = Path(out)
    tokenizer = build_tokenizer()
    task = get_task(settings.task)
    eval_prompts = task.generate_prompts(settings.eval_size, seed, settings.difficulty, "eval")
    references = [task.reference_solution(p) for p in eval_prompts]
    longest = max(len(ids) for ids in tokenizer(references, add_special_tokens=False)["input_ids"])
    with _torch_threads(settings.threads):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(qwen2_config(settings.spec, tokenizer))
        # transformers leaves this constructor unannotated.
        model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

        sampler = sampling_backend(
            model,
            tokenizer,
            (
                ToolsConfig(enabled=True, max_turns=settings.max_turns, call_format="fenced")
                if tools
                else None
            ),
        )
        evaluate = _evaluator(sampler, model, eval_prompts, longest + EVAL_MARGIN_TOKENS, tools)
        prompts, solve = _demonstrations(settings, seed, tools)
        try:
            result = warm_start(
                model, tokenizer, prompts, solve, evaluate, settings.warm_start, progress=progress
            )
        finally:
            if sampler.tools is not None:
                sampler.tools.close()
    if strict and not result.in_band:
        low_band, high_band = settings.warm_start.band
        raise TinyModelBuildError(
            f"sampled accuracy {result.accuracy:.3f} after {result.steps} steps is outside "
            f"[{low_band}, {high_band}]; raise max_steps or change the settings"
        )
    kept = next((p for p in reversed(result.history) if p.step == result.steps), None)
    info = BuildInfo(
        seed=seed,
        difficulty=settings.difficulty,
        steps=result.steps,
        eval_accuracy=result.accuracy,
        eval_size=settings.eval_size,
        in_band=result.in_band,
        band=settings.warm_start.band,
        build_seconds=round(time.perf_counter() - started, 2),
        parameters=sum(p.numel() for p in model.parameters()),
        threads=settings.threads,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        history=result.history,
        task=settings.task,
        eval_details=dict(kept.details) if kept is not None and result.in_band else {},
        tool_fraction=settings.tool_fraction if tools else None,
    )
    _save(model, tokenizer, info, out, progress)
    return info


def is_model_dir(path: str | Path) -> bool:
    """Whether `path` holds a complete saved model (weights, config and tokenizer)."""
    return all((Path(path) / name).is_file() for name in REQUIRED_FILES)


def default_cache_dir() -> Path:
    """Where a missing tiny model is built: `$KPO_CACHE_DIR`, else the user's XDG cache."""
    if env := os.environ.get("KPO_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kpo-rl"


def committed_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Where the built-in model `name` is committed (ValueError naming the built-in models)."""
    dirs = {DEFAULT_MODEL: DEFAULT_MODEL_DIR, "tiny-arith-tool": TOOL_MODEL_DIR}
    if name not in dirs or name not in BUILTIN_MODEL_TASKS:
        known = ", ".join(sorted(BUILTIN_MODEL_TASKS))
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {known}")
    return dirs[name]


def ensure_tiny_model(
    path: str | Path | None = None, *, progress: bool = True, name: str = DEFAULT_MODEL
) -> Path:
    """A directory holding the built-in model `name`, building it (seed 0) only when it is
    missing.

    Without `path`: the committed model if present, else a build in `default_cache_dir()`.
    """
    committed = committed_model_dir(name)
    if path is not None:
        target = Path(path)
    elif is_model_dir(committed):
        return committed
    else:
        target = default_cache_dir() / f"{name}-seed0"
    if not is_model_dir(target):
        log.info("tiny model not found at %s; building it (about a minute on 2 cores)", target)
        build_tiny_model(
            target, seed=0, settings=default_settings(BUILTIN_MODEL_TASKS[name]), progress=progress
        )
    return target
