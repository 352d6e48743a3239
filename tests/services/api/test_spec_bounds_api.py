"""A run spec past a bound, or with an option its backend does not take, sent over real HTTP: a
422 naming each field, and no run stored or launched."""

from __future__ import annotations

from typing import Any

from tests.services.api.conftest import Api
from tests.services.api.test_runs_api import TINY


def test_bounds_options_and_attention_are_a_422_naming_each_field(api: Api) -> None:
    body: dict[str, Any] = {
        **TINY,
        "generation": {"group_size": 4, "standby": -1, "options": {"max_batch_rowz": 8}},
        "learner": {"attn_implementation": "kernels-community/flash-attn3"},
        "pipeline": {"steps": 10_000_001},
    }
    response = api.client.post("/v1/runs", json=body)
    assert response.status_code == 422, response.text
    fields = {f["field"]: f["message"] for f in response.json()["error"]["fields"]}
    assert fields == {
        "generation.standby": "Input should be greater than or equal to 0",
        "generation.options.max_batch_rowz": "not an option of the hf backend; its options "
        "are: attn_implementation, device, dtype, max_batch_rows",
        "learner.attn_implementation": "Input should be 'eager', 'sdpa', 'flash_attention_2' "
        "or 'flash_attention_3'",
        "pipeline.steps": "Input should be less than or equal to 10000000",
    }
    assert api.launcher.submitted == []
    assert api.client.get("/v1/runs").json()["runs"] == []
    # The same spec within its bounds and with a real option is accepted and launched.
    body["generation"]["options"] = {"max_batch_rows": 8}
    body["generation"]["standby"] = 1
    body["learner"]["attn_implementation"] = "flash_attention_2"
    body["pipeline"]["steps"] = 10_000_000
    accepted = api.client.post("/v1/runs", json=body)
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["spec"]["generation"]["options"] == {"max_batch_rows": 8}
    assert accepted.json()["spec"]["generation"]["standby"] == 1
    assert api.launcher.submitted == [accepted.json()["id"]]


def test_truncated_training_sampling_is_a_422_under_refuse_until_declared_and_then_recorded(
    api: Api,
) -> None:
    body: dict[str, Any] = {
        **TINY,
        "generation": {"group_size": 4, "top_p": 0.9},
        "algorithm": {"off_policy": {"truncated_sampling": "refuse"}},
    }
    response = api.client.post("/v1/runs", json=body)
    assert response.status_code == 422, response.text
    fields = {f["field"]: f["message"] for f in response.json()["error"]["fields"]}
    assert list(fields) == ["generation.top_p"]
    message = fields["generation.top_p"]
    assert "full softmax" in message and "biased" in message
    assert "algorithm.off_policy.truncated_sampling: allow" in message
    assert api.launcher.submitted == []
    # Declared, the run is accepted and launched, and its stored spec says so.
    body["algorithm"] = {"off_policy": {"truncated_sampling": "allow"}}
    accepted = api.client.post("/v1/runs", json=body)
    assert accepted.status_code == 201, accepted.text
    run_id = accepted.json()["id"]
    assert api.launcher.submitted == [run_id]
    stored = api.client.get(f"/v1/runs/{run_id}").json()["spec"]
    assert stored["algorithm"]["off_policy"]["truncated_sampling"] == "allow"
    assert stored["generation"]["top_p"] == 0.9


def test_truncated_training_sampling_is_replayed_by_default_and_recorded(api: Api) -> None:
    body: dict[str, Any] = {**TINY, "generation": {"group_size": 4, "top_k": 20}}
    accepted = api.client.post("/v1/runs", json=body)
    assert accepted.status_code == 201, accepted.text
    stored = api.client.get(f"/v1/runs/{accepted.json()['id']}").json()["spec"]
    assert stored["algorithm"]["off_policy"]["truncated_sampling"] == "replay"
    assert stored["generation"]["replay_max_kept"] == 256
