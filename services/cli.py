"""The `kpo` command line."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, cast

import typer
import yaml
from pydantic import ValidationError

import kpo_core
from kpo_core.config import AlgorithmConfig, describe_validation_error
from services.api.client import DEFAULT_SERVER, ApiClient, ApiError, ServerUnreachable
from services.api.settings import ApiSettings, ClientSettings
from services.observers import RunState
from services.pipeline.outputs import (
    CONFIG_FILE,
    STATUS_FILE,
    ProgressPrinter,
    RunDirectory,
    format_progress_line,
    format_status_line,
)
from services.pipeline.specs import (
    SpecError,
    load_run_spec,
    parse_run_spec,
    preflight,
    read_yaml_mapping,
)
from services.spec import RunSpec, SpecPatchError
from services.store import (
    RunNotFound,
    Store,
    StoreError,
    StoreUnavailable,
    open_store,
)
from services.store.base import METRICS_REWOUND_EVENT, RUN_ID_PATTERN
from services.store.factory import DEFAULT_DATA_DIR

if TYPE_CHECKING:
    from services.jobs.settings import JobSettings

app = typer.Typer(help="KPO-RL: asynchronous RL for LLMs with Kalman-filtered ratios.")
config_app = typer.Typer(help="Inspect and validate configuration files.")
app.add_typer(config_app, name="config")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a user-facing error (no traceback) and exit with `code` (2: bad input)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=code)


def load_yaml_mapping(path: Path) -> dict[str, object]:
    """Parse a YAML file that must hold a mapping; errors name the file (and line)."""
    try:
        return read_yaml_mapping(path)
    except SpecError as error:
        fail(str(error))


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(kpo_core.__version__)


@config_app.command("check")
def check_algorithm(
    path: Annotated[Path, typer.Argument(help="YAML file with an algorithm config")],
) -> None:
    """Validate an algorithm config file and print it resolved, with every default filled in."""
    data = load_yaml_mapping(path)
    try:
        config = AlgorithmConfig.model_validate(data)
    except ValidationError as error:
        fail(describe_validation_error(error, str(path)))
    typer.echo(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), nl=False)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
EXIT_CODES: dict[RunState, int] = {"succeeded": 0, "failed": 1, "cancelled": 130}


def _execute(spec: RunSpec, run_dir: RunDirectory) -> None:
    """Run `spec` into `run_dir` with progress lines; exit with the run's outcome."""
    # Imported here: Ray and the actors' modules are slow to import and `config check` and
    # `version` do not need them.
    from services.pipeline.launch import ERROR_FILE, execute_run

    try:
        state = execute_run(
            spec,
            run_dir,
            [ProgressPrinter(spec.pipeline.steps)],
            announce=lambda: typer.echo(f"[kpo] run {spec.name!r} -> {run_dir.path}"),
        )
    except Exception as error:
        trace = run_dir.path / ERROR_FILE
        fail(
            f"run failed: {type(error).__name__}: {error} (traceback in {trace})",
            EXIT_CODES["failed"],
        )
    records = run_dir.read_metrics()
    if records:
        last = records[-5:]
        reward = sum(r["reward_mean"] for r in last) / len(last)
        typer.echo(
            f"[kpo] {state} at step {records[-1]['step']}: mean reward of the last {len(last)} "
            f"steps {reward:.3f}; curves: {run_dir.curves}"
        )
        if "guard_actions_total" in records[-1]:  # a run with the stability guard
            typer.echo(
                f"[kpo] stability guard: {records[-1]['guard_actions_total']} actions, "
                f"{records[-1]['guard_rollbacks']} rollbacks, broken objectives at "
                f"{sum(1 for r in records if r['guard_broken_objectives'])} steps"
            )
    raise typer.Exit(code=EXIT_CODES[state])


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="YAML run file (a RunSpec)")],
    out: Annotated[
        Path | None, typer.Option(help="output directory; default runs/<name>-<time>")
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="override a key of the file: --set pipeline.steps=20"),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option(help="validate and print the resolved spec, then exit")
    ] = False,
) -> None:
    """Run RL from a YAML run file on a local Ray instance (or the cluster at RAY_ADDRESS)."""
    try:
        spec = load_run_spec(config, overrides or [])
        preflight(spec, str(config))
    except SpecError as error:
        fail(str(error))
    resolved = spec.model_dump(mode="json")
    if dry_run:
        typer.echo(yaml.safe_dump(resolved, sort_keys=False), nl=False)
        return
    out = out or Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out / CONFIG_FILE).exists():
        fail(
            f"{out} already holds a run; continue it with `kpo resume {out}` or pick another --out"
        )
    run_dir = RunDirectory(out)
    run_dir.write_config(resolved)
    _execute(spec, run_dir)


