"""The control plane: a FastAPI service to submit runs and watch them.

Modules: `settings` (environment), `auth` (bearer token), `errors` (JSON error bodies),
`deps` (request dependencies), `routes_runs` / `routes_system` (the REST API), `sse` (live
events), `prometheus` (the /metrics export), `dashboard` (the page at /), `app` (`create_app`,
which puts them together); `client` is the HTTP client the `kpo` command uses to talk to it.
HTTP only: runs are launched by the `services.jobs.interface.RunLauncher` handed to `create_app`
(`kpo serve` hands it one that runs each run as a Ray job: `services.jobs`).
"""
