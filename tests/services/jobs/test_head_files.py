"""The local head's files and the launcher's settings, without a Ray head: the head's directory
is this user's only, its record is validated on read (a clear error naming the file and key,
never a traceback), and the job settings the Helm chart sets reach the launcher."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from services.cli import app
from services.jobs.launcher import (
    RayJobLauncher,
    job_id,
    launcher_from_env,
    parse_job_id,
)
from services.jobs.ray_head import (
    HEAD_DIR,
    HEAD_FILE,
    HeadFileError,
    HeadInfo,
    LocalRayHead,
    private_dir,
    read_head_file,
)
from services.jobs.settings import JobSettings

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()
AS_ROOT = os.geteuid() == 0


def record(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    """A record as `LocalRayHead` writes it, with `changes`; its token file exists (0600)."""
    token = tmp_path / "token"
    if not token.exists():
        token.write_text("0" * 64)
        token.chmod(0o600)
    data: dict[str, Any] = {
        "address": "192.0.2.2:6379",
        "dashboard_url": "http://127.0.0.1:8265",
        "temp_dir": "/tmp/kr-x",
        "pgid": 4242,
        "token_file": str(token),
    }
    return {**data, **changes}


def write(path: Path, content: Any, mode: int = 0o600) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    path.chmod(mode)
    return path


def refused(path: Path) -> str:
    with pytest.raises(HeadFileError) as raised:
        read_head_file(path)
    message = str(raised.value)
    assert str(path) in message, message  # every error names the file
    return message


def test_a_well_formed_record_is_read_and_a_missing_one_is_none(tmp_path: Path) -> None:
    assert read_head_file(tmp_path / "none.json") is None
    data = record(tmp_path)
    assert read_head_file(write(tmp_path / "head.json", data)) == HeadInfo(**data)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "not the JSON record of a Ray head"),
        (b"\xff\xfe", "not the JSON record of a Ray head"),
        ([1, 2], "holds a JSON list, not the record of a Ray head"),
        ({"foreign": 1}, "unknown key 'foreign'"),
        ("pgid", "key 'pgid' is missing"),
        ({"pgid": "4242"}, "key 'pgid' must be an integer, not \"4242\""),
        ({"pgid": True}, "key 'pgid' must be an integer, not true"),
        ({"address": 6379}, "key 'address' must be a string, not 6379"),
        ({"dashboard_url": "http://10.0.0.9:8265"}, "key 'dashboard_url' must be http://127.0"),
        ({"dashboard_url": "http://127.0.0.1.evil:80"}, "key 'dashboard_url' must be"),
        ({"pgid": 0}, "key 'pgid' must be a process group id >= 2"),
        ({"pgid": 1}, "key 'pgid' must be a process group id >= 2"),
        ({"temp_dir": "relative/dir"}, "key 'temp_dir' must be an absolute path"),
    ],
)
def test_a_malformed_or_foreign_record_is_refused_naming_the_file_and_key(
    tmp_path: Path, content: Any, expected: str
) -> None:
    if isinstance(content, dict):
        content = record(tmp_path, **content)
    elif content == "pgid":
        content = {k: v for k, v in record(tmp_path).items() if k != "pgid"}
    message = refused(write(tmp_path / "head.json", content))
    assert expected in message and "remove it to have a new Ray head started" in message


def test_a_record_others_may_write_or_that_is_a_link_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "head.json", record(tmp_path), mode=0o664)
    assert "mode 0664: its group or others may write it" in refused(path)
    path.chmod(0o646)
    assert "mode 0646" in refused(path)
    path.chmod(0o644)  # others may read it: it holds no secret
    assert read_head_file(path) is not None
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert "is it a link?" in refused(link)


def test_a_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "head.json", record(tmp_path))
    (tmp_path / "token").chmod(0o640)
    message = refused(path)
    assert str(tmp_path / "token") in message and "may read or write it" in message


@pytest.mark.skipif(not AS_ROOT, reason="giving a file to another user takes root")
def test_a_record_or_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "head.json", record(tmp_path))
    os.chown(path, 65534, 65534)
    assert "it belongs to uid 65534, not to this user (uid 0)" in refused(path)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(HeadFileError, match="belongs to uid 65534"):
        private_dir(foreign)


def test_the_heads_directory_is_made_0700_and_checked_when_it_exists(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        made = private_dir(tmp_path / "made")
    finally:
        os.umask(old)
    assert made.stat().st_mode & 0o777 == 0o700
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    assert private_dir(readable).stat().st_mode & 0o777 == 0o700  # tightened
    writable = tmp_path / "writable"
    writable.mkdir()
    writable.chmod(0o777)
    with pytest.raises(HeadFileError, match="mode 0777 lets its group or others write in it"):
        private_dir(writable)
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(HeadFileError, match="not a directory"):
        private_dir(link)


def test_a_bad_record_stops_ensure_before_anything_starts(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    head = LocalRayHead(data_dir, temp_dir=tmp_path / "ray")
    data_dir.mkdir()
    private_dir(data_dir / HEAD_DIR)
    write(data_dir / HEAD_FILE, record(tmp_path, pgid="x"))
    with pytest.raises(HeadFileError, match="key 'pgid' must be an integer"):
        head.ensure()
    assert not (tmp_path / "ray").exists()  # no `ray start` was run


def kpo(*args: str, **env: str | None) -> Any:
    return runner.invoke(app, list(args), env={"RAY_ADDRESS": None, **env})


def test_serve_stop_reports_a_bad_record_in_one_line(tmp_path: Path) -> None:
    (tmp_path / HEAD_DIR).mkdir(mode=0o700)
    write(tmp_path / HEAD_FILE, record(tmp_path, foreign="x"))
    result = kpo("serve", "--stop", KPO_DATA_DIR=str(tmp_path))
    assert result.exit_code == 1
    assert result.output.startswith("error: cannot stop the local Ray head: ")
    assert f"{tmp_path / HEAD_FILE}: unknown key 'foreign'" in result.output
    assert "Traceback" not in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


def test_serve_reports_a_bad_record_in_one_line_and_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / HEAD_DIR).mkdir(mode=0o700)
    write(tmp_path / HEAD_FILE, record(tmp_path, dashboard_url="http://10.1.2.3:8265"))
    env = {"KPO_DATA_DIR": str(tmp_path), "KPO_API_TOKEN": None, "KPO_API_TOKEN_FILE": None}
    result = kpo("serve", "--port", "1", KPO_STORE_URL=None, KPO_METRICS_PORT=None, **env)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: cannot set up Ray: {tmp_path / HEAD_FILE}: ")
    assert "key 'dashboard_url' must be http://127.0.0.1:PORT" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_serve_stop_without_a_head_or_with_a_cluster(tmp_path: Path) -> None:
    result = kpo("serve", "--stop", KPO_DATA_DIR=str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.output == f"[kpo] no local Ray head is running for {tmp_path.resolve()}\n"
    result = kpo("serve", "--stop", KPO_DATA_DIR=str(tmp_path), RAY_ADDRESS="head:6379")
    assert result.exit_code == 2
    assert "RAY_ADDRESS names a Ray cluster" in result.output


# --- the job settings ------------------------------------------------------------------------


def settings(env: dict[str, str]) -> JobSettings:
    """JobSettings of exactly `env`, whatever this process's environment holds."""
    return JobSettings.model_validate(env)


