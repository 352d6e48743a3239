"""The committed tiny-arith-tool model: it loads like any model, its tokenizer spells calls and
observations exactly, and sampled with its calls executed it sometimes calls, not always."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from services.generation.hf_backend import HFBackend
from services.messages import Response
from services.tasks import arith_tool
from services.tasks.models import resolve_model
from services.tasks.sampling_eval import sample_responses
from services.tasks.tiny_model import (
    BUILD_INFO,
    TOOL_MODEL_DIR,
    committed_model_dir,
    ensure_tiny_model,
    is_model_dir,
)
from services.tasks.tool_eval import ArithmeticRunner, evaluate_with_tool, run_arithmetic
from services.tools.config import ToolsConfig
from services.tools.rollout import ObservationEncoder

CALL = "```python\nprint(3417*86)\n```"
OBSERVATION = "<output>\n293862\n</output>\n"


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(TOOL_MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(TOOL_MODEL_DIR)


@pytest.fixture(scope="module")
def info() -> dict[str, object]:
    data: dict[str, object] = json.loads((TOOL_MODEL_DIR / BUILD_INFO).read_text())
    return data


def test_committed_and_resolved_by_name() -> None:
    assert is_model_dir(TOOL_MODEL_DIR)
    assert sum(f.stat().st_size for f in TOOL_MODEL_DIR.iterdir()) < 4_000_000
    assert committed_model_dir("tiny-arith-tool") == TOOL_MODEL_DIR
    assert ensure_tiny_model(name="tiny-arith-tool") == TOOL_MODEL_DIR
    assert resolve_model("tiny-arith-tool") == TOOL_MODEL_DIR.resolve()
    assert resolve_model("tiny-arith") != resolve_model("tiny-arith-tool")
    with pytest.raises(ValueError, match="tiny-arith-tool"):
        committed_model_dir("tiny-other")


def test_loads_as_qwen2_with_agreeing_special_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("text", [CALL, OBSERVATION, "####293862", "print(9991//37)\n"])
def test_the_tokenizer_round_trips_calls_and_observations(
    tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character: nothing merges across a boundary
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids


def test_the_rollout_s_observation_tokens_are_the_demonstration_s(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # The rollout tokenizes the wrapper and the output apart; the warm start tokenized the
    # whole observation: for this tokenizer both give the same ids.
    encoder = ObservationEncoder(tokenizer, declare_tools=False)
    whole = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    assert encoder.encode("293862", chat=False) == whole
    context = tokenizer("3417*86=" + CALL + OBSERVATION, add_special_tokens=False)
    parts = [
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("3417*86=", CALL, OBSERVATION)
    ]
    assert context["input_ids"] == [i for part in parts for i in part]


def test_build_info_records_the_warm_start(info: dict[str, object]) -> None:
    assert info["task"] == "arith-tool" and info["in_band"] is True
    assert info["difficulty"] == arith_tool.DEFAULT_DIFFICULTY
    accuracy = info["eval_accuracy"]
    assert isinstance(accuracy, float) and 0.15 <= accuracy <= 0.6
    details = info["eval_details"]
    assert isinstance(details, dict)
    assert 0.2 < details["tool_call_rate"] < 0.8
    assert details["accuracy_without_tool"] < 0.05  # 4-digit products are out of its reach


def first_call_and_observation(
    response: Response, tokenizer: PreTrainedTokenizerBase
) -> tuple[str, str]:
    """The text of a response's first model turn and of the observation after it."""
    ids, observed = response.response_token_ids, response.observation_mask
    start = observed.index(True)
    end = observed.index(False, start) if False in observed[start:] else len(observed)
    call, observation = tokenizer.decode(ids[:start]), tokenizer.decode(ids[start:end])
    assert isinstance(call, str) and isinstance(observation, str)  # one sequence, one string
    return call, observation


def test_sampled_with_calls_executed_it_sometimes_calls(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # Through the hf backend with its tool rollout, as RL samples it (and as its warm start
    # measured it); prompts of another seed than the build's evaluation.
    backend = HFBackend(TOOL_MODEL_DIR)
    tools = ToolsConfig(enabled=True, max_turns=3, call_format="fenced")
    backend.enable_tools(tools, ArithmeticRunner())
    prompts = arith_tool.generate_prompts(48, seed=1, difficulty=4, split="eval")
    samples = sample_responses(backend, prompts, seed=0, max_new_tokens=64)
    calling = [s for s in samples if s.tool_calls]
    assert 0 < len(calling) < len(samples)
    for sample in calling:
        call, observed = first_call_and_observation(sample, tokenizer)
        code = call.split("```python\n", 1)[1].removesuffix("```")
        assert observed == f"<output>\n{run_arithmetic(code)}\n</output>\n"
    # Accuracy with the calls run: a 48-prompt sample of the build's ~0.3 (binomial spread
    # about +-0.07): this only fails for a broken model, or one that never or always calls.
    measured = evaluate_with_tool(backend, prompts, seed=0, max_new_tokens=64)
    assert 0.05 < measured.accuracy < 0.8
    assert measured.accuracy_without_tool < 0.1
    assert measured.accuracy > measured.accuracy_without_tool


def test_the_build_command_builds_it_by_default_for_the_task() -> None:
    # The build itself (bit-reproducible) is tested in test_tool_warm_start, with a few steps.
    script = Path(__file__).resolve().parents[3] / "scripts" / "build_tiny_model.py"
    spec = importlib.util.spec_from_file_location("build_tiny_model", script)
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = cli.parse_args(["--task", "arith-tool"])
    assert args.out == TOOL_MODEL_DIR
