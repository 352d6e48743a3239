"""The control plane's settings, read from the environment (and nowhere else): the server's
(`ApiSettings`) and its clients' (`ClientSettings`, the `kpo` commands that talk to it).

Ray's variables (where the runs' jobs go) are `services.jobs.settings.JobSettings`'s.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.api.alerts import AlertAction
from services.api.spec_paths import OperatorAllowlist, SandboxUrlRefused, sandbox_origin
from services.http_listener import comma_entries, own_host_names

# Tokens that appear in examples and templates: never accepted as a real secret.
PLACEHOLDER_TOKENS = frozenset({"changeme", "change-me", "secret", "token", "password", "kpo"})
MIN_TOKEN_LENGTH = 16

# Largest request body by default: run specs are a few kilobytes (examples/ as JSON: < 1 KB
# before defaults, about 2 KB resolved).
MAX_BODY_BYTES = 256 * 1024


def secret_value(
    value: SecretStr | None, file: Path | None, variable: str, what: str
) -> str | None:
    """A bearer token from `variable` or the file `variable`_FILE names; None when neither is
    set. Raises ValueError for an unreadable file, a placeholder, or one too short."""
    if file is not None:
        try:
            text = file.expanduser().read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ValueError(f"{variable}_FILE {file}: {error}") from None
    elif value is not None:
        text = value.get_secret_value().strip()
    else:
        return None
    if text.lower() in PLACEHOLDER_TOKENS or len(text) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"the {what} must be a real secret of at least {MIN_TOKEN_LENGTH} characters "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return text


class TokenSettings(BaseSettings):
    """The API token's variables, read on both sides: the server checks the token, its clients
    send it (names as in the field aliases)."""

    # hide_input_in_errors: a settings error is printed by `kpo serve`, and its input holds the
    # token; the variable's name and the problem are enough.
    model_config = SettingsConfigDict(
        extra="ignore", populate_by_name=True, hide_input_in_errors=True
    )

    api_token: SecretStr | None = Field(None, validation_alias="KPO_API_TOKEN")
    api_token_file: Path | None = Field(
        None, validation_alias="KPO_API_TOKEN_FILE", description="a file holding the token"
    )


class ClientSettings(TokenSettings):
    """Environment variables of the `kpo` commands that talk to a control plane.

    An empty variable counts as unset; KPO_API_TOKEN wins over KPO_API_TOKEN_FILE (the server
    refuses both), and a client sends whatever token it is given (the server judges it).
    """

    model_config = SettingsConfigDict(env_ignore_empty=True)

    def token(self) -> str | None:
        """The token to send: KPO_API_TOKEN, else the content of the file KPO_API_TOKEN_FILE;
        None when neither is set. Raises OSError for a file that cannot be read."""
        if self.api_token is not None:
            return self.api_token.get_secret_value()
        if self.api_token_file is not None:
            return self.api_token_file.expanduser().read_text(encoding="utf-8").strip()
        return None


class ApiSettings(TokenSettings):
    """Environment variables of `kpo serve`'s API (names as in the field aliases).

    The defaults are the safe ones: reads need the token too, no OpenAPI documentation, a cap on
    active runs, on request bodies and on event streams. README.md ("The control plane") lists
    them all.
    """

    auth_reads: bool = Field(
        True,
        validation_alias="KPO_AUTH_READS",
        description="require the token for reads too (runs, metrics, logs, events, /metrics)",
    )
    store_url: str | None = Field(None, validation_alias="KPO_STORE_URL")
    data_dir: Path = Field(Path("~/.kpo"), validation_alias="KPO_DATA_DIR")
    max_body_bytes: int = Field(
        MAX_BODY_BYTES, gt=0, validation_alias="KPO_MAX_BODY_BYTES", description="request bodies"
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        validation_alias="KPO_METRICS_PORT",
        description="serve /metrics on this port of its own (not on the API's, and unguarded)",
    )
    probe_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        validation_alias="KPO_PROBE_PORT",
        description="serve /healthz and /readyz on this port of its own too, unguarded and "
        "without the API's connection limit (for the orchestrator's probes)",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        validation_alias="KPO_HEADER_TIMEOUT_S",
        description="a connection that has not sent a whole request head this long after it "
        "opened (or after its last response) is closed, on every port; a request whose body "
        "has not all arrived this long after its head is answered 408",
    )
    trusted_proxies: str | None = Field(
        None,
        validation_alias="KPO_TRUSTED_PROXIES",
        description="comma-separated addresses or networks of the proxies (the Ingress) whose "
        "X-Forwarded-For names the client; from any other peer it is ignored",
    )
    openapi_docs: bool = Field(
        False, validation_alias="KPO_OPENAPI_DOCS", description="serve /docs, /redoc, /openapi.json"
    )
    allowed_hosts: str | None = Field(
        None,
        validation_alias="KPO_ALLOWED_HOSTS",
        description="comma-separated Host header values the API answers (see `trusted_hosts`)",
    )
    tracking_hosts: str = Field(
        "",
        validation_alias="KPO_TRACKING_HOSTS",
        description="comma-separated tracking servers (host or host:port) a run sent over the "
        "API may name; none by default",
    )
    sandbox_urls: str = Field(
        "",
        validation_alias="KPO_SANDBOX_URLS",
        description="comma-separated sandbox servers (scheme://host:port) a run sent over the "
        "API may name in tools.sandbox_url; none by default (the chart sets its own)",
    )
    sandbox_token_envs: str = Field(
        "KPO_SANDBOX_TOKEN",
        validation_alias="KPO_SANDBOX_TOKEN_ENVS",
        description="comma-separated environment variables a run sent over the API may name in "
        "tools.sandbox_token_env (the workers send the variable's value to the sandbox)",
    )
    alert_token_value: SecretStr | None = Field(
        None,
        validation_alias="KPO_ALERT_TOKEN",
        description="the bearer token Alertmanager's webhook sends to POST /v1/alerts (its own, "
        "not the API token); unset: the route is not served",
    )
    alert_token_file: Path | None = Field(
        None, validation_alias="KPO_ALERT_TOKEN_FILE", description="a file holding it"
    )
    alert_default_action: AlertAction = Field(
        "warn",
        validation_alias="KPO_ALERT_DEFAULT_ACTION",
        description="what a firing alert does to its run when its rule sets no `kpo_action` "
        "label: warn, checkpoint, pause or cancel",
    )
    max_active_runs: int = Field(
        16, ge=0, validation_alias="KPO_MAX_ACTIVE_RUNS", description="queued + running; 0: no cap"
    )
    idempotency_ttl_s: float = Field(
        86_400.0,
        gt=0,
        allow_inf_nan=False,
        validation_alias="KPO_IDEMPOTENCY_TTL_S",
        description="how long an Idempotency-Key still returns its run once the run finished",
    )
    max_streams: int = Field(
        64, ge=1, validation_alias="KPO_MAX_STREAMS", description="open event streams, in all"
    )
    max_streams_per_client: int = Field(
        8,
        ge=1,
        validation_alias="KPO_MAX_STREAMS_PER_CLIENT",
        description="open event streams per client IP address",
    )
    stream_lifetime_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        validation_alias="KPO_STREAM_LIFETIME_S",
        description="an event stream ends after this long; clients resume with Last-Event-ID",
    )
    max_concurrency: int = Field(
        256,
        ge=1,
        validation_alias="KPO_MAX_CONCURRENCY",
        description="connections and requests uvicorn serves at once before answering 503",
    )

    @model_validator(mode="after")
    def _one_token_source(self) -> ApiSettings:
        if self.api_token is not None and self.api_token_file is not None:
            raise ValueError("set KPO_API_TOKEN or KPO_API_TOKEN_FILE, not both")
        if self.alert_token_value is not None and self.alert_token_file is not None:
            raise ValueError("set KPO_ALERT_TOKEN or KPO_ALERT_TOKEN_FILE, not both")
        return self

    @model_validator(mode="after")
    def _trusted_proxies_parse(self) -> ApiSettings:
        self.proxy_networks()  # a typo is a settings error at start, not a proxy ignored
        return self

    @model_validator(mode="after")
    def _sandbox_urls_parse(self) -> ApiSettings:
        self.allowlist()  # a typo is a settings error at start, not every tool run refused
        return self

    @model_validator(mode="after")
    def _streams_fit(self) -> ApiSettings:
        if self.max_streams_per_client > self.max_streams:
            raise ValueError(
                f"KPO_MAX_STREAMS_PER_CLIENT ({self.max_streams_per_client}) must not exceed "
                f"KPO_MAX_STREAMS ({self.max_streams})"
            )
        if self.max_concurrency <= self.max_streams:
            raise ValueError(
                f"KPO_MAX_CONCURRENCY ({self.max_concurrency}) must exceed KPO_MAX_STREAMS "
                f"({self.max_streams}): open streams would leave no room for other requests"
            )
        return self

    def token(self) -> str | None:
        """The bearer token, from the variable or the file; None when auth is off.

        Raises ValueError for a token that is a placeholder or too short to be a secret.
        """
        return secret_value(self.api_token, self.api_token_file, "KPO_API_TOKEN", "API token")

    def alert_token(self) -> str | None:
        """The Alertmanager webhook's bearer token (KPO_ALERT_TOKEN or KPO_ALERT_TOKEN_FILE);
        None: `POST /v1/alerts` is not served. Raises ValueError as `token` does."""
        return secret_value(
            self.alert_token_value, self.alert_token_file, "KPO_ALERT_TOKEN", "alert token"
        )

    def proxy_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """KPO_TRUSTED_PROXIES as networks (an address is a network of one).

        Raises ValueError naming the entry that is neither."""
        networks = []
        for entry in comma_entries(self.trusted_proxies):
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(
                    f"KPO_TRUSTED_PROXIES: {entry!r} is not an IP address or network "
                    "(e.g. 10.0.0.0/8)"
                ) from None
        return tuple(networks)

    def tracking_servers(self) -> frozenset[str]:
        """The tracking servers (`host` or `host:port`, lowercase) that runs sent over the API
        may log to: KPO_TRACKING_HOSTS. A tracker's credentials come from the server's
        environment, so a client that could name any host could have them sent there (or have
        the cluster call its cloud metadata address): only the operator's servers are allowed."""
        return frozenset(host.lower() for host in comma_entries(self.tracking_hosts))

    def allowlist(self) -> OperatorAllowlist:
        """What a run sent over the API may name beyond the inputs folder: the tracking servers
        (KPO_TRACKING_HOSTS), the sandbox servers (KPO_SANDBOX_URLS) and the variables a sandbox
        token is read from (KPO_SANDBOX_TOKEN_ENVS). Raises ValueError naming the setting for a
        sandbox URL that is not scheme://host[:port]."""
        servers = []
        for entry in comma_entries(self.sandbox_urls):
            origin = sandbox_origin(entry)
            if isinstance(origin, SandboxUrlRefused):
                raise ValueError(f"KPO_SANDBOX_URLS: {entry!r}: {origin}")
            servers.append(origin)
        return OperatorAllowlist(
            tracking_servers=self.tracking_servers(),
            sandbox_servers=frozenset(servers),
            sandbox_token_envs=frozenset(comma_entries(self.sandbox_token_envs)),
        )

    def trusted_hosts(self, has_token: bool, bind_host: str) -> list[str]:
        """The Host header values the API answers (any other is a 400), against DNS rebinding.

        A page on another site can point its own name at 127.0.0.1 and then read a token-less
        server on the user's machine; its requests carry that name as their Host, so a server
        without a token answers only its loopback names and `bind_host`. KPO_ALLOWED_HOSTS
        replaces that list (`*.example.com` patterns allowed); `*`, any host, needs a token,
        and is the default with one. Raises ValueError for `*` without a token.
        """
        if self.allowed_hosts is not None:
            hosts = comma_entries(self.allowed_hosts)
            if not hosts:
                raise ValueError("KPO_ALLOWED_HOSTS is empty: name at least one host, or unset it")
            if "*" in hosts and not has_token:
                raise ValueError(
                    "KPO_ALLOWED_HOSTS=* needs an API token (KPO_API_TOKEN or "
                    "KPO_API_TOKEN_FILE): without one, any web page could reach this server "
                    "through DNS rebinding; list the server's names instead"
                )
            return hosts
        if has_token:
            return ["*"]
        return own_host_names(bind_host)