@app.command()
def resume(
    out: Annotated[Path, typer.Argument(help="output directory of an earlier run")],
    steps: Annotated[
        int | None, typer.Option(min=1, help="new total of learner steps (to extend a run)")
    ] = None,
) -> None:
    """Continue a run from its newest complete checkpoint, with the spec it was started with."""
    config_path = out / CONFIG_FILE
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fail(f"{config_path}: no such file; is {out} the output directory of a run?")
    except (OSError, ValueError) as error:
        fail(f"{config_path}: cannot read: {error}")
    if steps is not None:
        data["pipeline"]["steps"] = steps
    try:
        spec = parse_run_spec(data, str(config_path))
        preflight(spec, str(config_path))
    except SpecError as error:
        fail(str(error))
    run_dir = RunDirectory(out)
    run_dir.write_config(spec.model_dump(mode="json"))
    _execute(spec, run_dir)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="output directory of a run")],
    step: Annotated[
        int | None,
        typer.Option(min=0, help="export this step's checkpoint; default the newest complete one"),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="where to write the model; default RUN_DIR/model")
    ] = None,
) -> None:
    """Export a run's checkpoint as a Hugging Face model directory (safetensors, tokenizer)."""
    # Imported here: torch and transformers are slow to import and other commands do not need them.
    from services.learner.export import ExportError
    from services.pipeline.run_export import export_run

    try:
        path = export_run(run_dir, out, step)
    except ExportError as error:
        fail(str(error))
    except OSError as error:
        fail(f"cannot export {run_dir}: {error}", 1)
    typer.echo(f"[kpo] exported {run_dir} -> {path} (loads with from_pretrained and vLLM)")


@app.command(hidden=True)
def execute(
    run_id: Annotated[str, typer.Argument(help="id of a stored run")],
    data_dir: Annotated[
        Path, typer.Option(envvar="KPO_DATA_DIR", help="runs go to DATA_DIR/runs/RUN_ID")
    ] = Path(DEFAULT_DATA_DIR),
    store_url: Annotated[
        str | None,
        typer.Option(envvar="KPO_STORE_URL", help="redis://... or a directory; default DATA_DIR"),
    ] = None,
) -> None:
    """Run a stored run: the entrypoint of the Ray job the control plane submits for it."""
    import logging

    from services.pipeline.job import execute_stored_run

    # Warnings of the store (an outage, a write not stored) belong in the job's log.
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        store = open_store(store_url, data_dir)
    except ValueError as error:
        fail(str(error))
    try:
        state = execute_stored_run(store, run_id, data_dir)
    except RunNotFound as error:
        fail(str(error))
    except StoreUnavailable as error:
        fail(f"the store is unreachable: {error}", EXIT_CODES["failed"])
    finally:
        _close_quietly(store)
    raise typer.Exit(code=EXIT_CODES[state])


def _close_quietly(store: Store) -> None:
    """Close the store; writes it could not store by now are reported, not raised."""
    try:
        store.close()
    except StoreError as error:
        typer.echo(f"[kpo] warning: {error}", err=True)


# --- the control plane: serve it, and talk to it ------------------------------------------

ServerOption = Annotated[
    str, typer.Option("--server", envvar="KPO_SERVER", help="URL of the KPO control plane")
]


def _api_client(server: str) -> ApiClient:
    """A client of `server`, with the token of KPO_API_TOKEN (or the file KPO_API_TOKEN_FILE)."""
    settings = ClientSettings()
    try:
        token = settings.token()
    except OSError as error:
        fail(f"KPO_API_TOKEN_FILE {settings.api_token_file}: {error}")
    return ApiClient(server, token)


