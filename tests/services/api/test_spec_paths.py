"""Paths in run specs sent over HTTP: read from `<data dir>/inputs` and nowhere else.

A relative path is stored as the absolute path inside the inputs folder, which is what the run's
job then reads (checked with the job's own readers); every path that would leave the folder is a
422 naming the field, and such a run is neither stored nor launched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.api.settings import ApiSettings
from services.api.spec_paths import INPUTS_DIR_NAME
from services.pipeline.prompts import PromptStream
from services.pipeline.specs import parse_run_spec
from services.spec import JsonlTask
from services.tasks.models import resolve_model
from services.tasks.registry import BUILTIN_MODELS
from tests.services.api.conftest import Api, ApiFactory
from tests.services.api.test_runs_api import TINY
from tests.services.model_families import save_family_config
from tests.services.test_spec import CODE_LOADING_ENGINE_ARGUMENTS


def inputs_of(tmp_path: Path) -> Path:
    # The api fixture's data dir is tmp_path (see conftest.api_factory).
    return tmp_path.resolve() / INPUTS_DIR_NAME


def spec_with(**fields: Any) -> dict[str, Any]:
    return {**TINY, **fields}


def jsonl_task(path: str) -> dict[str, Any]:
    return {"name": "jsonl", "path": path}


def test_relative_paths_are_read_from_the_inputs_folder(api: Api, tmp_path: Path) -> None:
    inputs = inputs_of(tmp_path)
    model_dir = inputs / "models" / "small"
    model_dir.mkdir(parents=True)
    config = {"model_type": "gpt2", "architectures": ["GPT2ForCausalLM"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    (inputs / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    body = spec_with(
        model="./models/small",
        task=jsonl_task("prompts.jsonl"),
        generation={
            "backend": "vllm",
            "group_size": 4,
            "options": {"tokenizer": "models/small", "dtype": "auto"},
        },
    )
    response = api.client.post("/v1/runs", json=body, headers={"Idempotency-Key": "paths"})
    assert response.status_code == 201, response.text
    stored = response.json()["spec"]
    assert stored["model"] == str(model_dir)
    assert stored["task"]["path"] == str(inputs / "prompts.jsonl")
    assert stored["generation"]["options"] == {"tokenizer": str(model_dir), "dtype": "auto"}
    # What the job does with the stored spec: resolve the model, read the prompts.
    spec = parse_run_spec(api.store.get_run(response.json()["id"]).spec, "stored")
    assert resolve_model(spec.model) == model_dir
    assert [p.text for p in PromptStream(spec.task, spec.seed).take(1)] == ["1+1="]
    # The stored spec can be sent again as it is: absolute paths inside the folder are kept.
    again = api.client.post("/v1/runs", json=stored, headers={"Idempotency-Key": "paths"})
    assert again.status_code == 201 and again.json()["id"] == response.json()["id"]


def test_a_model_family_the_learner_cannot_train_is_a_422_naming_model(
    api: Api, tmp_path: Path
) -> None:
    """Its config alone is read (the folder holds no weights): linear-attention layers are
    refused by design, and the run is neither stored nor launched."""
    save_family_config("qwen3-next", inputs_of(tmp_path) / "next")
    response = api.client.post("/v1/runs", json=spec_with(model="next"))
    assert response.status_code == 422, response.text
    (error,) = response.json()["error"]["fields"]
    assert error["field"] == "model"
    assert "'linear_attention' layer" in error["message"]
    assert "attention layers only" in error["message"]
    assert api.client.get("/v1/runs").json()["runs"] == [] and api.launcher.submitted == []
    save_family_config("llama", inputs_of(tmp_path) / "llama")
    assert api.client.post("/v1/runs", json=spec_with(model="llama")).status_code == 201


def test_built_in_models_stay_names(api: Api) -> None:
    response = api.client.post("/v1/runs", json=spec_with(model="tiny-arith"))
    assert response.status_code == 201 and response.json()["spec"]["model"] == "tiny-arith"


def test_hub_ids_stay_ids_unless_they_name_a_folder_of_inputs(api: Api, tmp_path: Path) -> None:
    response = api.client.post("/v1/runs", json=spec_with(model="Qwen/Qwen3-4B"))
    assert response.status_code == 201 and response.json()["spec"]["model"] == "Qwen/Qwen3-4B"
    local = inputs_of(tmp_path) / "org" / "model"
    local.mkdir(parents=True)
    response = api.client.post("/v1/runs", json=spec_with(model="org/model"))
    assert response.status_code == 201 and response.json()["spec"]["model"] == str(local)


OUTSIDE = [
    "/etc/passwd",
    "/",
    "../secrets",
    "models/../../secrets",
    "..",
    "~/.ssh/id_rsa",
    "~root",
    "a\x00b",
    "..\\..\\etc\\passwd",
    "models\\small",
    "line\nbreak",
    ".",
    "./",
]


@pytest.mark.parametrize("path", OUTSIDE, ids=repr)
def test_paths_that_leave_the_inputs_folder_are_a_422(api: Api, path: str) -> None:
    bodies = {
        "model": spec_with(model=path),
        "task.path": spec_with(task=jsonl_task(path)),
        "task.path (dataset)": spec_with(task={"name": "dataset", "path": path}),
        "generation.options.tokenizer": spec_with(
            generation={"backend": "vllm", "group_size": 4, "options": {"tokenizer": path}}
        ),
    }
    for field, body in bodies.items():
        response = api.client.post("/v1/runs", json=body)
        assert response.status_code == 422, (field, response.text)
        fields = response.json()["error"]["fields"]
        assert [f["field"] for f in fields] == [field.removesuffix(" (dataset)")]
        assert "give " in fields[0]["message"]
    assert api.launcher.submitted == []
    assert api.client.get("/v1/runs").json()["runs"] == []


def test_absolute_paths_are_accepted_only_inside_the_folder(api: Api, tmp_path: Path) -> None:
    inputs = inputs_of(tmp_path)
    inside = api.client.post("/v1/runs", json=spec_with(model=str(inputs / "m")))
    assert inside.status_code == 201 and inside.json()["spec"]["model"] == str(inputs / "m")
    for path in (str(inputs), f"{inputs}/../store", f"{inputs}-other/m", str(tmp_path / "store")):
        response = api.client.post("/v1/runs", json=spec_with(model=path))
        assert response.status_code == 422, path
        message = response.json()["error"]["fields"][0]["message"]
        builtin = ", ".join(BUILTIN_MODELS)
        assert message.endswith(
            f"give a built-in model ({builtin}), a hub id or a path relative to {inputs}"
        )


@pytest.mark.parametrize("value", ["/etc/passwd", "../x", "~/x", "a\\b"])
def test_other_backend_options_may_not_look_like_paths_that_leave(api: Api, value: str) -> None:
    body = spec_with(generation={"group_size": 4, "options": {"device": value}})
    response = api.client.post("/v1/runs", json=body)
    assert response.status_code == 422
    field = response.json()["error"]["fields"][0]
    assert field["field"] == "generation.options.device"
    assert field["message"].startswith("not a path option")
    ordinary = {"device": "cuda:0", "dtype": "bfloat16", "attn_implementation": "sdpa"}
    fine = spec_with(generation={"group_size": 4, "options": ordinary})
    assert api.client.post("/v1/runs", json=fine).status_code == 201


def test_every_refused_field_is_named_at_once(api: Api) -> None:
    body = spec_with(
        model="/root/model",
        task=jsonl_task("../prompts.jsonl"),
        generation={"backend": "vllm", "group_size": 4, "options": {"tokenizer": "~/tok"}},
    )
    response = api.client.post("/v1/runs", json=body)
    assert response.status_code == 422
    assert [f["field"] for f in response.json()["error"]["fields"]] == [
        "model",
        "task.path",
        "generation.options.tokenizer",
    ]


def test_local_run_files_keep_any_path() -> None:
    # `kpo run` reads the user's own files: the model itself accepts absolute paths.
    spec = parse_run_spec(spec_with(model="/opt/models/x", task=jsonl_task("/tmp/p.jsonl")), "f")
    assert isinstance(spec.task, JsonlTask)
    assert spec.model == "/opt/models/x" and spec.task.path == "/tmp/p.jsonl"


@pytest.mark.parametrize(("argument", "value"), CODE_LOADING_ENGINE_ARGUMENTS.items())
def test_an_engine_argument_that_loads_code_is_refused_naming_it(
    api: Api, argument: str, value: Any
) -> None:
    engine = {"max_num_seqs": 64, argument: value}
    body = spec_with(generation={"backend": "vllm", "group_size": 4, "engine": engine})
    response = api.client.post("/v1/runs", json=body)
    assert response.status_code == 422, response.text
    (field,) = response.json()["error"]["fields"]
    assert field["field"] == f"generation.engine.{argument}"
    assert field["message"].startswith("not an engine argument a run may set")
    assert api.launcher.submitted == []
    allowed = {"max_num_seqs": 64, "compilation_config": {"mode": 0}, "kv_cache_dtype": "auto"}
    ok = spec_with(generation={"backend": "vllm", "group_size": 4, "engine": allowed})
    assert api.client.post("/v1/runs", json=ok).status_code == 201
    assert api.launcher.submitted[-1]


@pytest.mark.parametrize("value", ["/etc/passwd", "../x", "~/x"])
def test_no_engine_argument_takes_a_path(api: Api, value: str) -> None:
    engine = {"compilation_config": {"cudagraph_mode": value}}
    body = spec_with(generation={"backend": "vllm", "group_size": 4, "engine": engine})
    response = api.client.post("/v1/runs", json=body)
    assert response.status_code == 422
    fields = [f["field"] for f in response.json()["error"]["fields"]]
    assert fields == ["generation.engine.compilation_config.cudagraph_mode"]


@pytest.mark.parametrize(
    ("tracking", "field"),
    [
        ({"wandb": {"project": "p", "dir": "/etc"}}, "tracking.wandb.dir"),
        ({"tensorboard": {"log_dir": "logs"}}, "tracking.tensorboard.log_dir"),
        ({"mlflow": {"tracking_uri": "file:///etc/mlruns"}}, "tracking.mlflow.tracking_uri"),
        ({"mlflow": {"tracking_uri": "/srv/mlruns"}}, "tracking.mlflow.tracking_uri"),
    ],
)
def test_trackers_write_only_into_the_run_or_to_a_server(
    api: Api, tracking: dict[str, Any], field: str
) -> None:
    response = api.client.post("/v1/runs", json=spec_with(tracking=tracking))
    assert response.status_code == 422, response.text
    assert [f["field"] for f in response.json()["error"]["fields"]] == [field]


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("http://169.254.169.254/", "169.254.169.254 is not one of the tracking servers"),
        ("http://mlflow.example:8080", "mlflow.example is not one of the tracking servers"),
        ("https://mlflow.internal.evil.example", "mlflow.internal.evil.example is not one"),
        ("http://mlflow.internal@10.0.0.1/", "credentials do not go in the URI"),
        ("http://[fd00::1]:5000", "[fd00::1] is not one of the tracking servers"),
        ("http://mlflow.internal:x", "not a valid URL"),
    ],
)
def test_a_tracking_server_outside_the_operators_list_is_refused(
    api_factory: ApiFactory, uri: str, why: str
) -> None:
    with api_factory(KPO_TRACKING_HOSTS="MLflow.example:5000, mlflow.internal") as api:
        refused = {"mlflow": {"tracking_uri": uri}}
        response = api.client.post("/v1/runs", json=spec_with(tracking=refused))
        assert response.status_code == 422, response.text
        (error,) = response.json()["error"]["fields"]
        assert error["field"] == "tracking.mlflow.tracking_uri"
        assert why in error["message"]
        assert api.launcher.submitted == []
        for allowed in ("https://mlflow.example:5000", "http://MLFLOW.internal:80/api"):
            server = {"mlflow": {"tracking_uri": allowed}, "tensorboard": {}}
            response = api.client.post("/v1/runs", json=spec_with(tracking=server))
            assert response.status_code == 201, response.text
            assert response.json()["spec"]["tracking"]["mlflow"]["tracking_uri"] == allowed


def test_without_tracking_hosts_no_tracking_server_may_be_named(api: Api) -> None:
    server = {"mlflow": {"tracking_uri": "https://mlflow.example:5000"}}
    response = api.client.post("/v1/runs", json=spec_with(tracking=server))
    assert response.status_code == 422
    (error,) = response.json()["error"]["fields"]
    assert error["message"].endswith("allows: none (KPO_TRACKING_HOSTS is unset)")
    # The operator's own default (MLFLOW_TRACKING_URI in the server's environment) still serves.
    default = {"mlflow": {"experiment": "e"}}
    assert api.client.post("/v1/runs", json=spec_with(tracking=default)).status_code == 201


SANDBOX = "http://kpo-sandbox.kpo.svc:8000"


def test_a_spec_that_sends_a_worker_secret_to_its_own_url_is_refused(
    api_factory: ApiFactory,
) -> None:
    # What the third hardening pass reproduced: a listener of the submitter's choosing, and the
    # variable holding Ray's own token. Both fields are named; nothing is stored or launched.
    exfiltration = {
        "enabled": True,
        "sandbox_url": "http://attacker.example:9000/collect?x=1",
        "sandbox_token_env": "RAY_AUTH_TOKEN",
    }
    with api_factory(KPO_SANDBOX_URLS=SANDBOX) as api:
        response = api.client.post("/v1/runs", json=spec_with(tools=exfiltration))
        assert response.status_code == 422, response.text
        fields = {f["field"]: f["message"] for f in response.json()["error"]["fields"]}
        assert set(fields) == {"tools.sandbox_url", "tools.sandbox_token_env"}
        assert "no path, query or fragment" in fields["tools.sandbox_url"]
        assert "RAY_AUTH_TOKEN is not a sandbox token variable" in fields["tools.sandbox_token_env"]
        assert api.launcher.submitted == [] and api.client.get("/v1/runs").json()["runs"] == []

        # The operator's own server, with the default variable, is accepted as given.
        tools = {"enabled": True, "sandbox_url": "http://KPO-sandbox.kpo.svc:8000/"}
        response = api.client.post("/v1/runs", json=spec_with(tools=tools))
        assert response.status_code == 201, response.text
        assert response.json()["spec"]["tools"]["sandbox_token_env"] == "KPO_SANDBOX_TOKEN"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://attacker.example:8000", "attacker.example:8000 is not one of the sandbox"),
        ("http://kpo-sandbox.kpo.svc:8001", "kpo-sandbox.kpo.svc:8001 is not one"),
        ("https://kpo-sandbox.kpo.svc:8000", "https://kpo-sandbox.kpo.svc:8000 is not one"),
        ("http://user:pw@kpo-sandbox.kpo.svc:8000", "credentials do not go in the URL"),
        ("http://kpo-sandbox.kpo.svc:8000/v1", "no path, query or fragment"),
        ("http://kpo-sandbox.kpo.svc:8000#x", "no path, query or fragment"),
        ("http://kpo-sandbox.kpo.svc:x", "not a valid URL"),
        ("http://169.254.169.254", "169.254.169.254:80 is not one of the sandbox servers"),
    ],
)
def test_a_sandbox_outside_the_operators_list_is_refused(
    api_factory: ApiFactory, url: str, why: str
) -> None:
    with api_factory(KPO_SANDBOX_URLS=f"{SANDBOX}, http://[fd00::1]:8000") as api:
        response = api.client.post("/v1/runs", json=spec_with(tools={"sandbox_url": url}))
        assert response.status_code == 422, response.text
        (error,) = response.json()["error"]["fields"]
        assert error["field"] == "tools.sandbox_url" and why in error["message"]
        ipv6 = {"sandbox_url": "http://[FD00::1]:8000", "enabled": True}
        assert api.client.post("/v1/runs", json=spec_with(tools=ipv6)).status_code == 201


def test_without_sandbox_urls_no_sandbox_server_may_be_named(api: Api) -> None:
    response = api.client.post("/v1/runs", json=spec_with(tools={"sandbox_url": SANDBOX}))
    assert response.status_code == 422
    (error,) = response.json()["error"]["fields"]
    assert error["message"].endswith("allows: none (KPO_SANDBOX_URLS is unset)")
    # Tools with the worker's own local sandbox need no server.
    assert api.client.post("/v1/runs", json=spec_with(tools={"enabled": True})).status_code == 201


def test_a_token_variable_from_the_operators_list_may_be_named(api_factory: ApiFactory) -> None:
    env = {"KPO_SANDBOX_URLS": SANDBOX, "KPO_SANDBOX_TOKEN_ENVS": "KPO_SANDBOX_TOKEN,TEAM_B"}
    with api_factory(**env) as api:
        tools = {"sandbox_url": SANDBOX, "sandbox_token_env": "TEAM_B"}
        assert api.client.post("/v1/runs", json=spec_with(tools=tools)).status_code == 201


def test_listing_other_token_variables_refuses_only_specs_that_name_a_sandbox_url(
    api_factory: ApiFactory,
) -> None:
    # Without a URL the variable is sent nowhere: the default name must not make every spec,
    # tools or none, a 422 once the operator lists other variables.
    env = {"KPO_SANDBOX_URLS": SANDBOX, "KPO_SANDBOX_TOKEN_ENVS": "TEAM_B"}
    with api_factory(**env) as api:
        for tools in ({}, {"enabled": True}, {"enabled": True, "sandbox_token_env": "OTHER"}):
            response = api.client.post("/v1/runs", json=spec_with(tools=tools))
            assert response.status_code == 201, response.text
        response = api.client.post("/v1/runs", json=spec_with(tools={"sandbox_url": SANDBOX}))
        assert response.status_code == 422
        (error,) = response.json()["error"]["fields"]
        assert error["field"] == "tools.sandbox_token_env"
        assert "KPO_SANDBOX_TOKEN is not a sandbox token variable" in error["message"]


@pytest.mark.parametrize("value", ["kpo-sandbox:8000", "http://s:8000/path", "http://u@s:1"])
def test_a_sandbox_url_setting_that_is_no_origin_fails_at_start(value: str) -> None:
    with pytest.raises(ValueError, match="KPO_SANDBOX_URLS"):
        ApiSettings.model_validate({"KPO_SANDBOX_URLS": value})
