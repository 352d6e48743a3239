"""The dashboard in a real headless Chromium (Debian's `chromium` + `chromium-driver`, via
selenium), against the real app under uvicorn over a local store.

Runs here are written straight into the store with their metrics records, as a run's driver
would write them; nothing is launched (the app gets the `RecordingLauncher` test double).
Screenshots are saved in each test's tmp_path.
"""

from __future__ import annotations

import math
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.command import Command
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from services.api import dashboard
from services.api.app import create_app
from services.api.settings import ApiSettings
from services.spec import RunSpec
from services.store import LocalStore, Store
from tests.services.api.conftest import TOKEN, Api, ApiFactory
from tests.services.api.launchers import RecordingLauncher

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL_HINT = "install Debian's `chromium` and `chromium-driver` packages"
# No sandbox (root in a container), and nothing that reaches the internet on its own.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,1000",
)
CHART_IDS = ("reward", "entropy", "clip", "staleness", "switch", "lfr")
# The lines each chart draws for one run (dashboard.js, CHARTS).
SERIES_PER_CHART = {"reward": 2, "entropy": 1, "clip": 1, "staleness": 2, "switch": 2, "lfr": 2}
WAIT_S = 20


def metrics_record(step: int, offset: float = 0.0) -> dict[str, Any]:
    """A plausible learner step: reward rising with noise, entropy falling, KPO-like ratios.

    `offset` moves every curve (another run with other results)."""
    noise = math.sin(step * 1.7) * 0.08 + math.sin(step * 0.37) * 0.05
    return {
        "step": step,
        "time": 1_700_000_000.0 + step,
        "policy_version": float(step),
        "reward_mean": min(1.0, 0.15 + 0.012 * step + noise) - offset,
        "entropy": 0.9 * math.exp(-step / 40) + 0.1 + noise / 10 + offset,
        "clip_fraction": 0.002 + abs(noise) / 20 + offset / 10,
        "staleness_mean": 0.8 + noise * 3 + offset,
        "staleness_max": float(math.ceil(0.8 + noise * 3 + 0.5 + offset)),
        "raw_switch_frequency": 0.28 + noise + offset,
        "filtered_switch_frequency": 0.02 + noise / 10 + offset,
        "raw_low_frequency_ratio": 0.1 + noise / 4 + offset,
        "filtered_low_frequency_ratio": 0.85 + noise / 3 - offset,
        "step_seconds": 0.6,
        "tokens_generated_total": 2000 * step,
    }


def add_run(
    store: Store,
    name: str,
    steps: int,
    status: str = "running",
    estimator: str = "kalman",
    offset: float = 0.0,
) -> str:
    spec = {
        "name": name,
        "algorithm": {"estimator": {"name": estimator}},
        "pipeline": {"mode": "async", "max_staleness": 2, "steps": 100},
    }
    run_id = store.create_run(spec).id
    store.transition(run_id, "running")
    store.append_metrics(run_id, [metrics_record(s, offset) for s in range(1, steps + 1)])
    if status != "running":
        store.transition(run_id, status, "<b>boom</b>" if status == "failed" else None)
    return run_id


# --- the browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """One headless Chromium for the module (tests use different ports, so different origins)."""
    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), INSTALL_HINT
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser: WebDriver) -> Iterator[WebDriver]:
    """The browser; after the test, it leaves the page (closing its streams) and must have logged
    no error but network ones, which the tests cause on purpose (401s, a stopped server): no
    script error, no CSP violation.

    Request it after the server's fixture, so that the page is left before the server stops.
    """
    browser_log(browser)  # drop what earlier tests left
    yield browser
    log = browser_log(browser)
    browser.get("about:blank")
    errors = [e for e in log if e["level"] == "SEVERE" and e["source"] != "network"]
    assert not errors, errors


def browser_log(driver: WebDriver) -> list[dict[str, Any]]:
    """The console and network messages logged since the last call (then cleared)."""
    entries: list[dict[str, Any]] = driver.execute(Command.GET_LOG, {"type": "browser"})["value"]
    return entries


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str) -> Any:
    """Poll `condition`; the page redraws its legends and tables as data arrives, so an element
    found by one poll may be gone by the next: that poll is retried."""
    return WebDriverWait(
        driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    ).until(condition, message=what)


