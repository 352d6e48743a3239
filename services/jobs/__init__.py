"""Runs as Ray jobs: what the control plane uses to start, stop and watch them.

Modules: `interface` (`RunLauncher`, what the API needs from a launcher; imports no Ray),
`settings` (`JobSettings`, the environment of Ray's side), `launcher` (`RayJobLauncher`: each
run is one Ray job, on the cluster at RAY_ADDRESS or on a local head), `reconciler` (brings the
store and Ray's jobs back into agreement after a crash), `ray_head` (the local Ray head that
`kpo serve` starts when no cluster is named).
"""
