"""POST /v1/runs/{id}/resume and GET /v1/runs/{id}/guard over real HTTP with a real store; the run
is paused as its driver pauses it (its StoreObserver's events), and that observer is asked for
the request as the waiting driver asks it. `kpo status` and `kpo resume-paused` against it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from typer.testing import CliRunner

from services.api.client import ApiClient
from services.cli import app
from services.pipeline.pause import ACTION_EVENT, PAUSED_EVENT, RESUME_EVENT, RESUMED_EVENT
from services.pipeline.store_observer import StoreObserver
from services.store import RunStatus
from tests.services.api.conftest import Api

PAUSING = {
    "name": "guarded",
    "pipeline": {"steps": 20, "lead_batches": 1, "max_staleness": 2},
    "learner": {"lr": 1.0e-5},
    "stability": {"enabled": True, "action": "pause"},
}
PAUSE = {
    "action": "pause",
    "reason": "entropy_min_fraction",
    "step": 7,
    "since": 5,
    "key": "entropy",
    "value": 0.2,
    "bound": 0.5,
    "rollbacks": 0,
    "message": "step 7: pause: entropy_min_fraction broken since step 5: entropy 0.2",
}
runner = CliRunner()


def paused_run(api: Api, step: int = 7) -> tuple[str, StoreObserver]:
    """A running run whose driver paused at `step`, reporting as the driver reports; the
    driver's observer (its resume source)."""
    run_id = api.admin.post("/v1/runs", json=PAUSING).json()["id"]
    observer = StoreObserver(api.store, run_id, total_steps=20)
    observer.on_status("running", step=0)
    details = {**PAUSE, "step": step}
    observer.on_event(ACTION_EVENT, details)
    observer.on_event(PAUSED_EVENT, {**details, "checkpoint": step})
    return run_id, observer


