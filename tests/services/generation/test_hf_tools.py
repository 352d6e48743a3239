"""Multi-turn rollouts of the hf backend, with a tiny model that really calls the tool.

The model (`tool_model.py`) was fitted to write a call after each of three prompts; the engine
decodes it from the model's logits, stops at it, runs it through a ToolRunner, appends the
observation and decodes the answer. The runners (`tool_rollouts.py`) stand in for the sandbox
(its own tests cover it). The tests are those every backend runs (`multi_turn_checks.py`,
imported here), each on a fresh backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.generation.hf_backend import HFBackend
from services.tools.calls import CallFormatSetting
from services.tools.config import ToolsConfig
from tests.services.generation import multi_turn_checks as checks
from tests.services.generation.multi_turn_checks import *  # noqa: F403 (the shared tests)
from tests.services.generation.tool_rollouts import PrintingRunner

TOLERANCE = 5e-5  # as tests/services/learner/test_logprobs.py: float32 summation order


@pytest.fixture
def harness(tool_model_dir: Path) -> checks.Harness:
    def backend_with_tools(
        runner: PrintingRunner, call_format: CallFormatSetting = "fenced", **limits: int
    ) -> HFBackend:
        backend = HFBackend(tool_model_dir)
        backend.enable_tools(ToolsConfig(enabled=True, call_format=call_format, **limits), runner)
        return backend

    return checks.Harness(tool_model_dir, backend_with_tools, TOLERANCE)