@contextmanager
def _reporting_api_errors() -> Iterator[None]:
    """API errors become one line and an exit code: 2 for a 4xx, 1 for the rest."""
    try:
        yield
    except ApiError as error:
        fail(str(error), 2 if error.status < 500 else 1)
    except ServerUnreachable as error:
        fail(str(error), 1)


@app.command()
def submit(
    config: Annotated[Path, typer.Argument(help="YAML run file (a RunSpec)")],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="override a key of the file: --set pipeline.steps=20"),
    ] = None,
    server: ServerOption = DEFAULT_SERVER,
    follow: Annotated[
        bool, typer.Option(help="print its progress until it ends; exit 0/1/130 by its outcome")
    ] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="resending with the same key never starts a second run")
    ] = None,
) -> None:
    """Submit a run file to the control plane; print the run's id."""
    try:
        spec = load_run_spec(config, overrides or [])
    except SpecError as error:
        fail(str(error))
    with _api_client(server) as client, _reporting_api_errors():
        run = client.create_run(spec.model_dump(mode="json"), idempotency_key)
        typer.echo(run["id"])
        if follow:
            _follow(client, run["id"], spec.pipeline.steps)


def _follow(client: ApiClient, run_id: str, total_steps: int) -> NoReturn:
    """Print the run's status changes and progress lines until it ends; exit by its outcome."""
    state: RunState = "queued"
    try:
        for event in client.follow(run_id):
            if event.kind == "status":
                state = cast(RunState, event.data.get("status"))
                typer.echo(format_status_line(state, event.data.get("error")))
            elif event.kind == "metrics":
                typer.echo(format_progress_line(event.data, total_steps))
            elif event.kind == METRICS_REWOUND_EVENT:
                typer.echo(
                    f"[kpo] resumed from the checkpoint of step {event.data.get('step')}: "
                    "the steps after it are trained again"
                )
    except KeyboardInterrupt:
        typer.echo(f"[kpo] stopped following {run_id}; it goes on (`kpo cancel {run_id}`)")
        raise typer.Exit(code=130) from None
    raise typer.Exit(code=EXIT_CODES.get(state, 1))


@app.command()
def runs(
    status: Annotated[
        str | None, typer.Option(help="only runs with this status, e.g. running")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=100, help="how many, newest first")] = 20,
    server: ServerOption = DEFAULT_SERVER,
) -> None:
    """List runs, newest first."""
    with _api_client(server) as client, _reporting_api_errors():
        page = client.list_runs(status, limit)
    for run in page["runs"]:  # summaries: the spec's name, not the spec
        name = run.get("name") or ""
        typer.echo(f"{run['id']}  {run['status']:<9}  {_when(run['created_at'])}  {name}")


@app.command()
def status(
    run_id: Annotated[str, typer.Argument(help="the run's id")],
    server: ServerOption = DEFAULT_SERVER,
    as_json: Annotated[bool, typer.Option("--json", help="print the run record as JSON")] = False,
) -> None:
    """Show a run: its status, every transition, and the error of a failed run."""
    with _api_client(server) as client, _reporting_api_errors():
        run = client.get_run(run_id)
    if as_json:
        typer.echo(json.dumps(run, indent=2))
        return
    typer.echo(f"{run['id']}  {run['status']}  {run['spec'].get('name', '')}")
    for transition in run["transitions"]:
        typer.echo(f"  {transition['status']:<9}  {_when(transition['at'])}")
    if run.get("error"):
        typer.echo(f"error: {run['error']}")
    stability = run["spec"].get("stability")
    if isinstance(stability, dict) and stability.get("enabled"):
        with _api_client(server) as client, _reporting_api_errors():
            guard = client.get_guard(run_id)
        for line in guard_lines(guard):
            typer.echo(line)


