"""Moved to :mod:`torchrl_oni.testing`; re-exported here for the tests that import it from tests/."""
from torchrl_oni.testing import MODES, P_POSITIVE_IF_NOT, P_POSITIVE_IF_PROGRESS, FakeLLMServer  # noqa: F401
