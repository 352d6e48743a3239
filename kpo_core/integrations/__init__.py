"""kpo_core's estimators inside other RL frameworks.

- `kpo_core.integrations.verl`: policy losses registered in verl's registry (`loss_mode=kpo`).
- `kpo_core.integrations.trl`: a `GRPOTrainer` whose loss comes from a kpo_core estimator.

Each module imports its framework at the top, so it is only imported where that framework is
installed; `import kpo_core` imports neither.
"""
