"""The generation worker with tools: the real local sandbox runs the model's call.

In process (no actor): the worker builds its ToolRunner from the spec's `tools` section
(bubblewrap-sandboxed interpreters of its own here), the engine thread decodes, the call runs in the
sandbox, and the answer comes back through the stream with its observation in place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.generation.base import GroupRequest, SamplingSettings
from services.generation.worker import GenerationWorkerImpl
from services.messages import Prompt
from services.tools.client import HttpSandbox
from services.tools.config import ToolsConfig
from tests.services.generation.tool_model import OUTPUT, PLAIN

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def test_a_worker_runs_the_models_call_in_the_sandbox(tool_model_dir: Path) -> None:
    worker = GenerationWorkerImpl(
        "hf",
        str(tool_model_dir),
        tools=ToolsConfig(enabled=True, call_format="fenced", timeout_s=10.0),
    )
    try:
        sampling = SamplingSettings(temperature=0.7, max_new_tokens=120, seed=3)
        worker.submit([GroupRequest(Prompt("p", PLAIN.prompt, OUTPUT), 2, sampling)])
        groups = []
        while not groups:
            groups = worker.next_groups(timeout_s=60.0).groups
        [group] = groups
        for response in group:
            assert response.finish_reason == "stop" and any(response.observation_mask)
            assert "<output>\n42\n</output>\n" in response.text
        assert worker.stats().tool_calls == {"ok": 2}
    finally:
        worker.close()


def test_closing_a_worker_closes_its_sandbox_client(tool_model_dir: Path) -> None:
    tools = ToolsConfig(enabled=True, sandbox_url="http://127.0.0.1:9", call_format="fenced")
    worker = GenerationWorkerImpl("hf", str(tool_model_dir), tools=tools)
    backend_tools = worker._backend.tools
    assert backend_tools is not None
    runner = backend_tools.calls.runner
    assert isinstance(runner, HttpSandbox) and not runner.closed
    worker.close()
    assert runner.closed