def guard_lines(guard: dict[str, Any]) -> list[str]:
    """What `kpo status` says of a run's stability guard (`GET /v1/runs/{id}/guard`)."""
    lines = [
        f"guard: action {guard.get('action')}, {guard['actions']} actions taken, "
        f"{guard['rollbacks']} rollbacks"
    ]
    paused = guard.get("paused")
    if paused:
        lines.append(
            f"guard: paused at step {paused.get('checkpoint')} by {paused.get('reason')} "
            f"(broken since step {paused.get('since')}): {paused.get('message')}"
        )
        lines.append(f"guard: resume it with `kpo resume-paused {guard['run_id']} [--patch FILE]`")
    elif guard.get("last_action"):
        last = guard["last_action"]
        lines.append(
            f"guard: not paused; last action at step {last.get('step')}: {last.get('message')}"
        )
    else:
        lines.append("guard: not paused")
    return lines


@app.command()
def cancel(
    run_id: Annotated[str, typer.Argument(help="the run's id")],
    server: ServerOption = DEFAULT_SERVER,
) -> None:
    """Cancel a run: a queued one at once, a running one after its current learner step."""
    with _api_client(server) as client, _reporting_api_errors():
        run = client.cancel_run(run_id)
    if run["status"] == "cancelled":
        typer.echo(f"{run_id}: cancelled")
    else:
        typer.echo(f"{run_id}: cancel requested; it stops after its current learner step")


@app.command("resume-paused")
def resume_paused(
    target: Annotated[
        str,
        typer.Argument(help="a run's id (resumed through the control plane), or a run directory"),
    ],
    patch: Annotated[
        Path | None,
        typer.Option(
            help="YAML or JSON file of the spec patch: learner.lr, pipeline.max_staleness and "
            "algorithm.estimator only (spec-shaped, e.g. `learner: {lr: 5.0e-7}`)"
        ),
    ] = None,
    server: ServerOption = DEFAULT_SERVER,
) -> None:
    """Resume a run its stability guard paused (stability.action: pause), with a spec patch."""
    spec_patch: dict[str, Any] = dict(load_yaml_mapping(patch)) if patch is not None else {}
    if set(spec_patch) == {"spec_patch"} and isinstance(spec_patch["spec_patch"], dict):
        spec_patch = spec_patch["spec_patch"]  # the API's body, as a file
    if RUN_ID_PATTERN.fullmatch(target) and not Path(target).is_dir():
        with _api_client(server) as client, _reporting_api_errors():
            client.resume_run(target, spec_patch)
        typer.echo(f"{target}: resume requested; it resumes within a second")
        return
    _request_local_resume(Path(target), spec_patch)


