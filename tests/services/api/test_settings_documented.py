"""Every environment variable of the control plane is documented in README.md with its default.

The settings classes are the one declaration; README's tables say what each variable does. A
variable added to the settings but not to README, or a README default that no longer matches the
code, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from services.api.settings import ApiSettings, ClientSettings
from services.jobs.settings import JobSettings

README = Path(__file__).resolve().parents[3] / "README.md"
# Variables read as other tools define them (Ray's own, Python's), documented by those tools.
FOREIGN = {"PYTHONPATH", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}


def variables(settings: type[BaseSettings]) -> dict[str, object]:
    """The settings' environment variable names, with each field's default."""
    names = {}
    for field in settings.model_fields.values():
        alias = field.validation_alias
        if isinstance(alias, str):
            names[alias] = field.default
    return names


@pytest.mark.parametrize("settings", [ApiSettings, ClientSettings, JobSettings])
def test_every_variable_is_in_the_readme(settings: type[BaseSettings]) -> None:
    text = README.read_text(encoding="utf-8")
    missing = [name for name in variables(settings) if name not in FOREIGN and name not in text]
    assert not missing, f"README.md does not mention {missing}"


def test_the_readme_table_gives_the_codes_defaults() -> None:
    """Rows of the settings table whose default is a plain number or boolean match the code."""
    text = README.read_text(encoding="utf-8")
    defaults = {**variables(ApiSettings), **variables(JobSettings)}
    checked = 0
    for name, documented in re.findall(
        r"^\| `(KPO_[A-Z_]+)` \| `?([0-9.]+|true|false)`? \|", text, re.M
    ):
        default = defaults[name]
        if isinstance(default, bool):
            assert documented == str(default).lower(), name
        else:
            assert float(documented) == float(str(default)), name
        checked += 1
    assert checked >= 8  # the table is there and its rows parse
