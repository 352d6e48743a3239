"""Test-only verifiers that misbehave on command, importable by worker processes and Ray actors.

`pathological` reads a command from the response text: `sleep` sleeps for an hour, `spin` loops
forever, `raise` raises RuntimeError("boom"), `exit` kills its own process, `not-a-verdict`
returns a float; any other text is scored like `exact`.
"""

from __future__ import annotations

import os
import time

from services.reward.base import Verdict
from services.reward.exact_match import ExactConfig, check_exact
from services.reward.registry import register_verifier

PATHOLOGICAL = "pathological"


@register_verifier(PATHOLOGICAL, ExactConfig)
def misbehave(response_text: str, reference: str, config: ExactConfig) -> Verdict:
    """Misbehave as the response text says, else check like `exact`."""
    command = response_text.strip()
    if command == "sleep":
        time.sleep(3600)
    elif command == "spin":
        while True:
            pass
    elif command == "raise":
        raise RuntimeError("boom")
    elif command == "exit":
        os._exit(3)
    elif command == "not-a-verdict":
        return 1.0  # type: ignore[return-value]  # deliberately wrong, to test the type check
    return check_exact(response_text, reference, config)
