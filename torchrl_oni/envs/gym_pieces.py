"""Kept for one release: the module is now :mod:`torchrl_oni.envs.gym_wrapper`."""
from torchrl_oni.envs.gym_wrapper import *  # noqa: F401,F403
from torchrl_oni.envs.gym_wrapper import __all__  # noqa: F401
