"""The `tools` section of a run spec, and the one settings type of tool-integrated rollouts.

The spec validates it; the generation worker receives it as is and its backends read it (call
format, limits, where calls run): one type from the spec down, nothing re-validated on the way.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    StringConstraints,
    model_validator,
)

from kpo_core.config import StrictModel

MAX_TOOL_TURNS = 256
# Characters of one tool observation: 1M characters is some 250K tokens, more than any context.
MAX_TOOL_OUTPUT_CHARS = 1_000_000
# Sandbox calls in flight at once per generation worker.
MAX_TOOL_CONCURRENCY = 1024
# Seconds of one sandbox call: a call blocks its response, and an hour already stalls a run.
MAX_TOOL_TIMEOUT_S = 3600.0
# A sandbox URL (scheme, host, port) and an environment variable's name: far above any real one.
MAX_URL_CHARS = 2048
MAX_ENV_NAME_CHARS = 256


def _sandbox_url(value: str) -> str:
    # Checked here, so that a typo fails the spec rather than the first tool call of a run.
    scheme, sep, rest = value.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or rest[0] in "/?#":
        raise ValueError(f"must be an http:// or https:// URL with a host, got {value!r}")
    if any(char.isspace() for char in value):
        raise ValueError("must not contain whitespace")
    return value


def _env_var_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError(
            f"must be the name of an environment variable (letters, digits, _), got {value!r}; "
            "the token itself never goes in the spec"
        )
    return value


SandboxUrl = Annotated[
    str, StringConstraints(max_length=MAX_URL_CHARS), AfterValidator(_sandbox_url)
]
EnvVarName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_ENV_NAME_CHARS),
    AfterValidator(_env_var_name),
]


class ToolsConfig(StrictModel):
    """Tool-integrated rollouts (services/tools): decoding stops at a Python tool call, the
    sandbox runs it, its output is appended to the context as observation tokens (no
    log-prob, no loss) and decoding continues, until the response ends or a limit does (its
    finish reason says which). The sandbox's token comes from the environment variable
    `sandbox_token_env` names, never from the spec."""

    enabled: bool = Field(False, description="multi-turn rollouts with a Python tool")
    max_turns: int = Field(
        5,
        ge=1,
        le=MAX_TOOL_TURNS,
        description="model turns per response (a tool call ends a turn): a call made in the "
        "last turn is not run and the response ends with finish reason max_turns",
    )
    max_calls: int | None = Field(
        None,
        ge=0,
        le=MAX_TOOL_TURNS,
        description="tool calls run per response; a further call ends the response with "
        "finish reason max_calls; null: max_turns - 1 (one call per turn)",
    )
    max_context_tokens: int | None = Field(
        None,
        ge=1,
        le=2**20,
        description="prompt + response tokens (model and observation) of one response; "
        "reaching it ends the response with finish reason max_context; null: the model's "
        "context length. generation.max_new_tokens still counts model tokens only",
    )
    max_output_chars: int = Field(
        1000,
        ge=1,
        le=MAX_TOOL_OUTPUT_CHARS,
        description="characters of one observation (stdout, or the error's last line); "
        "longer output is truncated",
    )
    call_format: Literal["auto", "fenced", "hermes"] = Field(
        "auto",
        description="what a tool call looks like: fenced (a closed ```python block), hermes "
        '(<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>, '
        "the tool declared to the chat template) or auto (hermes when the model's chat "
        "template declares tools, else fenced)",
    )
    sandbox_url: SandboxUrl | None = Field(
        None,
        description="the sandbox server (kpo sandbox serve) the generation workers call, "
        "http(s)://host:port; null: a local pool of sandboxed processes in each worker",
    )
    sandbox_token_env: EnvVarName = Field(
        "KPO_SANDBOX_TOKEN",
        description="name of the environment variable that holds the sandbox server's bearer "
        "token (on the generation workers); unset: calls carry no token",
    )
    timeout_s: float = Field(
        5.0, gt=0.0, le=MAX_TOOL_TIMEOUT_S, description="wall-clock limit of one tool call"
    )
    max_concurrent_calls: int = Field(
        4,
        ge=1,
        le=MAX_TOOL_CONCURRENCY,
        description="tool calls in flight at once per generation worker (others queue; "
        "responses not waiting on a call keep decoding)",
    )

    @model_validator(mode="after")
    def _calls_fit_turns(self) -> ToolsConfig:
        if self.max_calls is None:
            object.__setattr__(self, "max_calls", self.max_turns - 1)
        return self

    @property
    def calls_allowed(self) -> int:
        """Calls run per response: `max_calls`, which `_calls_fit_turns` sets to one per turn
        but the last when it is not given (the field stays optional for the spec's null)."""
        assert self.max_calls is not None  # set by the validator
        return self.max_calls
