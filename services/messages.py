"""Typed messages that pass between the actors of a run.

Each field says who fills it and who reads it. Plain dataclasses of builtin types, so that Ray
serialises them cheaply and tests can build them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Why a response ended: "stop" (the model sampled an end-of-sequence token), "length"
# (generation.max_new_tokens model tokens). Multi-turn (tool) responses may also end at a limit
# of services/tools/rollout.py: "max_turns" or "max_calls" (a tool call the limit did not let
# run), "max_context" (tools.max_context_tokens, observation tokens included).
FinishReason = Literal["stop", "length", "max_turns", "max_calls", "max_context"]


# One chat message as chat templates take it: {"role": "system" | "user" | "assistant",
# "content": text}.
ChatMessage = dict[str, str]

# verl's agent loops a dataset row may name in `agent_name` (kept in `Prompt.meta`): one
# response, or a multi-turn loop with tool calls.
SINGLE_TURN_AGENT = "single_turn_agent"
TOOL_AGENT = "tool_agent"


@dataclass(frozen=True)
class Prompt:
    """One task instance. Filled by a task generator or a dataset reader; read by generation and
    reward."""

    prompt_id: str  # unique within a run; groups are keyed by it
    # What the model is conditioned on when `messages` is empty; otherwise the last user message
    # (for people reading records: the model sees `messages` through the chat template).
    text: str
    answer: str  # reference answer the verifier compares against
    meta: dict[str, str] = field(default_factory=dict)  # task-specific (difficulty, source line)
    # A chat: rendered with the tokenizer's chat template, generation prompt added.
    messages: list[ChatMessage] = field(default_factory=list)

    @property
    def takes_tools(self) -> bool:
        """Whether a run with tools enabled answers this prompt in multi-turn rollouts: every
        prompt does except a verl row whose agent loop is `single_turn_agent` (dataset rows
        name theirs in `meta["agent_name"]`)."""
        return self.meta.get("agent_name") != SINGLE_TURN_AGENT


@dataclass(frozen=True)
class Response:
    """One sampled continuation. Filled by a generation backend; read by reward and the learner."""

    prompt_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]  # includes the EOS token when finish_reason == "stop"
    # log-prob of each sampled token under the distribution it was sampled from; whether that
    # distribution includes temperature/top-p/top-k is stated by the backend's `logprobs_mode`.
    behaviour_logprobs: list[float]
    finish_reason: FinishReason
    # Version of the weights that sampled its first token: the oldest of its tokens, which is
    # what its staleness is judged by.
    policy_version: int
    text: str  # decoded response, for the verifier
    # With in-flight weight updates, the version that sampled each response token (one per
    # token, never decreasing); empty when every token was sampled by `policy_version`.
    token_versions: list[int] = field(default_factory=list)
    # Multi-turn (tool) responses: True at observation tokens (a tool's output placed in the
    # context, not sampled: their behaviour log-prob is 0.0 and meaningless, they carry no loss
    # and, in `token_versions`, the version of the model token before them); empty when every
    # token was sampled by the model.
    observation_mask: list[bool] = field(default_factory=list)
    # The result status of each tool call the response made, in order ("ok", "error",
    # "timeout", "refused", "unavailable": `services.tools.sandbox.ToolResult`), whether or not
    # its observation fitted in the context.
    tool_calls: list[str] = field(default_factory=list)
    # Truncated-sampling replay (`algorithm.off_policy.truncated_sampling: replay`): per response
    # token, the ids its sampler kept (top-k / top-p / min-p), ascending, over which its
    # behaviour log-prob was normalised and the learner normalises its own. [] at observation
    # tokens and where the set was larger than `generation.replay_max_kept` (the learner drops
    # that token); empty when nothing was recorded (no replay).
    kept_ids: list[list[int]] = field(default_factory=list)

    def is_model_token(self) -> list[bool]:
        """Per response token: sampled by the model (True) or an observation (False)."""
        if self.observation_mask:
            return [not observed for observed in self.observation_mask]
        return [True] * len(self.response_token_ids)

    def versions(self) -> list[int]:
        """The policy version that sampled each response token."""
        if self.token_versions:
            return list(self.token_versions)
        return [self.policy_version] * len(self.response_token_ids)

    @property
    def version_span(self) -> int:
        """How many policy versions sampled its tokens (1: a single version)."""
        return len(set(self.token_versions)) if self.token_versions else 1


@dataclass(frozen=True)
class ScoredResponse:
    """A response with its reward. Filled by a verifier actor; read by the buffer and learner."""

    response: Response
    reward: float
    verified: bool  # False when the verifier failed or timed out (reward is then 0)
    failure: str | None = None  # why verification failed, for counting and logs


@dataclass(frozen=True)
class ScoredGroup:
    """All G responses to one prompt: the unit the rollout buffer stores and the learner uses."""

    prompt: Prompt
    responses: list[ScoredResponse]

    @property
    def policy_version(self) -> int:
        """Oldest version in the group: staleness is judged by the stalest member."""
        return min(r.response.policy_version for r in self.responses)
