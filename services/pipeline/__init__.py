"""The run driver: actors, prompt stream, rollout buffer with a staleness bound, checkpoints.

Modules, one job each: `prompts` (the resumable prompt stream), `buffer` (bounded rollout buffer,
staleness bound), `records` (JSON forms of the messages, for checkpoints), `checkpoints`
(atomic checkpoint directories), `outputs` (config.json, metrics.jsonl, status.json, progress),
`plots` (curves.png), `actors` (starting the Ray actors of a run), `driver` (the event loop).
"""