def test_job_settings_defaults_and_the_charts_values() -> None:
    default = settings({})
    assert default.pass_store_url_to_jobs is True and default.ray_driver_resource is None
    assert default.ray_driver_cpus == 0.0 and default.driver_restarts == 2
    chart = settings(
        {
            "KPO_PASS_STORE_URL_TO_JOBS": "false",
            "KPO_RAY_DRIVER_RESOURCE": "kpo_driver",
            "KPO_RAY_DRIVER_CPUS": "0.25",
            "KPO_DRIVER_RESTARTS": "0",
        }
    )
    assert chart.pass_store_url_to_jobs is False and chart.ray_driver_resource == "kpo_driver"
    assert chart.ray_driver_cpus == 0.25 and chart.driver_restarts == 0
    for bad in (
        {"KPO_RAY_DRIVER_RESOURCE": "CPU"},
        {"KPO_DRIVER_RESTARTS": "-1"},
        {"KPO_RAY_DRIVER_CPUS": "-0.5"},
    ):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            settings(bad)


def test_the_launcher_on_a_cluster_takes_the_job_settings(tmp_path: Path) -> None:
    """What `kpo serve` makes of the chart's variables (no server is contacted)."""
    env = {
        "RAY_ADDRESS": "http://127.0.0.1:9",
        "KPO_PASS_STORE_URL_TO_JOBS": "false",
        "KPO_RAY_DRIVER_RESOURCE": "kpo_driver",
        "KPO_RAY_DRIVER_CPUS": "0.5",
        "KPO_DRIVER_RESTARTS": "1",
    }
    store_url = "redis://:secret@redis:6379/0"
    launcher = launcher_from_env(tmp_path, store_url, settings(env))
    assert launcher.driver_resource == "kpo_driver" and launcher.driver_cpus == 0.5
    assert launcher.driver_restarts == 1
    assert "KPO_STORE_URL" not in launcher.job_env()
    assert "secret" not in json.dumps(launcher.job_env())
    default = launcher_from_env(tmp_path, store_url, settings({"RAY_ADDRESS": env["RAY_ADDRESS"]}))
    assert default.job_env()["KPO_STORE_URL"] == store_url and default.driver_resource is None
    passing = RayJobLauncher("http://127.0.0.1:9", tmp_path, store_url)
    assert passing.job_env()["KPO_STORE_URL"] == store_url


def test_job_ids_of_a_runs_attempts() -> None:
    run_id = "run-0123456789ab"
    assert [job_id(run_id, n) for n in range(3)] == [run_id, f"{run_id}.r1", f"{run_id}.r2"]
    for attempt in (0, 1, 12):
        assert parse_job_id(job_id(run_id, attempt)) == (run_id, attempt)
    for other in ("raysubmit_abc", f"{run_id}.r0", f"{run_id}.r01", f"{run_id}.x1", "run-1"):
        assert parse_job_id(other) is None
