"""What every local Ray instance the project starts shares (the head of `kpo serve`:
services.jobs.ray_head; the instance of `kpo run`: services.pipeline.actors)."""

from __future__ import annotations

# A port number no socket accepts (how Ray's fixed-port exporters are kept off: below).
UNUSABLE_PORT = "-1"


# The environment of every Ray instance the project starts on one machine (the local head of
# `kpo serve`, the instance of `kpo run`): Ray's Prometheus exporters listen on every interface
# and answer without the token, and nothing of kpo reads them (its own metrics are the control
# plane's /metrics and the run's metrics.jsonl). `RAY_enable_metrics_collection=0` turns off the
# metrics agent's; it leaves two on, at fixed ports (44217, 44227): the autoscaler monitor's and
# the dashboard's own. Ray has no switch for them; a port no socket accepts makes each fail to
# start, which Ray logs once and runs on without.
NO_METRICS_EXPORTERS: dict[str, str] = {
    "RAY_enable_metrics_collection": "0",
    "AUTOSCALER_METRIC_PORT": UNUSABLE_PORT,
    "DASHBOARD_METRIC_PORT": UNUSABLE_PORT,
}
