"""Sentence encoders (text → unit vector): moved to :mod:`torchrl_oni.rewards.text`.

This module keeps their old import path; new code imports from :mod:`torchrl_oni.rewards.text`.

Example:
    >>> from torchrl_oni.rewards.encoder import make_encoder
    >>> make_encoder("hashed").name
    'hashed'
"""
from torchrl_oni.rewards.text import (
    ENCODERS,
    EncoderVectors,
    HashedSentenceEncoder,
    MiniLMEncoder,
    SentenceEncoder,
    make_encoder,
    minilm_available,
)

__all__ = [
    "SentenceEncoder",
    "MiniLMEncoder",
    "HashedSentenceEncoder",
    "EncoderVectors",
    "make_encoder",
    "minilm_available",
    "ENCODERS",
]
