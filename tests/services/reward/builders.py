"""Builders of messages for the reward tests."""

from __future__ import annotations

from services.messages import Prompt, Response


def prompt(prompt_id: str, answer: str) -> Prompt:
    return Prompt(prompt_id=prompt_id, text=f"question {prompt_id}", answer=answer)


def response(prompt_id: str, text: str, version: int = 0) -> Response:
    return Response(
        prompt_id=prompt_id,
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4],
        behaviour_logprobs=[-0.5, -0.25],
        finish_reason="stop",
        policy_version=version,
        text=text,
    )
