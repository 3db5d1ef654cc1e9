"""Who labels captions, by name: the registry behind ``--annotator``.

An annotator is one :class:`AnnotatorType` entry: how to build it from the ``annotation``
section of the configuration, and what it is. Adding one is one call to
:func:`register_annotator`; ``--annotator`` lists every registered name, and the trainer's
labelling (:mod:`torchrl_oni.train.labelling`) asks the entry, never the name, whether the
judge probe checks it and whether it serves an LLM.

This module imports no torch and no annotator at import time: ``oni-train --help`` reads the
names from here, and the built-in entries load their annotators only when one is built.

=================  ===========================================================================
field              meaning
=================  ===========================================================================
``name``           the ``--annotator`` value
``help``           one line for the docs
``build``          ``build(ann, *, seed)`` → ``(annotator, server handle or None)``: ``ann`` is
                   the ``annotation`` section; the annotator is checked to answer; the server
                   (an embedded LLM started for it) is stopped by the caller at the end of the run
``llm``            an LLM server answers for it: reward types that send requests of their own to
                   an LLM (ELLM's goals) get its endpoint (:func:`start_llm`)
``judged``         the calibration probe (:mod:`torchrl_oni.annotators.probe`) asks it before
                   its first real label of single captions
``answers``        it labels what it is asked; False for ``store``, which declines everything
                   (the run's labels come from ``--labels-from``, which it then requires)
=================  ===========================================================================

Example:
    >>> from torchrl_oni.train.annotator_types import annotator_names, get_annotator
    >>> annotator_names()
    ('llm', 'scripted', 'teacher', 'store')
    >>> get_annotator("llm").judged, get_annotator("scripted").judged
    (True, False)
    >>> get_annotator("oracle")
    Traceback (most recent call last):
    ...
    ValueError: unknown --annotator 'oracle' (llm, scripted, teacher or store)
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from ..registry import Registry

__all__ = ["AnnotatorType", "register_annotator", "get_annotator", "annotator_names", "start_llm"]

log = logging.getLogger("torchrl_oni.train")


@dataclass(frozen=True)
class AnnotatorType:
    name: str
    help: str
    build: Callable[..., Tuple[Any, Any]]
    llm: bool = False
    judged: bool = False
    answers: bool = True


_REGISTRY: Registry[AnnotatorType] = Registry("--annotator")
_ANNOTATORS = _REGISTRY.entries  # name -> entry (tests add one with monkeypatch.setitem)


def register_annotator(entry: AnnotatorType, *, replace: bool = False) -> AnnotatorType:
    """Adds ``entry`` under its name (``replace=True`` to override an existing one)."""
    return _REGISTRY.register(entry, replace=replace)


def annotator_names() -> Tuple[str, ...]:
    return _REGISTRY.names()


def get_annotator(name: str) -> AnnotatorType:
    return _REGISTRY.get(name)


# ---------------------------------------------------------------------- LLM servers
def _ask_then_close(annotator, ask):
    """Runs ``await ask()`` on a fresh event loop and closes the annotator's HTTP sessions after
    (the annotation worker opens its own on its loop)."""

    async def run():
        try:
            return await ask()
        finally:
            await annotator.aclose()

    return asyncio.run(run())


def _check_llm(annotator) -> None:
    """Asks the server for its models; raises ``AnnotatorUnavailable`` with one line."""
    _ask_then_close(annotator, annotator.check)


def start_llm(ann):
    """``(LLMEndpoint, server_handle or None)``: the OpenAI-compatible servers of ``--llm-url``
    (the model defaults to the only one they list) or the embedded CPU server, started here in a
    process of its own (see :func:`~torchrl_oni.serve.start_embedded_process`).

    ``ann`` is the ``annotation`` section of the configuration."""
    from ..annotators import resolve_model
    from .reward_types import LLMEndpoint

    if ann.llm_url:
        urls = tuple(ann.llm_url)
        model = resolve_model(list(urls), ann.llm_model, api_key=ann.llm_api_key)
        return LLMEndpoint(urls, model, ann.llm_api_key), None
    from ..serve import DEFAULT_MODEL, start_embedded_process, start_embedded_server

    name, threads = ann.llm_model or DEFAULT_MODEL, ann.embedded_threads or 1
    if ann.embedded_server == "process":
        log.info("starting the embedded LLM %s (a minute or two the first time) ...", name)
        server = start_embedded_process(name, threads=threads, dtype=ann.embedded_dtype,
                                        node_cache_mb=ann.embedded_node_cache_mb)
    else:
        server = start_embedded_server(model=name, threads=threads, dtype=ann.embedded_dtype,
                                       node_cache_mb=ann.embedded_node_cache_mb)
    return LLMEndpoint((server.url,), server.model), server


# ---------------------------------------------------------------------- the built-in annotators
def answer_tokens(prompt: str, embedded_model: Optional[str]) -> Optional[int]:
    """Tokens asked per caption: 1 for the short prompt on one of the packaged embedded judges, else
    None (the annotator's default: 2 for the short prompt, where a model may open its answer with a
    space or a newline). The packaged judges' first token is the label (``tests/test_serve.py``),
    so a second token costs a model step and changes no score."""
    from ..serve.models import MODELS

    return 1 if prompt == "short" and embedded_model in MODELS else None


def _build_llm(ann, *, seed: int = 0):
    from ..annotators import OpenAIAnnotator

    endpoint, server = start_llm(ann)
    # the embedded server gets ONI's short yes/no prompt scored by logprobs; a URL gets the tagged prompt
    prompt = ann.llm_prompt if ann.llm_prompt != "auto" else ("short" if server is not None else "tagged")
    small = prompt == "short"
    try:
        annotator = OpenAIAnnotator(
            list(endpoint.urls), endpoint.model, goal=ann.goal, prompt=prompt, use_logprobs=small,
            ranking="scores" if small else "direct", batch_size=ann.llm_batch_size,
            max_concurrency=ann.llm_concurrency, timeout_s=ann.llm_timeout, api_key=ann.llm_api_key,
            max_tokens=answer_tokens(prompt, endpoint.model if server is not None else None),
        )
        _check_llm(annotator)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    return annotator, server


def _build_scripted(ann, *, seed: int = 0):
    from ..annotators import ScriptedAnnotator

    return ScriptedAnnotator(goal=ann.goal), None


def _build_teacher(ann, *, seed: int = 0):
    import math

    from ..annotators import SimulatedTeacher

    beta = math.inf if ann.teacher_beta is None else ann.teacher_beta
    return SimulatedTeacher(ann.goal, beta=beta, epsilon=ann.teacher_epsilon, seed=seed), None


def _build_store(ann, *, seed: int = 0):
    from ..annotators import NoNewLabels

    return NoNewLabels(), None


register_annotator(AnnotatorType(
    "llm", "an LLM server: --llm-url (OpenAI-compatible, a pool of several) or the embedded CPU server",
    _build_llm, llm=True, judged=True,
))
register_annotator(AnnotatorType("scripted", "hand-written rules, no LLM", _build_scripted))
register_annotator(AnnotatorType(
    "teacher", "the rules with B-Pref noise (--teacher-beta, --teacher-epsilon): label-efficiency experiments",
    _build_teacher,
))
register_annotator(AnnotatorType(
    "store", "no new labels: only those of --labels-from (earlier runs' caption stores); captions they do not "
    "cover are skipped and pay nothing", _build_store, answers=False,
))
