"""The policy architectures by name: what ``--arch`` accepts.

A module of names only, so that the configuration (``oni-train --help``) lists them without
loading the networks of :mod:`torchrl_oni.train.policy` (torch, NLE, TorchRL), which builds them.

Example:
    >>> from torchrl_oni.train.archs import ARCHS, RECURRENT_ARCHS
    >>> ARCHS
    ('light', 'oni', 'oni-lstm')
    >>> "light" in RECURRENT_ARCHS
    False
"""

__all__ = ["ARCHS", "RECURRENT_ARCHS"]

RECURRENT_ARCHS = ("oni", "oni-lstm")  # a core with a hidden state: primers, recurrent mode in the loss
ARCHS = ("light",) + RECURRENT_ARCHS