def resume(api: Api, run_id: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    if body is None:
        return api.client.post(f"/v1/runs/{run_id}/resume", **kwargs)
    return api.client.post(f"/v1/runs/{run_id}/resume", json=body, **kwargs)


def stored_resumes(api: Api, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in api.store.read_events(run_id) if e.kind == RESUME_EVENT]


def fields(response: httpx.Response) -> dict[str, str]:
    assert response.status_code == 422, response.text
    return {f["field"]: f["message"] for f in response.json()["error"]["fields"]}


def test_a_paused_run_resumes_with_its_patch_and_its_driver_takes_it(api: Api) -> None:
    run_id, driver = paused_run(api)
    assert driver.take_resume(7) is None  # waiting
    patch = {"learner": {"lr": 5.0e-6}, "algorithm": {"estimator": {"name": "token"}}}
    response = resume(api, run_id, {"spec_patch": patch})
    assert response.status_code == 202, response.text
    assert response.json()["id"] == run_id and response.json()["status"] == "running"
    [stored] = stored_resumes(api, run_id)
    assert stored["spec_patch"] == patch and stored["checkpoint"] == 7
    assert stored["requested_at"] > 0
    request = driver.take_resume(7)
    assert request is not None and request.spec_patch == patch
    # Asked to resume: no longer paused, so a second request is a 409 until it pauses again.
    again = resume(api, run_id, {})
    assert again.status_code == 409 and again.json()["error"]["type"] == "conflict"
    assert "not paused" in again.json()["error"]["message"]
    driver.on_event(RESUMED_EVENT, {"checkpoint": 7})
    driver.on_event(PAUSED_EVENT, {**PAUSE, "step": 12, "checkpoint": 12})
    assert resume(api, run_id).status_code == 202  # no body: resume unchanged
    assert stored_resumes(api, run_id)[-1]["spec_patch"] == {}
    second = driver.take_resume(12)
    assert second is not None and second.spec_patch == {}
    assert driver.take_resume(7) == request  # each pause keeps its answer


def test_a_run_that_is_not_paused_is_a_409(api: Api) -> None:
    queued = api.client.post("/v1/runs", json=PAUSING).json()["id"]
    assert resume(api, queued, {}).status_code == 409
    running = api.client.post("/v1/runs", json=PAUSING).json()["id"]
    api.store.transition(running, RunStatus.RUNNING)
    refused = resume(api, running, {})
    assert refused.status_code == 409
    assert "running but not paused" in refused.json()["error"]["message"]
    # Paused, then resumed by its driver (a request from the run directory): not paused now.
    run_id, driver = paused_run(api)
    driver.on_event(RESUMED_EVENT, {"checkpoint": 7})
    assert resume(api, run_id, {}).status_code == 409
    # Paused, then cancelled: finished runs do not resume.
    cancelled, _ = paused_run(api)
    api.store.transition(cancelled, RunStatus.CANCELLED)
    finished = resume(api, cancelled, {})
    assert finished.status_code == 409 and "is cancelled" in finished.json()["error"]["message"]
    assert resume(api, "run-000000000000", {}).status_code == 404
    assert all(stored_resumes(api, r) == [] for r in (queued, running, run_id, cancelled))


def test_a_patch_of_other_keys_is_a_422_naming_every_one(api: Api) -> None:
    run_id, _ = paused_run(api)
    patch = {
        "learner": {"lr": 1.0e-6, "batch_size": 8},
        "generation": {"temperature": 0.5},
        "pipeline": {"steps": 40, "max_staleness": 1},
    }
    problems = fields(resume(api, run_id, {"spec_patch": patch}))
    assert set(problems) == {
        "spec_patch.learner.batch_size",
        "spec_patch.generation.temperature",
        "spec_patch.pipeline.steps",
    }
    assert all(
        "learner.lr, pipeline.max_staleness, algorithm.estimator" in m for m in problems.values()
    )
    assert stored_resumes(api, run_id) == []


def test_a_patch_that_makes_an_invalid_spec_is_a_422_naming_the_field(api: Api) -> None:
    run_id, _ = paused_run(api)
    lr = fields(resume(api, run_id, {"spec_patch": {"learner": {"lr": -1}}}))
    assert lr == {"spec_patch.learner.lr": "Input should be greater than 0"}
    estimator = fields(
        resume(api, run_id, {"spec_patch": {"algorithm": {"estimator": {"name": "ppo"}}}})
    )
    assert list(estimator) == ["spec_patch.algorithm.estimator"]
    assert "'kalman'" in estimator["spec_patch.algorithm.estimator"]
    # A check across fields (lead_batches 1 needs max_staleness >= 1) names the patched key.
    staleness = fields(resume(api, run_id, {"spec_patch": {"pipeline": {"max_staleness": 0}}}))
    assert list(staleness) == ["spec_patch.pipeline.max_staleness"]
    assert (
        "lead_batches (1) must not exceed max_staleness (0)"
        in staleness["spec_patch.pipeline.max_staleness"]
    )
    # A body with anything but spec_patch.
    assert list(fields(resume(api, run_id, {"patch": {}}))) == ["patch"]
    assert list(fields(resume(api, run_id, {"spec_patch": [1]}))) == ["spec_patch"]
    assert stored_resumes(api, run_id) == []


def test_resume_needs_the_token(secured: Api) -> None:
    run_id, _ = paused_run(secured)  # created with the token
    refused = secured.client.post(f"/v1/runs/{run_id}/resume", json={})
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    wrong = secured.client.post(
        f"/v1/runs/{run_id}/resume", json={}, headers={"Authorization": "Bearer nope"}
    )
    assert wrong.status_code == 401
    assert stored_resumes(secured, run_id) == []
    accepted = secured.admin.post(f"/v1/runs/{run_id}/resume", json={})
    assert accepted.status_code == 202
    assert len(stored_resumes(secured, run_id)) == 1
    assert secured.client.get(f"/v1/runs/{run_id}/guard").status_code == 401  # reads too


def test_the_guards_state_and_kpo_status(api: Api) -> None:
    run_id, driver = paused_run(api)
    guard = api.client.get(f"/v1/runs/{run_id}/guard").json()
    assert guard["enabled"] is True and guard["action"] == "pause"
    assert guard["paused"]["checkpoint"] == 7 and guard["paused"]["reason"] == PAUSE["reason"]
    assert guard["actions"] == 1 and guard["rollbacks"] == 0
    shown = runner.invoke(app, ["status", run_id, "--server", api.url])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert "guard: action pause, 1 actions taken, 0 rollbacks" in lines
    assert any(
        line.startswith(
            "guard: paused at step 7 by entropy_min_fraction (broken since step 5): step 7: "
        )
        for line in lines
    )
    driver.on_event(RESUMED_EVENT, {"checkpoint": 7})
    shown = runner.invoke(app, ["status", run_id, "--server", api.url])
    assert "guard: not paused; last action at step 7: " + PAUSE["message"] in shown.output
    # A run without the guard shows nothing of it.
    plain = api.client.post("/v1/runs", json={"name": "plain"}).json()["id"]
    assert "guard" not in runner.invoke(app, ["status", plain, "--server", api.url]).output
    assert api.client.get(f"/v1/runs/{plain}/guard").json()["enabled"] is False


def test_kpo_resume_paused_sends_the_patch_file(api: Api, tmp_path: Path) -> None:
    run_id, driver = paused_run(api)
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: {lr: 1.0e-6, batch_size: 4}\n")
    refused = runner.invoke(
        app, ["resume-paused", run_id, "--patch", str(bad), "--server", api.url]
    )
    assert refused.exit_code == 2 and "spec_patch.learner.batch_size" in refused.output
    patch = tmp_path / "patch.yaml"
    patch.write_text("learner: {lr: 5.0e-6}\n")
    done = runner.invoke(app, ["resume-paused", run_id, "--patch", str(patch), "--server", api.url])
    assert done.exit_code == 0, done.output
    request = driver.take_resume(7)
    assert request is not None and request.spec_patch == {"learner": {"lr": 5.0e-6}}
    with ApiClient(api.url) as client:  # the client's call, as the command makes it
        assert client.get_guard(run_id)["paused"] is None


def test_kpo_resume_paused_writes_a_run_directorys_request(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(PAUSING))
    status = {"state": "running", "paused": {**PAUSE, "checkpoint": 7}}
    (run_dir / "status.json").write_text(json.dumps({"state": "running"}))
    not_paused = runner.invoke(app, ["resume-paused", str(run_dir)])
    assert not_paused.exit_code == 2 and "is not paused" in not_paused.output
    (run_dir / "status.json").write_text(json.dumps(status))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"spec_patch": {"pipeline": {"max_staleness": 0}}}))
    refused = runner.invoke(app, ["resume-paused", str(run_dir), "--patch", str(bad)])
    assert refused.exit_code == 2 and "max_staleness" in refused.output
    assert not (run_dir / "resume.json").exists()
    patch = tmp_path / "patch.yaml"
    patch.write_text("pipeline: {max_staleness: 1}\n")
    done = runner.invoke(app, ["resume-paused", str(run_dir), "--patch", str(patch)])
    assert done.exit_code == 0, done.output
    assert "resume requested from step 7" in done.output
    body = json.loads((run_dir / "resume.json").read_text())
    assert body == {"spec_patch": {"pipeline": {"max_staleness": 1}}}
    pending = runner.invoke(app, ["resume-paused", str(run_dir)])
    assert pending.exit_code == 2 and "exists already" in pending.output
