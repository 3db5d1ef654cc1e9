"""Where the LLM servers are and how to reach them: the per-server side of
:class:`~torchrl_oni.annotators.client.LLMClient` that is not pacing.

* :func:`normalize_base_url` — ``host:port`` and friends → ``http(s)://host:port/v1``
  (``_as_url_list``: a pool's list of them, without repeats);
* ``_auth_headers`` — the ``Authorization`` header from ``api_key`` or ``OPENAI_API_KEY``;
* ``_Endpoint`` — one server of a pool: its URL, circuit breaker, request sizer (from
  :mod:`torchrl_oni.annotators.pacing`), load and counters;
* ``_fetch_models`` and :func:`resolve_model` — ``GET /v1/models``: what a server serves, and
  the model to ask before a client is built;
* :class:`AnnotatorUnavailable` — the one-line error for a server that cannot be used.

Example:
    >>> from torchrl_oni.annotators.endpoints import normalize_base_url
    >>> normalize_base_url("gpu-1:8000"), normalize_base_url("https://llm.lan/v1/")
    ('http://gpu-1:8000/v1', 'https://llm.lan/v1')
    >>> normalize_base_url("ftp://x")
    Traceback (most recent call last):
    ...
    ValueError: invalid LLM server URL 'ftp://x': expected http(s)://host:port[/v1]
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
from typing import Dict, List, Optional, Sequence, Union
from urllib.parse import urlsplit

import aiohttp

from torchrl_oni.annotators.pacing import CircuitBreaker, RequestSizer, _RateMeter

__all__ = [
    "API_KEY_ENV",
    "AUTH_ERROR",
    "AnnotatorUnavailable",
    "normalize_base_url",
    "resolve_model",
]

API_KEY_ENV = "OPENAI_API_KEY"
AUTH_ERROR = "server refused the API key"


class AnnotatorUnavailable(RuntimeError):
    """The LLM server cannot be used: unreachable, not OpenAI-compatible, or model not served."""


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


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(str(text).split())[:limit]

class _Endpoint:
    """One server of the pool: its URL, breaker, request sizer, load and counters."""

    def __init__(self, index: int, url: str, sizer: RequestSizer, breaker: CircuitBreaker, clock) -> None:
        self.index = index
        self.url = url
        self.sizer = sizer
        self.breaker = breaker
        self.in_flight = 0
        self.last_pick = 0.0
        self.counts: Dict[str, int] = collections.Counter()
        self.labels = _RateMeter(clock)
        self.next_probe = 0.0
        self.probe_task: Optional[asyncio.Task] = None
        self.last_error = ""

    def limit(self) -> int:
        # A half-open breaker lets one request through, not a volley.
        return 1 if self.breaker.state == "half-open" else self.sizer.concurrency


async def _fetch_models(session: aiohttp.ClientSession, base_url: str, limit_s: float) -> List[str]:
    """The model names ``GET {base_url}/models`` lists; one-line :class:`AnnotatorUnavailable`."""
    url = f"{base_url}/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit_s)) as resp:
            body = await resp.read()
            status = resp.status
    except asyncio.TimeoutError:
        raise AnnotatorUnavailable(
            f"LLM server at {base_url} did not answer /models within {limit_s:g} s"
        ) from None
    except aiohttp.ClientError as err:
        reason = _one_line(err) or type(err).__name__
        raise AnnotatorUnavailable(f"cannot reach LLM server at {base_url}: {reason}") from None
    if status in (401, 403):
        raise AnnotatorUnavailable(
            f"LLM server at {base_url} {AUTH_ERROR} (HTTP {status}): pass it with --llm-api-key "
            f"or set {API_KEY_ENV}"
        )
    if status != 200:
        raise AnnotatorUnavailable(
            f"LLM server at {base_url} answered HTTP {status} to GET /models "
            "(is this an OpenAI-compatible /v1 URL?)"
        )
    try:
        data = json.loads(body)
        return [str(m["id"]) for m in data["data"]]
    except (ValueError, KeyError, TypeError):
        raise AnnotatorUnavailable(
            f"LLM server at {base_url} sent an unexpected /models answer "
            "(is this an OpenAI-compatible /v1 URL?)"
        ) from None


def _auth_headers(api_key: Optional[str]) -> Dict[str, str]:
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def _as_url_list(base_url: Union[str, Sequence[str]]) -> List[str]:
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not urls:
        raise ValueError("no LLM server URL given")
    normal = [normalize_base_url(u) for u in urls]
    if len(set(normal)) != len(normal):
        raise ValueError(f"LLM server URLs given twice: {', '.join(normal)}")
    return normal


def resolve_model(
    base_url: Union[str, Sequence[str]],
    model: Optional[str] = None,
    *,
    api_key: Optional[str] = None,
    timeout_s: float = 10.0,
) -> str:
    """The model to ask: ``model`` checked against every server, or the only one they serve.

    Call it before building :class:`LLMClient` (or an annotator on one) when ``--llm-model`` is
    optional (not from a running event loop: it runs its own).

    Raises:
        AnnotatorUnavailable: one line: a server is unreachable or refuses the key, ``model``
            is not served (the served names are listed), or no model was given and the
            servers serve several (named) or different ones.
    """
    urls = _as_url_list(base_url)

    async def fetch_all() -> List[List[str]]:
        async with aiohttp.ClientSession(headers=_auth_headers(api_key)) as session:
            return [await _fetch_models(session, u, timeout_s) for u in urls]

    served = asyncio.run(fetch_all())
    if model:
        for url, names in zip(urls, served):
            if model not in names:
                raise AnnotatorUnavailable(
                    f"model {model!r} is not served at {url}; served: {', '.join(names) or 'none'}"
                )
        return model
    for url, names in zip(urls, served):
        if not names:
            raise AnnotatorUnavailable(f"LLM server at {url} serves no model")
        if len(names) > 1:
            raise AnnotatorUnavailable(
                f"LLM server at {url} serves several models ({', '.join(names)}): choose one "
                "with --llm-model"
            )
    names = {n[0] for n in served}
    if len(names) > 1:
        listing = "; ".join(f"{u}: {n[0]}" for u, n in zip(urls, served))
        raise AnnotatorUnavailable(f"LLM servers serve different models ({listing}): every "
                                   "server of a pool must serve the same one")
    return names.pop()
