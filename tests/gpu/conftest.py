"""Fixtures of the GPU tests: the learner tests' sampled groups (tiny model: tests/conftest.py).

Imported from the learner's conftest, not from tests/services/conftest.py, whose Ray and Redis
fixtures need packages a bare CUDA machine does not have.
"""

from tests.services.learner.conftest import groups

__all__ = ["groups"]
