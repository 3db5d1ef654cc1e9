"""Kept for one release: the module is now :mod:`torchrl_oni.queries` (label budgets and query selection)."""
from torchrl_oni.queries import *  # noqa: F401,F403
from torchrl_oni.queries import __all__  # noqa: F401