def _request_local_resume(run_dir: Path, spec_patch: dict[str, Any]) -> None:
    """Write RUN_DIR/resume.json for the run's driver, once the patch is checked."""
    from services.pipeline.pause import RESUME_FILE

    config_path = run_dir / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        details = json.loads((run_dir / STATUS_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as missing:
        fail(f"{missing.filename}: no such file; is {run_dir} the output directory of a run?")
    except (OSError, ValueError) as error:
        fail(f"{run_dir}: cannot read the run: {error}")
    paused = details.get("paused")
    if not paused:
        fail(f"{run_dir} is not paused by its stability guard (status.json)")
    try:
        parse_run_spec(config, str(config_path)).patched(spec_patch)
    except SpecError as error:
        fail(str(error))
    except SpecPatchError as refused:
        fail("; ".join(f"spec_patch.{key}: {why}" for key, why in refused.problems))
    except ValidationError as invalid:
        fail(describe_validation_error(invalid, "the patched spec"))
    pending = run_dir / RESUME_FILE
    if pending.exists():
        fail(f"{pending} exists already: the run has not taken that request yet")
    written = pending.with_name(f".{RESUME_FILE}.tmp")
    written.write_text(json.dumps({"spec_patch": spec_patch}) + "\n", encoding="utf-8")
    written.replace(pending)  # whole or not at all: the driver never reads half of it
    where = (
        "running: it resumes within a second"
        if details.get("state") == "running"
        else (f"{details.get('state')}: it resumes when continued with `kpo resume {run_dir}`")
    )
    typer.echo(f"[kpo] resume requested from step {paused.get('checkpoint')} ({pending}); {where}")


def _when(timestamp: str) -> str:
    """An API timestamp (ISO 8601, UTC) in local time, to the second."""
    return datetime.fromisoformat(timestamp).astimezone().strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 8000,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="serve /metrics on this port of its own, unguarded, instead of on the API's "
            "(default KPO_METRICS_PORT; unset: on the API's port, guarded like reads)",
        ),
    ] = None,
    insecure: Annotated[
        bool, typer.Option(help="allow a non-loopback address without an API token")
    ] = False,
    ray_cpus: Annotated[
        int | None,
        typer.Option(min=1, help="CPUs of the local Ray head, if one is started; default >= 4"),
    ] = None,
    stop: Annotated[
        bool,
        typer.Option(
            "--stop",
            help="stop the local Ray head of KPO_DATA_DIR instead (its live runs are cancelled "
            "first, each with a checkpoint) and exit",
        ),
    ] = False,
) -> None:
    """Run the control plane: the REST API, the dashboard, and runs as Ray jobs.

    Runs go to the Ray cluster at RAY_ADDRESS, or to a local Ray head this command starts (and
    leaves running, so that runs survive a restart of the control plane; `--stop` ends it).
    Settings come from KPO_* variables (README.md lists them).
    """
    import logging

    from services.jobs.settings import JobSettings

    if stop:
        _stop_local_ray_head()
        return

    try:
        settings = ApiSettings()
        job_settings = JobSettings()
        if metrics_port is not None:
            settings = settings.model_copy(update={"metrics_port": metrics_port})
        token = settings.token()
        settings.trusted_hosts(token is not None, host)  # refuses `*` without a token
    except (ValidationError, ValueError) as error:
        fail(f"settings: {error}")
    if token is None and not _is_loopback(host) and not insecure:
        fail(
            f"refusing to serve on {host} without an API token: set KPO_API_TOKEN (or "
            "KPO_API_TOKEN_FILE), listen on 127.0.0.1, or pass --insecure"
        )
    if settings.metrics_port == port:
        fail(f"the metrics port must differ from the API's ({port}): /metrics is served apart")
    if settings.probe_port is not None and settings.probe_port in (port, settings.metrics_port):
        fail(
            f"the probe port ({settings.probe_port}) must differ from the API's and the "
            "metrics': the probes are served apart"
        )
    # Only for a server that will run: a refused one leaves the caller's logging alone.
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        store = open_store(settings.store_url, settings.data_dir)
    except ValueError as error:
        fail(str(error))
    try:
        _serve_with(settings, job_settings, store, (host, port), ray_cpus)
    finally:
        _close_quietly(store)


def _stop_local_ray_head() -> None:
    """`kpo serve --stop`: end the local Ray head that `kpo serve` started for KPO_DATA_DIR."""
    from services.jobs.launcher import stop_local_head
    from services.jobs.settings import JobSettings

    try:
        data_dir = ApiSettings().data_dir
        ray_address = JobSettings().ray_address
    except ValidationError as error:
        fail(f"settings: {error}")
    if ray_address:
        fail(
            "RAY_ADDRESS names a Ray cluster: `kpo serve --stop` stops only the local Ray head "
            "that `kpo serve` starts when RAY_ADDRESS is unset"
        )
    try:
        done = stop_local_head(data_dir)
    except (RuntimeError, OSError) as error:  # HeadFileError included: a record not to trust
        fail(f"cannot stop the local Ray head: {error}", 1)
    typer.echo(f"[kpo] {done}")


