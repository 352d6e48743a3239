"""JSON forms of the run messages, for checkpoints: plain data, no pickle."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from services.messages import Prompt, Response, ScoredGroup, ScoredResponse


def prompt_to_json(prompt: Prompt) -> dict[str, Any]:
    return asdict(prompt)


def prompt_from_json(data: dict[str, Any]) -> Prompt:
    return Prompt(**data)


def group_to_json(group: ScoredGroup) -> dict[str, Any]:
    return asdict(group)


def group_from_json(data: dict[str, Any]) -> ScoredGroup:
    """Inverse of `group_to_json` (asdict turns the nested dataclasses into dicts)."""
    responses = [
        ScoredResponse(
            response=Response(**item["response"]),
            reward=item["reward"],
            verified=item["verified"],
            failure=item["failure"],
        )
        for item in data["responses"]
    ]
    return ScoredGroup(prompt=prompt_from_json(data["prompt"]), responses=responses)
