"""OpenAIAnnotator: labels NetHack messages by asking one or several OpenAI-compatible servers
(vLLM, FastChat, llama.cpp, our embedded CPU server).

This module turns captions into prompts and answers into labels; the HTTP side (a pool of
servers, adaptive request sizes and time limits, retries, circuit breakers, health checks,
metrics) is the annotator's :class:`~torchrl_oni.annotators.client.LLMClient`, ``.client``,
whose module docstring gives its rules. The annotator exposes the client's settings, steering
methods (:meth:`~OpenAIAnnotator.available`, :meth:`~OpenAIAnnotator.batch_hint`,
:meth:`~OpenAIAnnotator.concurrency_hint`, :attr:`~OpenAIAnnotator.recoveries`) and metrics
(:meth:`~OpenAIAnnotator.metrics`, :meth:`~OpenAIAnnotator.recent`,
:meth:`~OpenAIAnnotator.describe`), so the annotation worker steers it like any client.

Two endpoints: ``api="completions"`` (several captions per request, rendered to plain text,
Llama-3 chat layout for Llama-3 models, as ONI did) and ``api="chat"`` (one request per
caption).

**Faults never escape** ``annotate``/``compare``: they come back as labels with ``value=None``
and an ``error`` (the client's reason: ``"timeout"``, ``"http 500"``, ``"circuit open"``,
``"server refused the API key (HTTP 401)"``...); the annotation worker puts server faults back
in the queue (never given up) and gives a caption up only after repeated unparsable answers
(``error="unparsable"``).

Logprob scoring (``use_logprobs=True``): the request asks for the top token logprobs and
``Label.score`` becomes P(positive label) / (P(positive) + P(negative)) at the label token; the
label value is then ``score >= score_threshold`` (a threshold fitted on a few labelled messages
helps small models). Pair with ``prompt="short"``, whose whole answer is ``yes``/``no``.

Ranking (``compare``) has three modes: ``"direct"`` (ONI: one ranking prompt per pair),
``"both_orders"`` (ask (a, b) and (b, a); agreement wins, disagreement is a tie, which cancels
position bias) and ``"scores"`` (classify both captions and compare their scores, the reliable
choice for small models). Identical captions tie without a request.

Example:
    >>> from torchrl_oni.annotators.openai import OpenAIAnnotator
    >>> ann = OpenAIAnnotator("localhost:9001", "Meta-Llama-3.1-8B-Instruct", goal="combat")
    >>> ann.base_url, ann.provenance.prompt_version
    ('http://localhost:9001/v1', 'cls-tagged-v1:combat')
    >>> pool = OpenAIAnnotator(["gpu-1:8000", "gpu-2:8000"], "m")
    >>> pool.base_urls
    ['http://gpu-1:8000/v1', 'http://gpu-2:8000/v1']
    >>> OpenAIAnnotator("ftp://x", "m")
    Traceback (most recent call last):
    ...
    ValueError: invalid LLM server URL 'ftp://x': expected http(s)://host:port[/v1]
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from torchrl_oni.annotators import prompts as P
from torchrl_oni.annotators.base import (
    FIRST,
    SECOND,
    TIE,
    Label,
    Preference,
    Provenance,
)
from torchrl_oni.annotators.client import Completion, LLMClient, LLMClientFacade, client_attribute
from torchrl_oni.annotators.parsing import (
    parse_label,
    parse_preference,
    parse_yes_no,
    score_from_top_logprobs,
)

__all__ = ["OpenAIAnnotator"]

# The stop strings of each prompt family (the answer ends with its label / choice / line).
_STOPS = {"tagged": ["</label>"], "ranking": ["</best>"], "short": ["\n"]}
# (the model named, the labels' provenance, the preferences' provenance)
_Provenances = Tuple[Optional[str], Provenance, Provenance]


class OpenAIAnnotator(LLMClientFacade):
    """Labels captions through one or several OpenAI-compatible HTTP servers, with an
    :class:`~torchrl_oni.annotators.client.LLMClient` (``.client``; see the module docstrings).

    Args:
        base_url: the server, e.g. ``http://gpu-node:9001/v1`` (``host:port`` is accepted), or
            a list of servers that all serve ``model`` (a pool).
        model: the served model name (see :func:`~torchrl_oni.annotators.endpoints.resolve_model`);
            ``None``: the only model the servers serve, found by :meth:`check` (which must then be
            awaited first).
        api: ``"completions"`` (batched prompts) or ``"chat"`` (one request per caption).
        goal: ``"default"``, ``"combat"``, ``"gold"``, ``"stairs"`` or ``"zero-knowledge"``.
        prompt: ``"tagged"`` (ONI-style reasoning + ``<label>``) or ``"short"`` (one ``yes``/``no``
            token, for small models).
        use_logprobs: ask for token logprobs and fill ``Label.score``.
        score_threshold: with a score, the label is ``score >= score_threshold``.
        temperature: sampling temperature (ONI: 0.1).
        max_tokens: answer length limit; ``None`` picks 512 (tagged/ranking) or 2 (short).
        ranking: ``"direct"``, ``"both_orders"`` or ``"scores"`` (see the module docstring).
        tie_margin: in ``"scores"`` mode, score differences up to this are a tie.
        batch_size, max_concurrency, timeout_s, adaptive, initial_batch_size, target_latency_s,
        min_timeout_s, max_timeout_s, first_timeout_s, max_retries, backoff_s, max_backoff_s,
        top_logprobs, text_style, api_key, circuit_failures, circuit_cooldown_s,
        probe_interval_s, clock: the HTTP client's options, given to its
            :class:`~torchrl_oni.annotators.client.LLMClient` (documented there).

    Raises:
        ValueError: for an invalid URL or option (one-line message).

    Example:
        >>> ann = OpenAIAnnotator("http://127.0.0.1:8000/v1", "qwen", api="chat", prompt="short",
        ...                       use_logprobs=True, ranking="scores")
        >>> ann.provenance
        Provenance(annotator='openai', model='qwen', prompt_version='cls-short-v1:default')
        >>> ann.ranking_provenance.prompt_version
        'cls-short-v1:default/scores'
        >>> ann.client.api, ann.api
        ('chat', 'chat')
    """

    def __init__(
        self,
        base_url: Union[str, Sequence[str]],
        model: Optional[str],
        *,
        api: str = "completions",
        batch_size: int = 100,
        max_concurrency: int = 4,
        timeout_s: Optional[float] = None,
        adaptive: bool = True,
        initial_batch_size: int = 4,
        target_latency_s: float = 10.0,
        min_timeout_s: float = 30.0,
        max_timeout_s: float = 600.0,
        first_timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        goal: str = "default",
        prompt: str = "tagged",
        use_logprobs: bool = False,
        top_logprobs: int = 5,
        score_threshold: float = 0.5,
        temperature: float = 0.1,
        max_tokens: Optional[int] = None,
        ranking: str = "direct",
        tie_margin: float = 0.1,
        text_style: Optional[str] = None,
        api_key: Optional[str] = None,
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 30.0,
        probe_interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = LLMClient(
            base_url, model, api=api, batch_size=batch_size, max_concurrency=max_concurrency,
            timeout_s=timeout_s, adaptive=adaptive, initial_batch_size=initial_batch_size,
            target_latency_s=target_latency_s, min_timeout_s=min_timeout_s,
            max_timeout_s=max_timeout_s, first_timeout_s=first_timeout_s, max_retries=max_retries,
            backoff_s=backoff_s, max_backoff_s=max_backoff_s, top_logprobs=top_logprobs,
            temperature=temperature, max_tokens=max_tokens, text_style=text_style, api_key=api_key,
            circuit_failures=circuit_failures, circuit_cooldown_s=circuit_cooldown_s,
            probe_interval_s=probe_interval_s, clock=clock)
        if prompt not in ("tagged", "short"):
            raise ValueError(f"unknown prompt {prompt!r}; choose 'tagged' or 'short'")
        if ranking not in ("direct", "both_orders", "scores"):
            raise ValueError(
                f"unknown ranking mode {ranking!r}; choose direct, both_orders or scores"
            )
        self.goal = P.canonical_goal(goal)
        self.prompt = prompt
        self.use_logprobs = bool(use_logprobs)
        self.score_threshold = float(score_threshold)
        self.ranking = ranking
        self.tie_margin = float(tie_margin)
        self._provenances = self._make_provenances(model)

    # ------------------------------------------------------------------ the client's
    # (base_url, base_urls, model, api, stats, recoveries, check, aclose, the steering methods
    # and metrics come from LLMClientFacade)
    batch_size = client_attribute("batch_size", "Most prompts per ``/v1/completions`` request.")
    max_concurrency = client_attribute("max_concurrency", "Most requests in flight, per server.")
    timeout_s = client_attribute("timeout_s", "The fixed time limit per request (or ``None``).")
    max_retries = client_attribute("max_retries", "Extra attempts for a failed request.")
    backoff_s = client_attribute("backoff_s", "The first retry delay.")
    max_backoff_s = client_attribute("max_backoff_s", "The longest retry delay.")
    probe_interval_s = client_attribute("probe_interval_s", "Seconds between health checks.")
    top_logprobs = client_attribute("top_logprobs", "Alternatives asked for per token.")
    temperature = client_attribute("temperature", "The sampling temperature.")
    max_tokens = client_attribute("max_tokens", "The answer length limit (or ``None``).")
    text_style = client_attribute("text_style", "The ``/v1/completions`` prompt layout.")
    api_key = client_attribute("api_key", "The bearer token given (``None``: ``OPENAI_API_KEY``).")
    breaker = client_attribute("breaker", "The first server's circuit breaker.")
    # the tests look at the headers sent and at each server of a pool
    _headers = client_attribute("_headers", "The HTTP headers sent with every request.")
    _endpoints = client_attribute("_endpoints", "The servers of the pool.")

    async def __aenter__(self) -> "OpenAIAnnotator":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def complete(
        self,
        conversations: Sequence[List[Dict[str, str]]],
        *,
        stop: Optional[List[str]] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        logprobs: bool = False,
    ) -> List[Completion]:
        """Sends chat prompts of any kind through the client (:meth:`LLMClient.complete
        <torchrl_oni.annotators.client.LLMClient.complete>`); one :class:`Completion` per
        prompt, in order, failures included."""
        return await self.client.complete(conversations, stop=stop, max_tokens=max_tokens,
                                          temperature=temperature, logprobs=logprobs)

    def record_parse(self, parsed: bool, completion: Optional[Completion] = None) -> None:
        """Counts what was made of an answer of :meth:`complete` (see :meth:`LLMClient.record_parse
        <torchrl_oni.annotators.client.LLMClient.record_parse>`)."""
        self.client.record_parse(parsed, completion)

    # ------------------------------------------------------------------ provenance
    def _make_provenances(self, model: Optional[str]) -> _Provenances:
        labels = Provenance("openai", model or "", P.prompt_version(self.prompt, self.goal))
        rank_version = (
            f"{P.prompt_version(self.prompt, self.goal)}/scores"
            if self.ranking == "scores"
            else f"{P.prompt_version('ranking', self.goal)}/{self.ranking}"
        )
        return model, labels, Provenance("openai", model or "", rank_version)

    def _current_provenances(self) -> _Provenances:
        # check() may find the model after construction: the provenances then name it.
        if self._provenances[0] != self.client.model:
            self._provenances = self._make_provenances(self.client.model)
        return self._provenances

    @property
    def provenance(self) -> Provenance:
        """The provenance of the labels: ``openai``, the model, the classification prompt."""
        return self._current_provenances()[1]

    @property
    def ranking_provenance(self) -> Provenance:
        """The provenance of the preferences: ``openai``, the model, the ranking mode."""
        return self._current_provenances()[2]

    # ------------------------------------------------------------------ prompts → answers
    async def _ask(self, family: str, conversations: Sequence[List[Dict[str, str]]]) -> List[Completion]:
        """:meth:`complete` with the stop strings and answer length of a prompt family."""
        max_tokens = self.max_tokens if self.max_tokens is not None else (2 if family == "short" else 512)
        return await self.complete(conversations, stop=_STOPS[family], max_tokens=max_tokens,
                                   logprobs=self.use_logprobs)

    # ------------------------------------------------------------------ public API
    def _conversation(self, caption: str) -> List[Dict[str, str]]:
        if self.prompt == "short":
            return P.short_messages(caption, self.goal)
        return P.classification_messages(caption, self.goal)

    def _label(self, answer: Completion) -> Label:
        if answer.error is not None:
            return Label(value=None, provenance=self.provenance, error=answer.error)
        if self.prompt == "short":
            value = parse_yes_no(answer.text)
            pos, neg = P.SHORT_POSITIVE, P.SHORT_NEGATIVE
        else:
            value = parse_label(answer.text)
            pos, neg = P.POSITIVE_TOKEN, P.NEGATIVE_TOKEN
        score = None
        if self.use_logprobs and answer.positions:
            score = score_from_top_logprobs(answer.positions, pos, neg)
            if score is not None:
                value = 1.0 if score >= self.score_threshold else 0.0
        self.record_parse(value is not None, answer)
        if value is None:
            return Label(value=None, provenance=self.provenance, error="unparsable",
                         raw=answer.text)
        return Label(value=value, provenance=self.provenance, score=score, raw=answer.text)

    async def annotate(self, captions: Sequence[str]) -> List[Label]:
        """One :class:`Label` per caption, in order; failures have ``value=None`` and ``error``."""
        captions = list(captions)
        self.stats.captions += len(captions)
        answers = await self._ask(self.prompt, [self._conversation(c) for c in captions])
        return [self._label(a) for a in answers]

    def _preference(
        self, value: Optional[float], error: Optional[str], raw: str = ""
    ) -> Preference:
        if value is None:
            error = error or "unparsable"
            if error == "unparsable":
                self.record_parse(False)
            return Preference(value=None, provenance=self.ranking_provenance, error=error, raw=raw)
        self.record_parse(True)
        return Preference(value=value, provenance=self.ranking_provenance, raw=raw)

    async def compare(self, pairs: Sequence[Tuple[str, str]]) -> List[Preference]:
        """One :class:`Preference` (P(second is better)) per pair, in order; failures included."""
        pairs = [(str(a), str(b)) for a, b in pairs]
        self.stats.captions += len(pairs)
        results: List[Optional[Preference]] = [None] * len(pairs)
        todo = []
        for i, (a, b) in enumerate(pairs):
            if a == b:  # nothing to compare: a tie, as Motif does, without asking
                results[i] = Preference(value=TIE, provenance=self.ranking_provenance)
            else:
                todo.append(i)
        if not todo:
            return results  # type: ignore[return-value]
        if self.ranking == "scores":
            await self._compare_by_scores(pairs, todo, results)
        else:
            convs = [P.ranking_messages(*pairs[i], self.goal) for i in todo]
            if self.ranking == "both_orders":
                convs += [P.ranking_messages(pairs[i][1], pairs[i][0], self.goal) for i in todo]
            answers = await self._ask("ranking", convs)
            for k, i in enumerate(todo):
                ab = answers[k]
                if self.ranking == "direct":
                    v = None if ab.error else parse_preference(ab.text)
                    results[i] = self._preference(v, ab.error, ab.text)
                    continue
                ba = answers[k + len(todo)]
                error = ab.error or ba.error
                v1 = None if error else parse_preference(ab.text)
                v2 = None if error else parse_preference(ba.text)
                raw = f"{ab.text}\n---\n{ba.text}"
                if v1 is None or v2 is None:
                    results[i] = self._preference(None, error, raw)
                else:
                    # The swapped answer speaks about the other position: flip it back.
                    results[i] = self._preference(v1 if v1 == 1.0 - v2 else TIE, None, raw)
        return results  # type: ignore[return-value]

    async def _compare_by_scores(self, pairs, todo, results) -> None:
        unique = sorted({c for i in todo for c in pairs[i]})
        labels = dict(zip(unique, await self.annotate(unique)))
        for i in todo:
            la, lb = labels[pairs[i][0]], labels[pairs[i][1]]
            if not (la.ok and lb.ok):
                error = la.error if not la.ok else lb.error
                results[i] = Preference(value=None, provenance=self.ranking_provenance, error=error)
                continue
            sa = la.score if la.score is not None else la.value
            sb = lb.score if lb.score is not None else lb.value
            diff = sb - sa
            value = TIE if abs(diff) <= self.tie_margin else (SECOND if diff > 0 else FIRST)
            results[i] = Preference(value=value, provenance=self.ranking_provenance,
                                    raw=f"{sa:.4f} vs {sb:.4f}")