def _serve_with(
    settings: ApiSettings,
    job_settings: JobSettings,
    store: Store,
    address: tuple[str, int],
    ray_cpus: int | None,
) -> None:
    """Start Ray's side (the launcher and its reconciler), the metrics server if it has a port,
    and the API on `address` (its probes on KPO_PROBE_PORT); stop them again when the API's
    server returns."""
    from services.api.app import create_app
    from services.api.listeners import ControlPlaneServer
    from services.api.metrics_server import MetricsServer
    from services.jobs.launcher import launcher_from_env
    from services.jobs.reconciler import Reconciler

    host, port = address
    try:
        launcher = launcher_from_env(
            settings.data_dir, settings.store_url, job_settings, head_cpus=ray_cpus
        )
    except (RuntimeError, OSError, ValueError) as error:
        fail(f"cannot set up Ray: {error}", 1)
    with contextlib.ExitStack() as running:
        running.callback(launcher.close)
        reconciler = Reconciler(launcher, store)
        reconciler.start()
        running.callback(reconciler.close)
        api = create_app(settings, store, launcher, bind_host=host)
        if settings.metrics_port is not None:
            try:
                metrics = MetricsServer(
                    api.state.registry,
                    host,
                    settings.metrics_port,
                    api.state.trusted_hosts,
                    settings.header_timeout_s,
                )
            except OSError as error:
                fail(f"cannot serve /metrics on port {settings.metrics_port}: {error}", 1)
            running.enter_context(metrics)
        try:
            # The API (past KPO_MAX_CONCURRENCY connections uvicorn answers 503 at once rather
            # than queue without bound) and its probes on KPO_PROBE_PORT, without that limit.
            server = ControlPlaneServer(api, settings, host, port)
        except OSError as error:
            fail(
                f"cannot listen on {host} (API port {port}, probe port "
                f"{settings.probe_port}): {error}",
                1,
            )
        server.run()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


sandbox_app = typer.Typer(help="The sandbox that runs the Python of tool calls.")
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("serve")
def sandbox_serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 8090,
    backend: Annotated[
        str | None, typer.Option(help="bwrap (default) or process (no namespaces)")
    ] = None,
    max_concurrency: Annotated[int | None, typer.Option(min=1, help="calls run at once")] = None,
    max_queue: Annotated[
        int | None, typer.Option(min=0, help="calls waiting; past it: 429")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(min=0.001, help="default wall clock of a call, seconds")
    ] = None,
    allow_unsafe_process: Annotated[
        bool, typer.Option(help="allow the process backend (no namespaces, no isolation)")
    ] = False,
    probe_port: Annotated[
        int | None,
        typer.Option(
            min=1, max=65535, help="serve /healthz and /readyz on this port of their own too"
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(help="allow a non-loopback address without a sandbox token (not for process)"),
    ] = False,
) -> None:
    """Run the sandbox server (POST /v1/run, GET /healthz). Other settings: KPO_SANDBOX_*
    (limits, token, trusted Host names); flags win over them."""
    import logging

    from services.tools.sandbox import SandboxUnavailable
    from services.tools.server import SandboxServer, SandboxSettings

    flags: dict[str, Any] = {
        "backend": backend,
        "max_concurrency": max_concurrency,
        "max_queue": max_queue,
        "timeout_s": timeout,
        "allow_unsafe_process": allow_unsafe_process or None,
        "probe_port": probe_port,
    }
    try:
        # Flags win over KPO_SANDBOX_*: given ones are validated as the settings' own fields.
        settings = SandboxSettings(**{k: v for k, v in flags.items() if v is not None})
        token = settings.bearer_token()
    except (ValidationError, OSError) as error:
        fail(f"sandbox settings: {error}")
    problem = _sandbox_token_problem(settings.backend, token is not None, host, insecure)
    if problem is not None:
        fail(problem)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        server = SandboxServer(settings, host, port)
    except SandboxUnavailable as error:
        fail(f"the sandbox cannot run here: {error}", 1)
    except OSError as error:
        fail(f"cannot listen on {host} (port {port}, probe port {settings.probe_port}): {error}", 1)
    server.run()


def _sandbox_token_problem(backend: str, has_token: bool, host: str, insecure: bool) -> str | None:
    """Why `kpo sandbox serve` must not start without a token here, or None."""
    if has_token:
        return None
    if backend == "process":
        # Its calls run as this user, unconfined: whatever reaches the port (a page in the
        # user's browser reaches loopback too) would run code as the user.
        return (
            "the process backend runs calls as this user, without namespaces, and needs a "
            "sandbox token wherever it listens: set KPO_SANDBOX_TOKEN (or KPO_SANDBOX_TOKEN_FILE)"
        )
    if not insecure and not _is_loopback(host):
        return (
            f"{host} is not a loopback address: set KPO_SANDBOX_TOKEN (or "
            "KPO_SANDBOX_TOKEN_FILE), or pass --insecure where a network policy guards it"
        )
    return None


if __name__ == "__main__":
    app()