def canvas_of(driver: WebDriver, chart: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, f"#chart-{chart} canvas")


def charts_at_step(step: int) -> Callable[[WebDriver], bool]:
    def check(driver: WebDriver) -> bool:
        return all(
            canvas_of(driver, chart).get_attribute("data-last-step") == str(step)
            for chart in CHART_IDS
        )

    return check


def text_of(driver: WebDriver, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


# --- tests -----------------------------------------------------------------------------------


def test_page_shows_a_run_and_updates_when_a_record_arrives(
    api: Api, page: WebDriver, tmp_path: Path
) -> None:
    add_run(api.store, "grpo-baseline", 60, status="succeeded")
    run_id = add_run(api.store, "kpo-async-demo", 80)

    page.get(f"{api.url}/#{run_id}")

    wait_for(page, charts_at_step(80), "the charts to show the run's history")
    assert text_of(page, "run-name") == "kpo-async-demo"
    assert text_of(page, "run-status").lower() == "running"
    assert len(page.find_elements(By.CSS_SELECTOR, "#run-list li")) == 2
    for chart in CHART_IDS:  # every series of every chart drew all 80 points
        lines = SERIES_PER_CHART[chart]
        assert canvas_of(page, chart).get_attribute("data-points") == str(80 * lines)
    wait_for(page, lambda d: text_of(d, "run-live") == "live", "the event stream to connect")
    before = page.execute_script("return arguments[0].toDataURL()", canvas_of(page, "reward"))

    api.store.append_metrics(run_id, [{**metrics_record(81), "reward_mean": 0.99}])

    wait_for(page, charts_at_step(81), "the new step to reach every chart")
    reward = page.find_element(By.ID, "chart-reward")
    assert "step 81" in reward.text
    assert "reward mean 0.99" in reward.text
    after = page.execute_script("return arguments[0].toDataURL()", canvas_of(page, "reward"))
    assert after != before  # the canvas was redrawn with the new point
    page.save_screenshot(str(tmp_path / "dashboard.png"))

    api.store.transition(run_id, "succeeded")
    wait_for(page, lambda d: text_of(d, "run-live") == "finished", "the stream to end")
    assert text_of(page, "run-status").lower() == "succeeded"


def test_a_rewound_run_drops_the_steps_after_its_checkpoint_and_draws_them_again(
    api: Api, page: WebDriver
) -> None:
    """A rollback to the checkpoint of step 50 while the page follows the run at step 80: the
    charts go back to step 50, then draw the steps trained again."""
    run_id = add_run(api.store, "rolled-back", 80)
    page.get(f"{api.url}/#{run_id}")
    wait_for(page, charts_at_step(80), "the charts to show the run's history")
    wait_for(page, lambda d: text_of(d, "run-live") == "live", "the event stream to connect")

    api.store.rewind_metrics(run_id, 50)

    wait_for(page, charts_at_step(50), "the charts to drop the steps after the checkpoint")
    for chart in CHART_IDS:
        lines = SERIES_PER_CHART[chart]
        assert canvas_of(page, chart).get_attribute("data-points") == str(50 * lines)
    again = [{**metrics_record(s), "reward_mean": 0.99} for s in range(51, 56)]
    api.store.append_metrics(run_id, again)
    wait_for(page, charts_at_step(55), "the steps trained again to reach every chart")
    assert "reward mean 0.99" in page.find_element(By.ID, "chart-reward").text
    assert canvas_of(page, "reward").get_attribute("data-points") == str(
        55 * SERIES_PER_CHART["reward"]
    )


def test_text_from_the_store_is_shown_as_text(api: Api, page: WebDriver) -> None:
    markup = '<img src=x onerror="window.injected=1">'
    run = api.store.create_run({"name": markup})
    api.store.transition(run.id, "failed", f"crashed: {markup}")

    page.get(f"{api.url}/#{run.id}")

    wait_for(page, lambda d: text_of(d, "run-error") != "", "the run's error")
    assert text_of(page, "run-name") == markup
    assert text_of(page, "run-error") == f"crashed: {markup}"
    assert page.find_elements(By.CSS_SELECTOR, "main img, nav img") == []
    assert page.execute_script("return window.injected") is None


def test_a_run_that_declared_truncated_sampling_shows_it(api: Api, page: WebDriver) -> None:
    plain = add_run(api.store, "untruncated", 3)
    spec = {
        "name": "nucleus",
        "generation": {"top_p": 0.9, "top_k": 0},
        "algorithm": {
            "estimator": {"name": "kalman"},
            "off_policy": {"truncated_sampling": "allow"},
        },
    }
    run_id = api.store.create_run(spec).id

    page.get(f"{api.url}/#{run_id}")

    wait_for(page, lambda d: text_of(d, "run-name") == "nucleus", "the run's facts")
    facts = text_of(page, "run-facts")
    assert "truncated sampling" in facts and "allowed (top_p 0.9, top_k 0)" in facts
    # Validated as the API validates a submitted spec: unset, the mode resolves to replay.
    resolved = RunSpec.model_validate(
        {"name": "replayed", "generation": {"top_p": 0.95, "min_p": 0.05}}
    ).model_dump(mode="json")
    assert resolved["algorithm"]["off_policy"]["truncated_sampling"] == "replay"
    replayed = api.store.create_run(resolved)
    page.get(f"{api.url}/#{replayed.id}")
    wait_for(page, lambda d: text_of(d, "run-name") == "replayed", "the replayed run's facts")
    assert "replayed (top_p 0.95, top_k 0, min_p 0.05)" in text_of(page, "run-facts")
    page.get(f"{api.url}/#{plain}")
    wait_for(page, lambda d: text_of(d, "run-name") == "untruncated", "the other run's facts")
    assert "truncated sampling" not in text_of(page, "run-facts")


# The charts of a run with `algorithm.shadow` (dashboard.js, shadowChart): policy loss, clip
# fraction and switch frequency of the training estimator and of each shadow estimator.
SHADOW_CHARTS = ("shadow-loss", "shadow-clip", "shadow-switch")
SHADOW_LEGEND = """
const entries = document.querySelectorAll(`#chart-${arguments[0]} .legend span`);
return [...entries].map((entry) => entry.textContent);
"""


def test_shadow_estimators_are_drawn_beside_the_training_one(
    api: Api, page: WebDriver, tmp_path: Path
) -> None:
    plain = add_run(api.store, "no-shadows", 5)
    spec = {
        "name": "kpo-with-shadows",
        "algorithm": {"estimator": {"name": "kalman"}, "shadow": ["sequence", "token"]},
        "pipeline": {"mode": "async", "max_staleness": 2, "steps": 100},
    }
    run_id = api.store.create_run(spec).id
    api.store.transition(run_id, "running")
    records = []
    for step in range(1, 31):
        record = {**metrics_record(step), "policy_loss": -0.01 * step}
        for offset, name in enumerate(("sequence", "token"), start=1):
            record[f"shadow_{name}_policy_loss"] = -0.01 * step - 0.1 * offset
            record[f"shadow_{name}_clip_fraction"] = 0.1 * offset
            record[f"shadow_{name}_switch_frequency"] = 0.2 * offset
        records.append(record)
    api.store.append_metrics(run_id, records)

    page.get(f"{api.url}/#{run_id}")

    wait_for(page, charts_at_step(30), "the charts to show the run's history")
    for chart in SHADOW_CHARTS:
        assert page.find_element(By.ID, f"chart-{chart}").is_displayed(), chart
        canvas = canvas_of(page, chart)
        # The training estimator and the two shadow ones, every step: three lines.
        assert canvas.get_attribute("data-lines") == "3", chart
        assert canvas.get_attribute("data-points") == str(3 * 30), chart
    # Only the shadow estimators the run has are in the legend (in the dashboard's order of the
    # estimators), with their latest values.
    assert page.execute_script(SHADOW_LEGEND, "shadow-loss") == [
        "kalman (training) -0.3",
        "token -0.5",
        "sequence -0.4",
    ]
    assert page.execute_script(SHADOW_LEGEND, "shadow-clip")[1:] == ["token 0.2", "sequence 0.1"]
    assert page.execute_script(SHADOW_LEGEND, "shadow-switch")[1:] == [
        "token 0.4",
        "sequence 0.2",
    ]
    assert "shadow estimators" in text_of(page, "run-facts")
    assert "sequence, token" in text_of(page, "run-facts")  # as the spec lists them
    page.save_screenshot(str(tmp_path / "dashboard-shadow.png"))

    page.get(f"{api.url}/#{plain}")
    wait_for(page, charts_at_step(5), "the run without shadow estimators")
    for chart in SHADOW_CHARTS:
        assert not page.find_element(By.ID, f"chart-{chart}").is_displayed(), chart
    assert "shadow estimators" not in text_of(page, "run-facts")


def test_an_unknown_run_says_so(api: Api, page: WebDriver) -> None:
    page.get(f"{api.url}/#run-000000000000")

    wait_for(page, lambda d: "run-000000000000" in text_of(d, "run-error"), "the 404 message")
    assert text_of(page, "runs-message").startswith("No runs yet")


def test_page_asks_for_the_token_and_sends_it(
    page: WebDriver, api_factory: ApiFactory, tmp_path: Path
) -> None:
    with api_factory(KPO_API_TOKEN=TOKEN, KPO_AUTH_READS="true") as secured:
        run_id = add_run(secured.store, "guarded", 5)
        page.get(f"{secured.url}/#{run_id}")

        form = wait_for(page, lambda d: d.find_element(By.ID, "token-form"), "the token form")
        wait_for(page, lambda d: form.is_displayed(), "the token form to show")
        page.find_element(By.ID, "token-input").send_keys(TOKEN)
        page.find_element(By.CSS_SELECTOR, "#token-form button").click()

        wait_for(page, charts_at_step(5), "the charts, read with the token")
        stored = page.execute_script("return sessionStorage.getItem('kpo.apiToken')")
        assert stored == TOKEN
        # The live stream carries the token too (EventSource could not).
        wait_for(page, lambda d: text_of(d, "run-live") == "live", "the event stream")
        secured.store.append_metrics(run_id, [metrics_record(6)])
        wait_for(page, charts_at_step(6), "a live record through the guarded stream")
        page.save_screenshot(str(tmp_path / "dashboard-token.png"))
        page.get("about:blank")


def test_stream_resumes_after_the_last_event_across_a_restart(
    page: WebDriver, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    after_ids = _record_event_reads(store)
    run_id = add_run(store, "restarted", 10)
    app = create_app(ApiSettings(KPO_DATA_DIR=str(tmp_path)), store, RecordingLauncher())
    port = _free_port()

    with _serve(app, port) as url:
        page.get(f"{url}/#{run_id}")
        wait_for(page, lambda d: text_of(d, "run-live") == "live", "the event stream")
        wait_for(page, charts_at_step(10), "the history")
        last_seen = store.read_events(run_id, limit=1000)[-1].id
    # The control plane is down: the page retries while records keep arriving.
    wait_for(page, lambda d: text_of(d, "run-live").startswith("reconnecting"), "the outage")
    store.append_metrics(run_id, [metrics_record(11), metrics_record(12)])
    after_ids.clear()

    with _serve(app, port):
        wait_for(page, charts_at_step(12), "the records written during the outage")

        assert canvas_of(page, "entropy").get_attribute("data-points") == "12"  # none twice
        page.get("about:blank")
    assert after_ids and after_ids[0] == last_seen  # resumed after the last event it had


def _record_event_reads(store: Store) -> list[str | None]:
    """Remember the `after_id` of every event read (what the SSE route resumes from)."""
    after_ids: list[str | None] = []
    read_events = store.read_events

    def recorded(run_id: str, after_id: str | None = None, limit: int = 1000) -> Any:
        after_ids.append(after_id)
        return read_events(run_id, after_id, limit)

    store.read_events = recorded  # type: ignore[method-assign]
    return after_ids


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _serve(app: FastAPI, port: int) -> Iterator[str]:
    """uvicorn on `port`; on exit it cuts open streams after 1 s, as a restarting pod would."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"uvicorn on port {port}"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=WAIT_S)


# --- the stability guard's actions -----------------------------------------------------------

# The guard's markers of one chart (dashboard.js, renderMarks), read in one go: each one's step,
# action, tooltip and where it is over the canvas; and the chart's legend entries of actions.
CHART_MARKS = """
const figure = document.getElementById(`chart-${arguments[0]}`);
return {
  marks: [...figure.querySelectorAll(".marks .mark")].map((mark) => ({
    step: Number(mark.dataset.step),
    action: mark.dataset.action,
    title: mark.title,
    shown: !mark.hidden,
    left: mark.offsetLeft,
  })),
  legend: [...figure.querySelectorAll(".legend .legend-mark")].map((entry) => entry.textContent),
};
"""
# How many of a canvas's opaque pixels have the colour arguments[1] (an "#rrggbb").
PIXELS_OF = """
const canvas = document.querySelector(`#chart-${arguments[0]} canvas`);
const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
const [r, g, b] = arguments[1].match(/[0-9a-f]{2}/gi).map((hex) => parseInt(hex, 16));
let pixels = 0;
for (let i = 0; i < data.length; i += 4) {
  const near = Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b);
  if (data[i + 3] > 240 && near < 24) pixels += 1;
}
return pixels;
"""
ROLLBACK_COLOUR = "#d32f2f"  # dashboard.js, MARK_STYLES


def guard_action(step: int, action: str, reason: str, **more: Any) -> dict[str, Any]:
    """A `guard.action` event's data, as the driver reports it (driver.py, _guard_details; the
    message as services/pipeline/guard.py's GuardDecision words it)."""
    return {
        "action": action,
        "reason": reason,
        "step": step,
        "since": step - 3,
        "key": "entropy",
        "value": 0.01,
        "bound": 0.05,
        "rollbacks": 1 if action == "rollback" else 0,
        "message": (
            f"step {step}: {action}: {reason} broken since step {step - 3}: "
            "entropy 0.01 (limit 0.05, bound 0.05)"
        ),
        **more,
    }


def alert_action(step: int, action: str, alertname: str, key: str, summary: str) -> dict[str, Any]:
    """A `guard.action` event's data that answers an alert (driver.py, _answer_alerts)."""
    return {
        **guard_action(step, action, f"alert {alertname}"),
        "key": None,
        "value": None,
        "bound": None,
        "message": f"step {step}: {action}: alert {alertname}",
        "alert": key,
        "summary": summary,
    }


def chart_marks(driver: WebDriver, chart: str) -> dict[str, Any]:
    marks: dict[str, Any] = driver.execute_script(CHART_MARKS, chart)
    return marks


def marked(expected: list[tuple[int, str]]) -> Callable[[WebDriver], bool]:
    """Every chart shows exactly these (step, action) markers, placed over its canvas."""

    def check(driver: WebDriver) -> bool:
        for chart in CHART_IDS:
            marks = chart_marks(driver, chart)["marks"]
            if [(m["step"], m["action"]) for m in marks] != expected:
                return False
            if not all(m["shown"] for m in marks):
                return False
        return True

    return check


def test_guard_actions_are_marked_on_every_chart_and_a_pause_shows_until_resumed(
    api: Api, page: WebDriver, tmp_path: Path
) -> None:
    store = api.store
    run_id = add_run(store, "guarded-kpo", 40)
    # Events from before the page opened: the stream gives them from the run's first event.
    store.append_event(run_id, "guard.action", guard_action(12, "warn", "entropy_floor"))
    store.append_event(run_id, "guard.action", guard_action(25, "rollback", "reward_drop"))
    alert = {
        "alertname": "KpoSwitchHigh",
        "fingerprint": "f00d",
        "starts_at": "2024-01-01T00:00:00",
    }
    store.append_event(
        run_id,
        "alert",
        {
            **alert,
            "status": "firing",
            "action": "pause",
            "severity": "page",
            "summary": "switching",
        },
    )
    pause = alert_action(40, "pause", "KpoSwitchHigh", "f00d@2024-01-01T00:00:00", "switching")
    store.append_event(run_id, "guard.action", pause)
    store.append_event(run_id, "guard.paused", {**pause, "checkpoint": 40})
    # A restarted driver announces its pause again: still one marker.
    store.append_event(run_id, "guard.action", pause)

    page.get(f"{api.url}/#{run_id}")

    wait_for(page, charts_at_step(40), "the history")
    expected = [(12, "warn"), (25, "rollback"), (40, "pause")]
    wait_for(page, marked(expected), "a marker per action on every chart")
    reward = chart_marks(page, "reward")
    left = [m["left"] for m in reward["marks"]]
    assert left == sorted(left) and len(set(left)) == 3, left  # in step order along the axis
    titles = [m["title"] for m in reward["marks"]]
    # Each says why: the guard's message without the step and action it starts with.
    bounds = "entropy 0.01 (limit 0.05, bound 0.05)"
    assert titles == [
        f"warn at step 12: entropy_floor broken since step 9: {bounds}",
        f"rollback at step 25: reward_drop broken since step 22: {bounds}",
        "pause at step 40: alert KpoSwitchHigh (switching)",
    ]
    assert reward["legend"] == ["\u25b2warn", "\u25c0rollback", "\u2016pause"]
    assert page.execute_script(PIXELS_OF, "reward", ROLLBACK_COLOUR) >= 20  # its line is drawn
    paused = "paused at step 40: alert KpoSwitchHigh (switching)"
    wait_for(page, lambda d: paused in text_of(d, "run-facts"), "the pause in the run's facts")
    page.save_screenshot(str(tmp_path / "dashboard-guard.png"))

    wait_for(page, lambda d: text_of(d, "run-live") == "live", "the event stream")
    store.append_event(run_id, "resume", {"spec_patch": {}, "requested_at": 1.0, "checkpoint": 40})
    wait_for(
        page,
        lambda d: f"{paused} (resume requested)" in text_of(d, "run-facts"),
        "the resume request",
    )
    store.append_event(
        run_id, "guard.resumed", {"checkpoint": 40, "spec_patch": {}, "in_force": {}}
    )
    wait_for(page, lambda d: "paused" not in text_of(d, "run-facts"), "the pause to end")

    # Actions and alerts that come while the page is open are marked as they come: a warning
    # alert where the run is (its last record), and a cancel.
    store.append_metrics(run_id, [metrics_record(41), metrics_record(42)])
    store.append_event(
        run_id,
        "alert",
        {**alert, "status": "firing", "action": "warn", "severity": "info", "summary": "again"},
    )
    store.append_event(run_id, "guard.action", guard_action(43, "cancel", "reward_drop"))
    wait_for(page, marked([*expected, (42, "warn"), (43, "cancel")]), "the live actions marked")
    assert chart_marks(page, "entropy")["marks"][3]["title"] == (
        "warn at step 42: alert KpoSwitchHigh: again"
    )
    assert chart_marks(page, "entropy")["legend"] == [
        "\u25b2warn \u00d72",
        "\u25c0rollback",
        "\u2016pause",
        "\u2715cancel",
    ]


def test_a_finished_run_shows_its_guard_actions_and_no_pause(api: Api, page: WebDriver) -> None:
    """A finished run is not followed; its stream is read once, for the guard's events."""
    store = api.store
    run_id = add_run(store, "stopped", 30)
    store.append_event(run_id, "guard.action", guard_action(18, "checkpoint", "switch_rise"))
    pause = guard_action(22, "pause", "switch_rise")
    store.append_event(run_id, "guard.action", pause)
    store.append_event(run_id, "guard.paused", {**pause, "checkpoint": 22})
    store.transition(run_id, "cancelled")  # cancelled while paused
    other = add_run(store, "unguarded", 12, status="succeeded", offset=0.2)

    page.get(f"{api.url}/#{run_id}")

    wait_for(page, charts_at_step(30), "the history")
    wait_for(page, marked([(18, "checkpoint"), (22, "pause")]), "the markers of a finished run")
    assert text_of(page, "run-live") == "finished"
    assert "paused" not in text_of(page, "run-facts")

    # Compared with another run, the markers stay, each naming its run.
    page.get(f"{api.url}/?compare={run_id},{other}")
    wait_for(page, charts_compare({run_id: 30, other: 12}), "the comparison")
    wait_for(page, marked([(18, "checkpoint"), (22, "pause")]), "the markers in the comparison")
    titles = [m["title"] for m in chart_marks(page, "clip")["marks"]]
    assert [t.split(": ")[0] for t in titles] == [run_id, run_id], titles
    assert page.find_elements(By.CSS_SELECTOR, f'#chart-clip .mark[data-run-id="{run_id}"]')


# --- comparing runs --------------------------------------------------------------------------

# What a compared chart shows, read in one go (the page may redraw between two WebDriver calls):
# its legend's run entries, each with its text and swatch colour, and how many of the canvas's
# opaque pixels have that colour (a line drawn in it leaves some, anti-aliasing aside).
COMPARED_CHART = """
const figure = document.getElementById(`chart-${arguments[0]}`);
const canvas = figure.querySelector("canvas");
const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
return [...figure.querySelectorAll(".legend-run")].map((entry) => {
  const colour = getComputedStyle(entry.querySelector(".swatch")).backgroundColor;
  const [r, g, b] = colour.match(/\\d+/g).map(Number);
  let pixels = 0;
  for (let i = 0; i < data.length; i += 4) {
    const near = Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b);
    if (data[i + 3] > 240 && near < 24) pixels += 1;
  }
  return { run: entry.dataset.runId, text: entry.textContent, colour, pixels };
});
"""
# The compared runs' table, row by row, read in one go.
COMPARE_ROWS = """
return [...document.querySelectorAll("#compare-rows tr")].map((row) => ({
  run: row.dataset.runId,
  text: row.innerText,
  stream: row.querySelector("td.live").textContent,
  errors: [...row.querySelectorAll(".error")].map((e) => e.textContent),
}));
"""


def compare_box(driver: WebDriver, run_id: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, f'#run-list input[data-compare-id="{run_id}"]')


def tick(driver: WebDriver, run_id: str) -> None:
    """Click a run's compare checkbox (the list is rebuilt every few seconds: retry a stale one)."""

    def click(d: WebDriver) -> bool:
        compare_box(d, run_id).click()
        return True

    wait_for(driver, click, f"the compare checkbox of {run_id}")


def legend_steps(driver: WebDriver, chart: str) -> dict[str, str]:
    """The runs a compared chart's legend names, each with the last step it shows."""
    entries = driver.find_elements(By.CSS_SELECTOR, f"#chart-{chart} .legend-run")
    return {e.get_attribute("data-run-id"): e.get_attribute("data-last-step") for e in entries}


def charts_compare(
    steps: dict[str, int], without_data: tuple[str, ...] = ()
) -> Callable[[WebDriver], bool]:
    """Every chart overlays exactly these runs, each up to its step, one line per series each;
    the runs `without_data` are in the legends (with no step) but draw nothing."""
    wanted = {run_id: str(step) for run_id, step in steps.items()}
    wanted.update({run_id: "-1" for run_id in without_data})

    def check(driver: WebDriver) -> bool:
        if not driver.find_element(By.ID, "compare").is_displayed():
            return False
        for chart in CHART_IDS:
            canvas = canvas_of(driver, chart)
            if (
                legend_steps(driver, chart) != wanted
                or canvas.get_attribute("data-runs") != ",".join(steps)
                or canvas.get_attribute("data-lines") != str(SERIES_PER_CHART[chart] * len(steps))
            ):
                return False
        return True

    return check


def compare_rows(driver: WebDriver) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = driver.execute_script(COMPARE_ROWS)
    return rows


def stream_states(driver: WebDriver) -> list[str]:
    """The Stream column of the compared runs' table, row by row."""
    return [row["stream"] for row in compare_rows(driver)]


def assert_each_run_is_drawn_in_its_colour(driver: WebDriver, estimators: dict[str, str]) -> None:
    for chart in CHART_IDS:
        entries = driver.execute_script(COMPARED_CHART, chart)
        assert [e["run"] for e in entries] == list(estimators), f"{chart}: {entries}"
        for entry, (run_id, estimator) in zip(entries, estimators.items(), strict=True):
            assert entry["text"].startswith(f"{run_id} ({estimator}) "), entry
            assert entry["pixels"] >= 20, f"{chart}: no line in the colour of {run_id}: {entries}"
        colours = [e["colour"] for e in entries]
        assert len(set(colours)) == len(colours), f"{chart}: runs share a colour: {colours}"


def test_compared_runs_overlay_on_every_chart_and_survive_a_reload(
    api: Api, page: WebDriver, tmp_path: Path
) -> None:
    kalman = add_run(api.store, "kpo-kalman", 60, estimator="kalman")
    token = add_run(api.store, "kpo-token", 40, estimator="token", offset=0.3)
    alone = add_run(api.store, "unrelated", 10, status="succeeded")
    page.get(f"{api.url}/#{alone}")
    wait_for(page, charts_at_step(10), "the single run first")
    assert legend_steps(page, "reward") == {}  # one run: the single-run legend, no run entries

    tick(page, kalman)
    # One tick keeps the single run; the second one overlays the two.
    assert text_of(page, "run-name") == "unrelated"
    tick(page, token)

    wait_for(page, charts_compare({kalman: 60, token: 40}), "both runs on every chart")
    assert not page.find_element(By.ID, "run").is_displayed()
    assert page.current_url == f"{api.url}/?compare={kalman},{token}#{alone}"
    assert_each_run_is_drawn_in_its_colour(page, {kalman: "kalman", token: "token"})
    rows = compare_rows(page)
    assert [row["run"] for row in rows] == [kalman, token]
    assert "kpo-kalman" in rows[0]["text"] and "kpo-token" in rows[1]["text"]
    page.save_screenshot(str(tmp_path / "dashboard-compare.png"))

    # Both runs are running: each follows its own event stream.
    wait_for(page, lambda d: stream_states(d) == ["live", "live"], "both runs' event streams")
    api.store.append_metrics(token, [metrics_record(41, 0.3)])
    wait_for(page, charts_compare({kalman: 60, token: 41}), "a live record of the second run")

    page.refresh()

    wait_for(page, charts_compare({kalman: 60, token: 41}), "the comparison after a reload")
    assert_each_run_is_drawn_in_its_colour(page, {kalman: "kalman", token: "token"})
    wait_for(
        page,
        lambda d: (
            [compare_box(d, r).is_selected() for r in (kalman, token, alone)] == [True, True, False]
        ),
        "the ticks restored",
    )

    # Unticking one run leaves one: the page shows the run of the address's #fragment again.
    tick(page, token)
    wait_for(page, charts_at_step(10), "the single run again")
    assert text_of(page, "run-name") == "unrelated"
    assert not page.find_element(By.ID, "compare").is_displayed()
    assert page.current_url == f"{api.url}/?compare={kalman}#{alone}"


def test_opening_one_run_leaves_the_comparison(api: Api, page: WebDriver) -> None:
    first = add_run(api.store, "first", 12, status="succeeded", estimator="geometric")
    second = add_run(api.store, "second", 8, status="failed", offset=0.2)
    # Ids that are no run id are dropped; an unknown run is shown with its error.
    missing = "run-000000000000"
    page.get(f"{api.url}/?compare={first},{second},../x,{missing}")

    wait_for(
        page, charts_compare({first: 12, second: 8}, (missing,)), "the comparison from the address"
    )
    wait_for(page, lambda d: stream_states(d) == ["finished", "finished", ""], "the run states")
    rows = compare_rows(page)
    assert [row["run"] for row in rows] == [first, second, missing]
    assert len(rows[2]["errors"]) == 1 and missing in rows[2]["errors"][0]  # its 404
    assert rows[1]["errors"] == ["<b>boom</b>"]  # the run's error, as text
    assert rows[0]["errors"] == []

    page.find_element(By.CSS_SELECTOR, f'#run-list a[data-run-id="{second}"]').click()

    wait_for(page, charts_at_step(8), "the run opened alone")
    assert text_of(page, "run-name") == "second"
    assert page.current_url == f"{api.url}/#{second}"
    wait_for(
        page,
        lambda d: (
            not any(b.is_selected() for b in d.find_elements(By.CSS_SELECTOR, ".compare-box"))
        ),
        "no run ticked",
    )
    assert text_of(page, "compare-hint").startswith("Tick two")


# --- the router alone (no browser) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/", "text/html; charset=utf-8"),
        ("/static/dashboard.js", "text/javascript; charset=utf-8"),
        ("/static/dashboard.css", "text/css; charset=utf-8"),
    ],
)
def test_files_are_served_with_their_types(path: str, content_type: str) -> None:
    response = _client().get(path)
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    assert response.headers["x-content-type-options"] == "nosniff"


def test_the_page_may_only_run_its_own_script() -> None:
    policy = _client().get("/").headers["content-security-policy"]
    assert "script-src 'self'" in policy
    assert "connect-src 'self'" in policy


@pytest.mark.parametrize(
    "path",
    [
        "/static/../prometheus.py",
        "/static/..%2Fprometheus.py",
        "/static/%2E%2E/dashboard.py",
        "/static/dashboard.py",
        "/static/",
        "/static/.hidden.js",
        "/static/%2Fetc%2Fpasswd",
        "/static/index.html%00.js",
    ],
)
def test_no_other_file_is_reachable(path: str) -> None:
    response = _client().get(path)
    assert response.status_code == 404
    assert "import" not in response.text


def _client() -> TestClient:
    app = FastAPI()
    app.include_router(dashboard.router)
    return TestClient(app)
