"""An aiohttp client that asks any OpenAI-compatible server (vLLM, FastChat, llama.cpp, our
embedded CPU server) to label NetHack messages.

Two endpoints:

* ``api="completions"`` (``/v1/completions``): ``batch_size`` prompts per request (ONI sent 100),
  rendered to plain text (Llama-3 chat layout for Llama-3 models, as ONI did);
* ``api="chat"`` (``/v1/chat/completions``): one request per caption.

Either way at most ``max_concurrency`` requests are in flight.

Server faults never escape ``annotate``/``compare``: 5xx, 429, timeouts, connection errors,
malformed JSON and a wrong number of choices are retried with exponential backoff
(``max_retries`` times), then returned as failed labels whose ``error`` names the fault, for the
caller to queue again later. Answers that cannot be parsed are returned with
``error="unparsable"`` (never turned into 0). A **circuit breaker** stops sending after
``circuit_failures`` consecutive failed requests: for ``circuit_cooldown_s`` every call fails at
once with ``error="circuit open"``, then one request probes the server again.

Choices are matched to prompts by their ``index`` field; a response whose indices do not cover
the batch exactly fails as a whole (``"wrong count"``) rather than risk giving a caption someone
else's label.

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
    >>> OpenAIAnnotator("ftp://x", "m")
    Traceback (most recent call last):
    ...
    ValueError: invalid LLM server URL 'ftp://x': expected http(s)://host:port[/v1]
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import aiohttp

from torchrl_oni.annotators import prompts as P
from torchrl_oni.annotators.base import (
    FIRST,
    SECOND,
    TIE,
    AnnotatorStats,
    Label,
    Preference,
    Provenance,
)
from torchrl_oni.annotators.parsing import (
    parse_label,
    parse_preference,
    parse_yes_no,
    score_from_top_logprobs,
)

# Failures worth asking again (server overloaded, restarting, or answering garbage).
_SERVER_FAULTS = ("http 429", "connection error", "malformed json", "wrong count")


class AnnotatorUnavailable(RuntimeError):
    """The LLM server cannot be used: unreachable, not OpenAI-compatible, or model not served."""


class _RequestFailed(Exception):
    def __init__(self, kind: str, detail: str = "", retryable: bool = True) -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail
        self.retryable = retryable


def normalize_base_url(url: str) -> str:
    """``host:port`` / ``http://host:port`` / ``http://host:port/v1/`` → ``http://host:port/v1``.

    Raises:
        ValueError: with a one-line message when the URL cannot point at an HTTP server.
    """
    text = (url or "").strip()
    if text and "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ValueError(f"invalid LLM server URL {url!r}: expected http(s)://host:port[/v1]")
    path = parts.path.rstrip("/") or "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


class CircuitBreaker:
    """Opens after ``failures`` consecutive failures; stays open for ``cooldown_s``.

    After the cool-down the next request is let through; its failure re-opens the breaker at once,
    its success closes it.

    Example:
        >>> cb = CircuitBreaker(failures=2, cooldown_s=60.0)
        >>> cb.record_failure(); cb.allow()
        True
        >>> cb.record_failure(); cb.allow()
        False
    """

    def __init__(self, failures: int = 5, cooldown_s: float = 30.0, clock=time.monotonic) -> None:
        self.failures = max(1, int(failures))
        self.cooldown_s = float(cooldown_s)
        self._clock = clock
        self.consecutive = 0
        self._open_until = 0.0

    def allow(self) -> bool:
        return self._clock() >= self._open_until

    @property
    def is_open(self) -> bool:
        return not self.allow()

    def record_success(self) -> None:
        self.consecutive = 0
        self._open_until = 0.0

    def record_failure(self) -> None:
        self.consecutive += 1
        if self.consecutive >= self.failures:
            self._open_until = self._clock() + self.cooldown_s


class _Answer:
    __slots__ = ("text", "positions", "error")

    def __init__(self, text: str = "", positions=None, error: Optional[str] = None) -> None:
        self.text = text
        self.positions = positions
        self.error = error


class OpenAIAnnotator:
    """Labels captions through an OpenAI-compatible HTTP server (aiohttp, async, fault tolerant).

    Args:
        base_url: the server, e.g. ``http://gpu-node:9001/v1`` (``host:port`` is accepted).
        model: the served model name (see :meth:`check`).
        api: ``"completions"`` (batched prompts) or ``"chat"`` (one request per caption).
        batch_size: prompts per ``/v1/completions`` request.
        max_concurrency: requests in flight at once.
        timeout_s: per-request time limit.
        max_retries: extra attempts for a failed request.
        backoff_s: first retry delay; doubles per attempt (with jitter) up to ``max_backoff_s``.
        max_backoff_s: longest retry delay.
        goal: ``"default"``, ``"combat"``, ``"gold"``, ``"stairs"`` or ``"zero-knowledge"``.
        prompt: ``"tagged"`` (ONI-style reasoning + ``<label>``) or ``"short"`` (one ``yes``/``no``
            token, for small models).
        use_logprobs: ask for token logprobs and fill ``Label.score``.
        top_logprobs: how many alternatives per token to ask for.
        score_threshold: with a score, the label is ``score >= score_threshold``.
        temperature: sampling temperature (ONI: 0.1).
        max_tokens: answer length limit; ``None`` picks 512 (tagged/ranking) or 2 (short).
        ranking: ``"direct"``, ``"both_orders"`` or ``"scores"`` (see the module docstring).
        tie_margin: in ``"scores"`` mode, score differences up to this are a tie.
        text_style: how ``/v1/completions`` prompts are laid out: ``"plain"`` or ``"llama-3"``;
            ``None`` picks ``"llama-3"`` when the model name says so.
        api_key: sent as a bearer token (local servers ignore it).
        circuit_failures: consecutive failed requests that open the circuit breaker.
        circuit_cooldown_s: how long the breaker stays open.

    Raises:
        ValueError: for an invalid URL or option (one-line message).

    Example:
        >>> ann = OpenAIAnnotator("http://127.0.0.1:8000/v1", "qwen", api="chat", prompt="short",
        ...                       use_logprobs=True, ranking="scores")
        >>> ann.provenance
        Provenance(annotator='openai', model='qwen', prompt_version='cls-short-v1:default')
        >>> ann.ranking_provenance.prompt_version
        'cls-short-v1:default/scores'
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api: str = "completions",
        batch_size: int = 100,
        max_concurrency: int = 4,
        timeout_s: float = 60.0,
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
        api_key: str = "EMPTY",
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 30.0,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        if not model:
            raise ValueError("model name is empty: pass the name the server lists at /v1/models")
        if api not in ("completions", "chat"):
            raise ValueError(f"unknown api {api!r}; choose 'completions' or 'chat'")
        if prompt not in ("tagged", "short"):
            raise ValueError(f"unknown prompt {prompt!r}; choose 'tagged' or 'short'")
        if ranking not in ("direct", "both_orders", "scores"):
            raise ValueError(
                f"unknown ranking mode {ranking!r}; choose direct, both_orders or scores"
            )
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("batch_size and max_concurrency must be >= 1, max_retries >= 0, "
                             "timeout_s > 0")
        self.model = model
        self.api = api
        self.batch_size = int(batch_size)
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.goal = P.canonical_goal(goal)
        self.prompt = prompt
        self.use_logprobs = bool(use_logprobs)
        self.top_logprobs = int(top_logprobs)
        self.score_threshold = float(score_threshold)
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.ranking = ranking
        self.tie_margin = float(tie_margin)
        self.text_style = text_style or P.default_text_style(model)
        P.render_text([], self.text_style)  # validates the style
        self.api_key = api_key
        self.breaker = CircuitBreaker(circuit_failures, circuit_cooldown_s)
        self.stats = AnnotatorStats()
        self.provenance = Provenance("openai", model, P.prompt_version(prompt, self.goal))
        rank_version = (
            f"{P.prompt_version(prompt, self.goal)}/scores"
            if ranking == "scores"
            else f"{P.prompt_version('ranking', self.goal)}/{ranking}"
        )
        self.ranking_provenance = Provenance("openai", model, rank_version)
        self._session: Optional[aiohttp.ClientSession] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._semaphore: Optional[asyncio.Semaphore] = None

    # ------------------------------------------------------------------ session management
    def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to one event loop; a new loop (e.g. another asyncio.run) gets
            # its own session and semaphore, and the old one is dropped without awaiting.
            if self._session is not None and not self._session.closed:
                self._drop_session(self._session, self._loop)
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._session

    @staticmethod
    def _drop_session(session: aiohttp.ClientSession, loop) -> None:
        """Releases a session that belongs to another event loop (it cannot be awaited here)."""
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(session.close(), loop)
            return
        connector = session.connector
        session.detach()
        # The loop is closed: only aiohttp's synchronous bookkeeping is left to do.
        close_now = getattr(connector, "_close", None)
        if callable(close_now):
            try:
                close_now()
            except Exception:  # noqa: BLE001 - best effort on a dead loop
                pass

    async def aclose(self) -> None:
        """Closes the HTTP session. Safe to call twice, and from another event loop."""
        session, self._session = self._session, None
        if session is None or session.closed:
            return
        if self._loop is asyncio.get_running_loop():
            await session.close()
        else:
            self._drop_session(session, self._loop)

    async def __aenter__(self) -> "OpenAIAnnotator":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ health check
    async def check(self) -> List[str]:
        """Lists the served models; fails clearly if the server or the model is unusable.

        Returns:
            the model names the server lists at ``/v1/models``.

        Raises:
            AnnotatorUnavailable: one-line reason (unreachable, not OpenAI-compatible, unknown
                model with the served names).
        """
        session = self._ensure_session()
        url = f"{self.base_url}/models"
        limit = min(self.timeout_s, 10.0)
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                body = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            raise AnnotatorUnavailable(
                f"LLM server at {self.base_url} did not answer /models within {limit:g} s"
            ) from None
        except aiohttp.ClientError as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise AnnotatorUnavailable(
                f"cannot reach LLM server at {self.base_url}: {reason}"
            ) from None
        if status != 200:
            raise AnnotatorUnavailable(
                f"LLM server at {self.base_url} answered HTTP {status} to GET /models "
                "(is this an OpenAI-compatible /v1 URL?)"
            )
        try:
            data = json.loads(body)
            names = [str(m["id"]) for m in data["data"]]
        except (ValueError, KeyError, TypeError):
            raise AnnotatorUnavailable(
                f"LLM server at {self.base_url} sent an unexpected /models answer "
                "(is this an OpenAI-compatible /v1 URL?)"
            ) from None
        if self.model not in names:
            raise AnnotatorUnavailable(
                f"model {self.model!r} is not served at {self.base_url}; "
                f"served: {', '.join(names) or 'none'}"
            )
        return names

    # ------------------------------------------------------------------ one HTTP request
    async def _post(self, path: str, payload: Dict[str, Any]) -> Dict[str, Any]:
        if not self.breaker.allow():
            raise _RequestFailed("circuit open", retryable=False)
        session = self._ensure_session()
        start = time.perf_counter()
        self.stats.requests += 1
        try:
            async with session.post(f"{self.base_url}{path}", json=payload) as resp:
                status = resp.status
                body = await resp.read()
        except asyncio.TimeoutError:
            raise _RequestFailed("timeout") from None
        except aiohttp.ClientError as err:
            raise _RequestFailed("connection error", type(err).__name__) from None
        finally:
            self.stats.latency_s_total += time.perf_counter() - start
        if status == 429 or status >= 500:
            raise _RequestFailed(f"http {status}")
        if status >= 400:
            # The request itself is wrong (unknown model, bad parameter): retrying cannot help.
            detail = " ".join(body[:200].decode("utf-8", "replace").split())
            raise _RequestFailed(f"http {status}", detail, retryable=False)
        try:
            data = json.loads(body)
        except ValueError:
            raise _RequestFailed("malformed json") from None
        if not isinstance(data, dict):
            raise _RequestFailed("malformed json")
        return data

    def _choices_by_index(self, data: Dict[str, Any], n: int) -> List[Dict[str, Any]]:
        choices = data.get("choices")
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise _RequestFailed("malformed json")
        if len(choices) != n:
            raise _RequestFailed("wrong count", f"{len(choices)} choices for {n} prompts")
        out: List[Optional[Dict[str, Any]]] = [None] * n
        for pos, choice in enumerate(choices):
            index = choice.get("index", pos if n == 1 else None)
            if not isinstance(index, int) or not 0 <= index < n or out[index] is not None:
                raise _RequestFailed("wrong count", f"bad choice index {index!r}")
            out[index] = choice
        return out  # type: ignore[return-value]

    def _count_failure(self, kind: str) -> None:
        self.stats.count_error(kind)
        if kind == "timeout":
            self.stats.timeouts += 1
        elif kind != "circuit open" and (
            kind.startswith("http 5") or kind == "http 429" or kind in _SERVER_FAULTS
        ):
            self.stats.server_errors += 1

    async def _request_with_retries(self, path: str, payload: Dict[str, Any], n: int):
        last: Optional[_RequestFailed] = None
        for attempt in range(self.max_retries + 1):
            try:
                self._ensure_session()
                async with self._semaphore:  # type: ignore[union-attr]
                    data = await self._post(path, payload)
                choices = self._choices_by_index(data, n)
                self.breaker.record_success()
                return choices
            except _RequestFailed as failure:
                last = failure
                self._count_failure(failure.kind)
                if failure.kind == "circuit open":
                    break
                self.breaker.record_failure()
                if not failure.retryable or attempt == self.max_retries:
                    break
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                await asyncio.sleep(delay * (0.5 + 0.5 * random.random()))
        assert last is not None
        raise last

    # ------------------------------------------------------------------ prompts → answers
    def _max_tokens(self, family: str) -> int:
        if self.max_tokens is not None:
            return int(self.max_tokens)
        return 2 if family == "short" else 512

    def _payload(
        self, family: str, conversations: Sequence[List[Dict[str, str]]]
    ) -> Dict[str, Any]:
        stop = {"tagged": ["</label>"], "ranking": ["</best>"], "short": ["\n"]}[family]
        payload: Dict[str, Any] = {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self._max_tokens(family),
            "stop": stop,
        }
        if self.api == "completions":
            payload["prompt"] = [P.render_text(c, self.text_style) for c in conversations]
            if self.use_logprobs:
                payload["logprobs"] = self.top_logprobs
        else:
            payload["messages"] = conversations[0]
            if self.use_logprobs:
                payload["logprobs"] = True
                payload["top_logprobs"] = self.top_logprobs
        return payload

    @staticmethod
    def _text_and_positions(choice: Dict[str, Any]) -> Tuple[str, Optional[list]]:
        if "message" in choice:
            message = choice.get("message") or {}
            text = message.get("content") if isinstance(message, dict) else None
        else:
            text = choice.get("text")
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise _RequestFailed("malformed json")
        positions = None
        logprobs = choice.get("logprobs")
        try:
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                positions = []
                for entry in logprobs["content"]:
                    top = {t["token"]: float(t["logprob"]) for t in entry.get("top_logprobs") or []}
                    top.setdefault(entry["token"], float(entry["logprob"]))
                    positions.append((entry["token"], top))
            elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
                tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
                positions = [
                    (tok, {k: float(v) for k, v in (top or {}).items()})
                    for tok, top in zip(logprobs["tokens"], tops)
                ]
        except (KeyError, TypeError, ValueError):
            positions = None  # a server's odd logprob layout must not cost us the label
        return text, positions

    async def _ask_chunk(self, family, conversations, answers, indices) -> None:
        path = "/completions" if self.api == "completions" else "/chat/completions"
        try:
            choices = await self._request_with_retries(
                path, self._payload(family, [conversations[i] for i in indices]), len(indices)
            )
            for i, choice in zip(indices, choices):
                try:
                    text, positions = self._text_and_positions(choice)
                    answers[i] = _Answer(text, positions)
                except _RequestFailed as failure:
                    self._count_failure(failure.kind)
                    answers[i] = _Answer(error=failure.kind)
        except _RequestFailed as failure:
            for i in indices:
                answers[i] = _Answer(error=failure.kind)
        except Exception as err:  # noqa: BLE001 - a bug in one request must not kill the worker
            kind = f"client error: {type(err).__name__}"
            self.stats.count_error(kind)
            for i in indices:
                answers[i] = _Answer(error=kind)

    async def _ask(self, family: str, conversations: List[List[Dict[str, str]]]) -> List[_Answer]:
        answers: List[Optional[_Answer]] = [None] * len(conversations)
        if not conversations:
            return []
        self._ensure_session()
        step = self.batch_size if self.api == "completions" else 1
        chunks = [list(range(i, min(i + step, len(conversations))))
                  for i in range(0, len(conversations), step)]
        await asyncio.gather(*(self._ask_chunk(family, conversations, answers, c) for c in chunks))
        return answers  # type: ignore[return-value]

    # ------------------------------------------------------------------ public API
    def _conversation(self, caption: str) -> List[Dict[str, str]]:
        if self.prompt == "short":
            return P.short_messages(caption, self.goal)
        return P.classification_messages(caption, self.goal)

    def _label(self, answer: _Answer) -> Label:
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
        if value is None:
            self.stats.unparsable += 1
            self.stats.count_error("unparsable")
            return Label(value=None, provenance=self.provenance, error="unparsable",
                         raw=answer.text)
        self.stats.labelled += 1
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
                self.stats.unparsable += 1
                self.stats.count_error("unparsable")
            return Preference(value=None, provenance=self.ranking_provenance, error=error, raw=raw)
        self.stats.labelled += 1
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
