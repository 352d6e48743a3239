"""The control plane's settings, read from the environment (and nowhere else)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Tokens that appear in examples and templates: never accepted as a real secret.
PLACEHOLDER_TOKENS = frozenset({"changeme", "change-me", "secret", "token", "password", "kpo"})
MIN_TOKEN_LENGTH = 16


class ApiSettings(BaseSettings):
    """Environment variables of `kpo serve` (names as in the field aliases)."""

    # hide_input_in_errors: a settings error is printed by `kpo serve`, and its input holds the
    # token; the variable's name and the problem are enough.
    model_config = SettingsConfigDict(
        extra="ignore", populate_by_name=True, hide_input_in_errors=True
    )

    api_token: SecretStr | None = Field(None, validation_alias="KPO_API_TOKEN")
    api_token_file: Path | None = Field(
        None, validation_alias="KPO_API_TOKEN_FILE", description="a file holding the token"
    )
    auth_reads: bool = Field(
        False, validation_alias="KPO_AUTH_READS", description="require the token for reads too"
    )
    store_url: str | None = Field(None, validation_alias="KPO_STORE_URL")
    data_dir: Path = Field(Path("~/.kpo"), validation_alias="KPO_DATA_DIR")
    ray_address: str | None = Field(None, validation_alias="RAY_ADDRESS")
    max_body_bytes: int = Field(1_000_000, gt=0, validation_alias="KPO_MAX_BODY_BYTES")

    @model_validator(mode="after")
    def _one_token_source(self) -> ApiSettings:
        if self.api_token is not None and self.api_token_file is not None:
            raise ValueError("set KPO_API_TOKEN or KPO_API_TOKEN_FILE, not both")
        return self

    def token(self) -> str | None:
        """The bearer token, from the variable or the file; None when auth is off.

        Raises ValueError for a token that is a placeholder or too short to be a secret.
        """
        if self.api_token_file is not None:
            try:
                value = self.api_token_file.expanduser().read_text(encoding="utf-8").strip()
            except OSError as error:
                raise ValueError(f"KPO_API_TOKEN_FILE {self.api_token_file}: {error}") from None
        elif self.api_token is not None:
            value = self.api_token.get_secret_value().strip()
        else:
            return None
        if value.lower() in PLACEHOLDER_TOKENS or len(value) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"the API token must be a real secret of at least {MIN_TOKEN_LENGTH} characters "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return value
