"""The control plane: a FastAPI service to submit runs and watch them.

Modules: `settings` (environment), `auth` (bearer token), `errors` (JSON error bodies),
`deps` (request dependencies), `routes_runs` / `routes_system` (the REST API), `sse` (live
events), `prometheus` (the /metrics export), `dashboard` (the page at /), `launcher` (runs as
Ray jobs), `ray_head` (the local Ray head used without a cluster), `app` (`create_app`, which
puts them together); `client` is the HTTP client the `kpo` command uses to talk to it.
"""
