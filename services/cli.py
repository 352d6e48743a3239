"""The `kpo` command line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer
import yaml
from pydantic import ValidationError

import kpo_core
from kpo_core.config import AlgorithmConfig, RunSpec, describe_validation_error
from services.pipeline.outputs import CONFIG_FILE, ProgressPrinter, RunDirectory, RunState
from services.pipeline.specs import (
    SpecError,
    load_run_spec,
    parse_run_spec,
    preflight,
    read_yaml_mapping,
)

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


EXIT_CODES: dict[RunState, int] = {"succeeded": 0, "failed": 1, "cancelled": 130}


def _execute(spec: RunSpec, run_dir: RunDirectory) -> None:
    """Run `spec` into `run_dir` with progress lines; exit with the run's outcome."""
    # Imported here: Ray and the actors' modules are slow to import and `config check` and
    # `version` do not need them.
    from services.pipeline.launch import ERROR_FILE, execute_run

    typer.echo(f"[kpo] run {spec.name!r} -> {run_dir.path}")
    try:
        state = execute_run(spec, run_dir, [ProgressPrinter(spec.pipeline.steps)])
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


if __name__ == "__main__":
    app()
