"""Kept for one release: the module is now :mod:`torchrl_oni.train.run_log` (this name shadowed the standard library's)."""
from torchrl_oni.train.run_log import *  # noqa: F401,F403
from torchrl_oni.train.run_log import __all__  # noqa: F401
