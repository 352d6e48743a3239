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
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.command import Command
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from services.api import dashboard
from services.api.app import create_app
from services.api.settings import ApiSettings
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
WAIT_S = 20


def metrics_record(step: int) -> dict[str, Any]:
    """A plausible learner step: reward rising with noise, entropy falling, KPO-like ratios."""
    noise = math.sin(step * 1.7) * 0.08 + math.sin(step * 0.37) * 0.05
    return {
        "step": step,
        "time": 1_700_000_000.0 + step,
        "policy_version": float(step),
        "reward_mean": min(1.0, 0.15 + 0.012 * step + noise),
        "entropy": 0.9 * math.exp(-step / 40) + 0.1 + noise / 10,
        "clip_fraction": 0.002 + abs(noise) / 20,
        "staleness_mean": 0.8 + noise * 3,
        "staleness_max": float(math.ceil(0.8 + noise * 3 + 0.5)),
        "raw_switch_frequency": 0.28 + noise,
        "filtered_switch_frequency": 0.02 + noise / 10,
        "raw_low_frequency_ratio": 0.1 + noise / 4,
        "filtered_low_frequency_ratio": 0.85 + noise / 3,
        "step_seconds": 0.6,
        "tokens_generated_total": 2000 * step,
    }


def add_run(store: Store, name: str, steps: int, status: str = "running") -> str:
    spec = {
        "name": name,
        "algorithm": {"estimator": {"name": "kalman"}},
        "pipeline": {"mode": "async", "max_staleness": 2, "steps": 100},
    }
    run_id = store.create_run(spec).id
    store.transition(run_id, "running")
    store.append_metrics(run_id, [metrics_record(s) for s in range(1, steps + 1)])
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
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition, message=what)


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
        lines = 1 if chart in ("entropy", "clip") else 2
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
