"""The learner: recompute log-probs, estimate ratios (kpo_core), optimise, checkpoint, publish.

Modules: `batch` (collate scored groups into padded tensors), `logprobs` (log-probs of the
response tokens under the current weights), `metrics` (the per-step metrics record), `step`
(`LearnerCore`, the step logic without Ray), `checkpoint` (save/restore), `actor` (the Ray actor).
"""
