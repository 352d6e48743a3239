"""The `kpo` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
import yaml
from pydantic import ValidationError

import kpo_core
from kpo_core.config import AlgorithmConfig, describe_validation_error

app = typer.Typer(help="KPO-RL: asynchronous RL for LLMs with Kalman-filtered ratios.")
config_app = typer.Typer(help="Inspect and validate configuration files.")
app.add_typer(config_app, name="config")


def fail(message: str) -> NoReturn:
    """Print a user-facing error (no traceback) and exit with status 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def load_yaml_mapping(path: Path) -> dict[str, object]:
    """Parse a YAML file that must hold a mapping; errors name the file (and line)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except (OSError, UnicodeDecodeError) as error:
        fail(f"{path}: cannot read: {error}")
    except yaml.YAMLError as error:
        fail(f"{path}: invalid YAML: {error}")
    if not isinstance(data, dict):
        fail(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


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


if __name__ == "__main__":
    app()
