"""kpo_core: pure-torch policy-optimisation library for RL of LLMs.

Ratio estimators (GRPO token, GSPO sequence, GMPO geometric, KPO Kalman, CTPO cumulative),
clipped surrogate losses, group-relative advantages and the KPO paper's ratio diagnostics.
Depends only on torch, numpy and pydantic, so it can be used outside the KPO-RL service.
"""

__version__ = "0.1.0"
