"""The settings of Ray's side of the control plane, read from the environment (and nowhere else).

The API's own variables (the token, the store, the data directory) are `ApiSettings`'s
(`services.api.settings`); these say where the runs' Ray jobs go and how to reach them, what
each job gets and reserves there, and how often a run whose driver died is started again. The
run's driver reads `RAY_ADDRESS` on its own (`services.pipeline.actors.connect_ray`), alike.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Ray's built-in resources: a job reserves these through arguments of their own, never as a
# custom resource (Ray refuses them there).
BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class JobSettings(BaseSettings):
    """Environment variables of the launcher (names as in the field aliases).

    An empty variable counts as unset. `RAY_AUTH_*` are Ray's own settings of a cluster with
    token authentication, read as Ray reads them.
    """

    model_config = SettingsConfigDict(
        extra="ignore", populate_by_name=True, hide_input_in_errors=True, env_ignore_empty=True
    )

    ray_address: str | None = Field(
        None,
        validation_alias="RAY_ADDRESS",
        description="the Ray cluster that runs the jobs; unset: a local Ray head",
    )
    ray_api_server_address: str | None = Field(
        None,
        validation_alias="RAY_API_SERVER_ADDRESS",
        description="the cluster's job server, when it is not where RAY_ADDRESS leads",
    )
    ray_auth_mode: str = Field("", validation_alias="RAY_AUTH_MODE")
    ray_auth_token: SecretStr | None = Field(None, validation_alias="RAY_AUTH_TOKEN")
    ray_auth_token_path: Path | None = Field(None, validation_alias="RAY_AUTH_TOKEN_PATH")
    pythonpath: str = Field(
        "",
        validation_alias="PYTHONPATH",
        description="kept on the PYTHONPATH of jobs on a local head, after this checkout",
    )
    pass_store_url_to_jobs: bool = Field(
        True,
        validation_alias="KPO_PASS_STORE_URL_TO_JOBS",
        description="put KPO_STORE_URL into each job's runtime environment; false when the Ray "
        "nodes have it in their own environment (Ray's job API shows every job's runtime "
        "environment, and the URL may hold the store's password)",
    )
    ray_driver_resource: str | None = Field(
        None,
        validation_alias="KPO_RAY_DRIVER_RESOURCE",
        description="a custom Ray resource of the cluster's head; each run's job reserves one "
        "unit, so the head runs at most as many drivers as it advertises and further jobs wait "
        "in Ray's queue. Unset: none (a local head ignores it)",
    )
    ray_driver_cpus: float = Field(
        0.0,
        ge=0,
        validation_alias="KPO_RAY_DRIVER_CPUS",
        description="CPUs each run's job reserves for its driver; the driver mostly waits on "
        "its actors, and what bounds the drivers of a head is KPO_RAY_DRIVER_RESOURCE",
    )
    driver_restarts: int = Field(
        2,
        ge=0,
        validation_alias="KPO_DRIVER_RESTARTS",
        description="how often the reconciler resubmits a run whose driver ended without "
        "recording its outcome, or went with a restarted Ray cluster (it resumes from its "
        "latest checkpoint), before failing it; counted in the store, across clusters",
    )

    @field_validator("ray_driver_resource")
    @classmethod
    def _custom_resource(cls, name: str | None) -> str | None:
        if name is not None and name in BUILTIN_RESOURCES:
            raise ValueError(
                f"{name!r} is one of Ray's built-in resources; name a custom resource that the "
                "head advertises (e.g. kpo_driver)"
            )
        return name
