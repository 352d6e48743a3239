"""A live stack for the PromQL checks: the real control plane over a local store holding a
finished tiny run, and a real Prometheus (Debian's binary) on loopback that scrapes it every
second and evaluates deploy/prometheus/rules.yaml.

The tiny run is real (the pipeline on a local Ray instance, `tiny_run`); its metrics records are
then put into the control plane's store in two batches with a scrape in between, so that
counters and histograms grow between scrapes and every `rate()` has something to measure; then
the run is finished (`succeeded`) and scraped once more. The launcher is the API tests' test
double (Ray counts as ready, nothing is launched): what Prometheus reads comes from the store.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.api.app import create_app
from services.api.settings import ApiSettings
from services.jobs.ray_head import free_port
from services.pipeline.launch import execute_run
from services.pipeline.outputs import RunDirectory
from services.pipeline.specs import load_run_spec
from services.store import LocalStore
from tests.deploy.manifests import REPO
from tests.services.api.launchers import RecordingLauncher
from tests.services.api.server import serve

RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
SCRAPE_JOB = "kpo-control-plane"  # the job name the rules and the dashboard expect
WAIT_S = 30.0
STEPS = 6
FIRST_STEPS = 3  # stored and scraped before the others


def tiny_run(workdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A real finished tiny run: its resolved spec and its metrics records, one per step.

    Run with the real pipeline (local Ray, the tiny model, KPO, asynchronous), small enough for
    seconds per step.
    """
    overrides = [
        f"pipeline.steps={STEPS}",
        "pipeline.batch_groups=4",
        "pipeline.checkpoint_every=0",
        "generation.prompts_per_batch=4",
        "generation.group_size=4",
        "reward.num_cpus=0",
    ]
    spec = load_run_spec(REPO / "examples" / "demo.yaml", overrides)
    run_dir = RunDirectory(workdir / "tiny-run")
    assert execute_run(spec, run_dir) == "succeeded"
    records = run_dir.read_metrics()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return spec.model_dump(mode="json"), records


@dataclass
class LiveStack:
    control_plane: str  # base URL
    prometheus: str  # base URL
    run_id: str
    http: httpx.Client
    log: Path  # Prometheus' log

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector; fails on any Prometheus error."""
        response = self.http.get(f"{self.prometheus}/api/v1/query", params={"query": expr})
        body = response.json()
        assert response.status_code == 200 and body.get("status") == "success", (
            f"query {expr!r} failed: {body.get('errorType')}: {body.get('error')}"
        )
        assert body["data"]["resultType"] == "vector", f"{expr!r}: {body['data']['resultType']}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def api(self, path: str, **params: Any) -> Any:
        response = self.http.get(f"{self.prometheus}/api/v1/{path}", params=params)
        response.raise_for_status()
        return response.json()["data"]

    def metrics_text(self) -> str:
        """The control plane's /metrics, as Prometheus reads it."""
        response = self.http.get(f"{self.control_plane}/metrics")
        response.raise_for_status()
        return response.text

    def wait_for(self, what: str, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                targets = self.api("targets")["activeTargets"]
                tail = self.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"timed out waiting for {what}; targets: {targets}\n{tail}")
            time.sleep(0.2)

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


def prometheus_config(control_plane_port: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": SCRAPE_JOB,
                "static_configs": [{"targets": [f"127.0.0.1:{control_plane_port}"]}],
            }
        ],
    }


@contextmanager
def run_prometheus(
    binary: Path, workdir: Path, control_plane_port: int
) -> Iterator[tuple[str, Path]]:
    """Prometheus on a free loopback port; yields its URL and its log file."""
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(control_plane_port)), encoding="utf-8")
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert process.poll() is None, f"prometheus exited:\n{log.read_text(errors='replace')}"
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.1)
        yield url, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def live_stack(workdir: Path, prometheus_binary: Path) -> Iterator[LiveStack]:
    spec, records = tiny_run(workdir)
    store = LocalStore(workdir / "store")
    run_id = store.create_run(spec).id
    store.transition(run_id, "running")
    store.append_metrics(run_id, records[:FIRST_STEPS])
    settings = ApiSettings.model_validate({"KPO_DATA_DIR": str(workdir)})
    app = create_app(settings, store, RecordingLauncher())
    try:
        with (
            serve(app) as control_plane,
            run_prometheus(prometheus_binary, workdir, int(control_plane.rsplit(":", 1)[1])) as (
                prometheus,
                log,
            ),
            httpx.Client(timeout=10) as http,
        ):
            stack = LiveStack(control_plane, prometheus, run_id, http, log)
            version = f'kpo_policy_version{{run_id="{run_id}"}}'
            stack.wait_for("the first scrape", lambda: stack.value(version) == FIRST_STEPS)
            store.append_metrics(run_id, records[FIRST_STEPS:])
            stack.wait_for("the later steps", lambda: stack.value(version) == STEPS)
            store.transition(run_id, "succeeded")
            stack.wait_for(
                "the finished run",
                lambda: stack.value('kpo_runs{status="succeeded"}') == 1,
            )
            # Recording rules run every second; wait until they have seen the later steps.
            stack.wait_for(
                "the recording rules",
                lambda: bool(stack.query("run_id:kpo_learner_step_seconds:p90_5m > 0")),
            )
            yield stack
    finally:
        store.close()
