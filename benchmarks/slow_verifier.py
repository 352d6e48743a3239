"""A slow verifier for the benchmarks: the exact-match check after a wait that grows with the
response (a stand-in for a verifier that runs the answer, e.g. unit tests in a sandbox).

Registered as `slow_exact` in every process that imports this module: the benchmark's verifier
actors import it as a plugin module (`VerifierActor`'s `plugin_modules`). The wait sleeps, so
the verifier's processes do not take the CPU that generation and the learner share.
"""

from __future__ import annotations

import time

from services.reward.base import Verdict
from services.reward.exact_match import ExactConfig, check_exact
from services.reward.registry import register_verifier

SLOW_VERIFIER = "slow_exact"
BASE_SECONDS = 0.02  # every check
SECONDS_PER_CHAR = 0.0005  # and more for a longer response (a long-tailed task's long tail)


@register_verifier(SLOW_VERIFIER, ExactConfig)
def check_slowly(response_text: str, reference: str, config: ExactConfig) -> Verdict:
    time.sleep(BASE_SECONDS + SECONDS_PER_CHAR * len(response_text))
    return check_exact(response_text, reference, config)
