"""Annotators: turn NetHack messages into progress labels and pairwise preferences.

* :mod:`~torchrl_oni.annotators.base`: the protocol (:class:`Label`, :class:`Preference`,
  :class:`Provenance`, :class:`Annotator`, :class:`AnnotatorStats`).
* :class:`OpenAIAnnotator`: any OpenAI-compatible server (vLLM, the embedded CPU server...),
  through an :class:`LLMClient` (:mod:`~torchrl_oni.annotators.client`: a pool of servers,
  adaptive request sizes, retries, circuit breakers, health checks, metrics).
* :class:`ScriptedAnnotator`: hand-written NetHack rules, a no-LLM fallback and test tool.
* :class:`SimulatedTeacher`: those rules with B-Pref noise (rationality, mistakes, skips), a
  stand-in for an imperfect labeller in label-efficiency experiments.
* :class:`NoNewLabels`: declines every caption, for a run on labels made before it
  (``--annotator store --labels-from STORE``).
* :mod:`~torchrl_oni.annotators.prompts` / :mod:`~torchrl_oni.annotators.parsing`: the
  versioned prompt templates and the answer parsers.

Example:
    >>> from torchrl_oni.annotators import Annotator, ScriptedAnnotator
    >>> isinstance(ScriptedAnnotator(), Annotator)
    True
"""
from torchrl_oni.annotators.base import (
    FIRST,
    SECOND,
    SKIP_ERROR,
    TIE,
    Annotator,
    AnnotatorStats,
    Label,
    Preference,
    Provenance,
)
from torchrl_oni.annotators.client import Completion, LLMClient
from torchrl_oni.annotators.endpoints import AnnotatorUnavailable, resolve_model
from torchrl_oni.annotators.openai import OpenAIAnnotator
from torchrl_oni.annotators.pacing import CircuitBreaker, RequestSizer
from torchrl_oni.annotators.scripted import ScriptedAnnotator
from torchrl_oni.annotators.stored import NoNewLabels
from torchrl_oni.annotators.teacher import SimulatedTeacher

__all__ = [
    "FIRST",
    "SECOND",
    "TIE",
    "Annotator",
    "AnnotatorStats",
    "AnnotatorUnavailable",
    "CircuitBreaker",
    "Completion",
    "LLMClient",
    "Label",
    "NoNewLabels",
    "OpenAIAnnotator",
    "Preference",
    "Provenance",
    "RequestSizer",
    "ScriptedAnnotator",
    "SimulatedTeacher",
    "SKIP_ERROR",
    "resolve_model",
]
