"""The tool metrics of a batch of multi-turn responses (one value each per learner step).

Computed by the run driver from the responses it hands the learner, on the host: how often the
model calls the tool, how often a call fails, how many turns a response takes and how much of
a response is observation rather than model output. Declared in services/metrics.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.messages import Response

OK_STATUS = "ok"


def tool_metrics(responses: Sequence[Response]) -> dict[str, float]:
    """tool_calls_per_response, tool_error_fraction (calls whose status is not ok, over the
    calls; 0 without calls), turns_mean (model turns: the calls + 1) and
    observation_token_fraction (observation tokens over all response tokens) of `responses`."""
    if not responses:
        return {}
    calls = [len(r.tool_calls) for r in responses]
    failed = sum(status != OK_STATUS for r in responses for status in r.tool_calls)
    observed = sum(sum(r.observation_mask) for r in responses)
    tokens = sum(len(r.response_token_ids) for r in responses)
    return {
        "tool_calls_per_response": sum(calls) / len(responses),
        "tool_error_fraction": failed / sum(calls) if sum(calls) else 0.0,
        "turns_mean": sum(count + 1 for count in calls) / len(responses),
        "observation_token_fraction": observed / tokens if tokens else 0.0,
    }
