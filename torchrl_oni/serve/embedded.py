"""An OpenAI-compatible HTTP server over a small CPU model (or a rule-based stand-in).

Routes: ``GET /v1/models``, ``POST /v1/completions`` (``prompt`` a string or a list: one choice
per prompt, ``index`` = its position), ``POST /v1/chat/completions`` (one conversation), and
``GET /health``. ``logprobs`` follows the OpenAI formats: for completions an integer ``k`` gives
``tokens`` / ``token_logprobs`` / ``top_logprobs`` (one ``{token: logprob}`` per generated token);
for chat ``logprobs: true`` + ``top_logprobs: k`` gives ``logprobs.content``. Errors are JSON
``{"error": {"message", "type", "code"}}`` with a 4xx status for bad requests.

Scoring is the cheap path: a request with ``max_tokens=1`` and ``logprobs`` costs one forward
pass, and every batch computes the prompts' shared token prefix (the template in front of the
message) once, keeping it across requests in a small cache (measured ≈3× more captions/s).
Requests that arrive together with the same sampling settings are merged into one batch. One
worker thread runs the model, so the event loop stays responsive.

Facing clients (see :class:`OpenAIServer`): an optional API key (``Authorization: Bearer``,
required by :func:`check_exposure` on any non-loopback address), a bounded queue (503 +
``Retry-After``), the work of disconnected clients dropped, read timeouts for request heads and
bodies (408), a body-size limit (413), prompt-size limits checked before and after tokenising,
and every field validated (finite numbers in range): whatever a client sends, the answer is a
4xx JSON error rather than a 500.

Backends:

* :class:`TransformersEngine` — a packaged model (see :mod:`torchrl_oni.serve.models`).
* :class:`ScriptedEngine` — no model: answers from NetHack keyword rules, in the answer format
  the prompt asks for. For tests and for measuring client overhead.

Example:
    >>> import json, urllib.request
    >>> from torchrl_oni.serve.embedded import start_embedded_server
    >>> with start_embedded_server(backend="scripted") as server:
    ...     body = json.dumps({"model": server.model, "prompt": ["You kill the newt!", "It's a wall."],
    ...                        "max_tokens": 1}).encode()
    ...     req = urllib.request.Request(server.url + "/completions", body,
    ...                                  {"Content-Type": "application/json"})
    ...     out = json.load(urllib.request.urlopen(req))
    >>> [(c["index"], c["text"]) for c in out["choices"]]
    [(0, 'yes'), (1, 'no')]
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hmac
import ipaddress
import json
import math
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from aiohttp import web

__all__ = [
    "Completion",
    "ScriptedEngine",
    "TransformersEngine",
    "OpenAIServer",
    "ServerHandle",
    "start_embedded_server",
    "make_engine",
    "check_exposure",
    "is_loopback",
    "free_port",
    "SCRIPTED_MODEL_NAME",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "PROMPT_BYTES_PER_TOKEN",
]

SCRIPTED_MODEL_NAME = "scripted"


class RequestError(Exception):
    """A client error, answered with a 4xx JSON body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers


@dataclass
class Completion:
    """One prompt's answer from an engine.

    ``top_logprobs[i]`` lists ``(token, logprob)`` candidates at generated position ``i`` (empty
    when logprobs were not asked for). ``finish_reason`` is ``"stop"`` or ``"length"`` as in the
    OpenAI API, ``"abort"`` when generation was skipped or cut because nobody waits for the
    answer any more (see ``alive`` in :meth:`TransformersEngine.complete`), or ``"error"`` when
    the engine refused the prompt; ``error`` then says why (the server answers 400).
    """

    text: str
    tokens: List[str] = field(default_factory=list)
    token_logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[List[Tuple[str, float]]] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    error: Optional[str] = None


# Engines take ``alive``: None, or a callable returning one flag per prompt, False once that
# prompt's client has gone away (called from the engine thread between model steps).
AliveFn = Optional[Callable[[], Sequence[bool]]]

# A prompt longer than ``context × PROMPT_BYTES_PER_TOKEN`` UTF-8 bytes is refused before it is
# tokenised (tokenising megabytes takes seconds of the engine thread). Text averages about 4
# bytes per token; only long runs of one character ('#', spaces) pack more, so no prompt the
# server is meant for comes near this bound.
PROMPT_BYTES_PER_TOKEN = 16


# --------------------------------------------------------------------------------------------
# Scripted engine
# --------------------------------------------------------------------------------------------
_FALLBACK_POSITIVE = re.compile(
    r"\bYou (?:kill|destroy)\b|\bexperience level\b|\bgold pieces?\b|\bstaircase down\b"
    r"|\bYou (?:climb|go) down\b|\bhidden (?:passage|door)\b|\bYou feel (?:much )?better\b",
    re.I,
)
_TAGGED = re.compile(r"<message(?:_\d)?>(.*?)</message(?:_\d)?>", re.S)


class ScriptedEngine:
    """Answers prompts from keyword rules, in the format the prompt asks for (no model).

    It finds the judged message(s) in the prompt (the last ``<message>`` tag, or the last line),
    scores them with :class:`~torchrl_oni.annotators.scripted.ScriptedAnnotator` when that module
    is available (else a one-regex rule), and answers ``<best>1|2|tie</best>`` for ranking
    prompts, ``<label>FOO|BAR</label>`` for tagged ones and ``yes``/``no`` otherwise. Its label
    token carries logprobs ``log 0.9`` / ``log 0.1``.

    Example:
        >>> eng = ScriptedEngine()
        >>> [c.text for c in eng.complete(["Message: You kill the newt!\\nProgress:", "It's a wall."])]
        ['yes', 'no']
    """

    model_name = SCRIPTED_MODEL_NAME
    max_context: Optional[int] = None  # rules have no context limit
    max_prompt_bytes: Optional[int] = None

    def __init__(self) -> None:
        try:  # lazily: the rules live with the annotators when that module exists
            from torchrl_oni.annotators.scripted import ScriptedAnnotator

            self._score = ScriptedAnnotator().score
        except Exception:  # pragma: no cover - fallback when the annotators are absent
            self._score = lambda text: 1.0 if _FALLBACK_POSITIVE.search(text or "") else 0.0

    @staticmethod
    def _messages(prompt: str) -> List[str]:
        found = _TAGGED.findall(prompt)
        if "<message_1>" in prompt and len(found) >= 2:
            return found[-2:]
        if found:
            return found[-1:]
        lines = [ln for ln in prompt.strip().splitlines() if ln.strip()]
        labelled = [ln for ln in lines if re.match(r"\s*Message\s*:", ln)]
        last = (labelled or lines or [""])[-1]
        return [re.sub(r"^\s*Message\s*:\s*", "", last)]

    def _answer(self, prompt: str) -> Tuple[str, str, str]:
        msgs = self._messages(prompt)
        if "<best>" in prompt and len(msgs) == 2:
            a, b = (self._score(m) for m in msgs)
            best = "tie" if a == b else ("2" if b > a else "1")
            return f"<best>{best}</best>", best, "tie" if best != "tie" else "1"
        positive = self._score(msgs[0]) > 0
        if "<label>" in prompt:
            pos, neg = _label_tokens(prompt)
            word = pos if positive else neg
            return f"<analysis>rule-based</analysis>\n<label>{word}</label>", word, (neg if positive else pos)
        word = "yes" if positive else "no"
        return word, word, ("no" if positive else "yes")

    def complete(self, prompts: Sequence[str], max_tokens: int = 16, temperature: float = 0.0,
                 top_logprobs: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, alive: AliveFn = None) -> List[Completion]:
        live = list(alive()) if alive is not None else [True] * len(prompts)
        out = []
        for prompt, wanted in zip(prompts, live):
            if not wanted:
                out.append(Completion(text="", finish_reason="abort"))
                continue
            text, token, other = self._answer(prompt)
            if max_tokens <= 1:
                text = token  # the label token alone, as a one-token answer would be
            top = [[(token, math.log(0.9)), (other, math.log(0.1))][: max(1, top_logprobs or 0)]]
            out.append(Completion(
                text=text, tokens=[token], token_logprobs=[math.log(0.9)],
                top_logprobs=top if top_logprobs is not None else [],
                finish_reason="length" if max_tokens <= 1 else "stop",
                prompt_tokens=len(prompt.split()),
            ))
        return out

    def render_chat(self, messages: Sequence[Dict[str, str]]) -> str:
        return "\n\n".join(str(m.get("content", "")) for m in messages)


def _label_tokens(prompt: str) -> Tuple[str, str]:
    # "<label>FOO or BAR</label>" in the requested format names the two label words.
    m = re.search(r"<label>\s*(\w+)\s+or\s+(\w+)\s*</label>", prompt)
    return (m.group(1), m.group(2)) if m else ("FOO", "BAR")


# --------------------------------------------------------------------------------------------
# Transformers engine
# --------------------------------------------------------------------------------------------
def _select(alive: Callable[[], Sequence[bool]], rows: Sequence[int]) -> Callable[[], List[bool]]:
    """``alive`` restricted to ``rows`` (one call of ``alive`` per call)."""
    def selected() -> List[bool]:
        flags = alive()
        return [flags[i] for i in rows]

    return selected


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _PrefixCache:
    """A few cached key/value tensors of prompt prefixes (batch 1), reused across batches.

    Policy: a batch's shared prefix replaces the entry it extends; a single prompt shortens the
    entry it overlaps by at least half to the overlap (so a stream of one-prompt requests
    converges on the template), otherwise it becomes a new entry (LRU).
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.entries: "OrderedDict[Tuple[int, ...], List[Tuple[Any, Any]]]" = OrderedDict()
        self.hits = 0
        self.tokens_reused = 0

    def best(self, prefix: Sequence[int]) -> Tuple[Optional[Tuple[int, ...]], int]:
        best_key, best_len = None, 0
        for key in self.entries:
            n = _common_prefix_len(key, prefix)
            if n > best_len:
                best_key, best_len = key, n
        return best_key, best_len

    def store(self, prefix: Tuple[int, ...], kv, matched_key, matched: int, shared: bool) -> None:
        if matched_key is not None and matched >= len(matched_key) / 2:
            del self.entries[matched_key]
            if shared and matched == len(matched_key):
                new_key, new_kv = prefix, kv
            else:
                new_key = prefix[:matched]
                new_kv = [(k[:, :, :matched], v[:, :, :matched]) for k, v in kv]
        else:
            new_key, new_kv = prefix, kv
        self.entries[new_key] = new_kv
        self.entries.move_to_end(new_key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


class TransformersEngine:
    """Runs a causal LM from :func:`~torchrl_oni.serve.models.load_model` on CPU.

    Args:
        loaded: a :class:`~torchrl_oni.serve.models.LoadedModel`.
        max_tokens_cap: the most tokens generated per prompt, whatever a request asks (ONI asks
            for 4096; a CPU model would take minutes). ``finish_reason`` is ``"length"`` when hit.
        max_batch: the most prompts run in one forward pass.

    Attributes:
        max_context: the model's context in tokens (prompt plus generated tokens).
        max_prompt_bytes: prompts longer than this (UTF-8 bytes) cannot fit the context in
            practice (:data:`PROMPT_BYTES_PER_TOKEN`); the server refuses them untokenised.
    """

    def __init__(self, loaded, max_tokens_cap: int = 128, max_batch: int = 32) -> None:
        import torch

        self.torch = torch
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.spec.name
        self.max_tokens_cap = max_tokens_cap
        self.max_batch = max_batch
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)
        self.max_prompt_bytes = self.max_context * PROMPT_BYTES_PER_TOKEN
        eos = set()
        for src in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(src, int):
                eos.add(src)
            elif src:
                eos.update(int(x) for x in src)
        self.eos_ids = eos
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(eos)) if eos else 0
        self.prefix_cache = _PrefixCache()

    # -- prompt handling ---------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=True)
        return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- model calls -------------------------------------------------------------------------
    def _new_cache(self, kv, batch: int):
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), layer)
        return cache

    @staticmethod
    def _cache_tensors(cache) -> List[Tuple[Any, Any]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _prefix_kv(self, prefix: Tuple[int, ...], shared: bool):
        """Key/values of ``prefix`` (batch 1), from the cache where possible."""
        torch = self.torch
        key, matched = self.prefix_cache.best(prefix)
        if key is not None and matched > 0:
            kv = [(k[:, :, :matched], v[:, :, :matched]) for k, v in self.prefix_cache.entries[key]]
            self.prefix_cache.hits += 1
            self.prefix_cache.tokens_reused += matched
        else:
            kv, matched = None, 0
        rest = prefix[matched:]
        if rest:
            cache = self._new_cache(kv, 1) if kv else None
            ids = torch.tensor([rest], dtype=torch.long)
            pos = torch.arange(matched, len(prefix), dtype=torch.long)[None]
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            kv = self._cache_tensors(out.past_key_values)
        self.prefix_cache.store(prefix, kv, key, matched, shared)
        return kv

    def complete(self, prompts: Sequence[str], max_tokens: int = 16, temperature: float = 0.0,
                 top_logprobs: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, alive: AliveFn = None) -> List[Completion]:
        """Generates for each prompt; batches of at most ``max_batch`` prompts.

        Args:
            prompts: the prompt texts (chat prompts already rendered, ``chat=True``).
            max_tokens: new tokens per prompt (at most ``max_tokens_cap``).
            temperature: 0 (or below 1e-5) is greedy; otherwise sampling.
            top_logprobs: how many candidates to report per generated token (None: none).
            stop: strings that end a prompt's generation (cut from its text).
            chat: whether the prompts hold a chat template (no special tokens are added).
            alive: None, or a callable giving one flag per prompt, False once nobody waits for
                that prompt's answer. Dead prompts are not tokenised or run, and are dropped
                from a running batch at its next step; their completions have
                ``finish_reason="abort"``.

        Returns:
            One :class:`Completion` per prompt, in order. A prompt whose tokens plus
            ``max_tokens`` exceed the context gets ``finish_reason="error"`` and ``error`` set,
            without failing the others.
        """
        out: List[Completion] = []
        for start in range(0, len(prompts), self.max_batch):
            end = start + self.max_batch
            part_alive = None if alive is None else (lambda s=start, e=end: alive()[s:e])
            out.extend(self._complete_batch(prompts[start:end], max_tokens, temperature,
                                            top_logprobs, stop, chat, part_alive))
        return out

    def _complete_batch(self, prompts, max_tokens, temperature, top_logprobs, stop, chat,
                        alive: AliveFn = None) -> List[Completion]:
        max_new = max(1, min(int(max_tokens), self.max_tokens_cap))
        live = list(alive()) if alive is not None else [True] * len(prompts)
        results: List[Optional[Completion]] = [None] * len(prompts)
        rows, ids_list = [], []
        for i, prompt in enumerate(prompts):
            if not live[i]:
                results[i] = Completion(text="", finish_reason="abort")
                continue
            # Chat prompts already hold the template's special tokens.
            ids = self.tokenizer(prompt, add_special_tokens=not chat).input_ids or [self.pad_id]
            if len(ids) + max_new > self.max_context:
                results[i] = Completion(
                    text="", finish_reason="error", prompt_tokens=len(ids),
                    error=f"prompt of {len(ids)} tokens plus {max_new} new tokens exceeds the "
                          f"model's context of {self.max_context} tokens")
                continue
            rows.append(i)
            ids_list.append(ids)
        if rows:
            rows_alive = None if alive is None else _select(alive, rows)
            generated = self._generate(ids_list, max_new, temperature, top_logprobs, stop,
                                       rows_alive)
            for i, res in zip(rows, generated):
                results[i] = res
        return results

    def _generate(self, ids_list, max_new, temperature, top_logprobs, stop,
                  alive: AliveFn) -> List[Completion]:
        torch = self.torch
        batch = len(ids_list)
        # The shared prefix runs once; every row keeps at least one token of its own.
        plen = min(len(ids) for ids in ids_list) - 1
        for ids in ids_list[1:]:
            plen = min(plen, _common_prefix_len(ids_list[0], ids))
        plen = max(plen, 0)
        prefix = tuple(ids_list[0][:plen])
        with torch.inference_mode():
            kv = self._prefix_kv(prefix, shared=batch > 1) if plen > 0 else None
            suffixes = [ids[plen:] for ids in ids_list]
            width = max(len(s) for s in suffixes)
            # Pads sit between the prefix and each suffix, masked out; positions skip them.
            input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
            mask = torch.ones((batch, plen + width), dtype=torch.long)
            positions = torch.zeros((batch, width), dtype=torch.long)
            for row, suffix in enumerate(suffixes):
                pad = width - len(suffix)
                input_ids[row, pad:] = torch.tensor(suffix, dtype=torch.long)
                mask[row, plen:plen + pad] = 0
                positions[row, pad:] = torch.arange(plen, plen + len(suffix))
                positions[row, :pad] = plen  # ignored (masked), kept in range
            cache = self._new_cache(kv, batch) if kv else None
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=max_new > 1, logits_to_keep=1)
            last_pos = positions[:, -1]
            gen: List[List[int]] = [[] for _ in range(batch)]
            gen_lp: List[List[float]] = [[] for _ in range(batch)]
            gen_top: List[List[List[Tuple[str, float]]]] = [[] for _ in range(batch)]
            finish = ["length"] * batch
            done = [False] * batch
            texts = [""] * batch
            for step in range(max_new):
                logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
                if temperature and temperature > 1e-5:
                    probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
                    chosen = torch.multinomial(probs, 1)[:, 0]
                else:
                    chosen = logprobs.argmax(dim=-1)
                chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0]
                if top_logprobs:
                    top_v, top_i = logprobs.topk(int(top_logprobs), dim=-1)
                for row in range(batch):
                    if done[row]:
                        continue
                    tok = int(chosen[row])
                    if tok in self.eos_ids:
                        done[row], finish[row] = True, "stop"
                        continue
                    gen[row].append(tok)
                    gen_lp[row].append(float(chosen_lp[row]))
                    if top_logprobs:
                        gen_top[row].append([(self._token_text(int(i)), float(v))
                                             for i, v in zip(top_i[row], top_v[row])])
                    if stop:
                        texts[row] = self.tokenizer.decode(gen[row])
                        if any(s in texts[row] for s in stop):
                            done[row], finish[row] = True, "stop"
                if all(done) or step == max_new - 1:
                    break
                if alive is not None:  # rows nobody waits for any more stop here
                    for row, wanted in enumerate(alive()):
                        if not wanted and not done[row]:
                            done[row], finish[row] = True, "abort"
                    if all(done):
                        break
                last_pos = last_pos + 1
                mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
                out = self.model(input_ids=chosen[:, None], attention_mask=mask,
                                 position_ids=last_pos[:, None], past_key_values=out.past_key_values,
                                 use_cache=True, logits_to_keep=1)
        results = []
        for row in range(batch):
            text = self.tokenizer.decode(gen[row], skip_special_tokens=True)
            for s in stop or ():
                if s and s in text:
                    text = text[: text.index(s)]
            results.append(Completion(
                text=text,
                tokens=[self._token_text(t) for t in gen[row]],
                token_logprobs=gen_lp[row],
                top_logprobs=gen_top[row],
                finish_reason=finish[row],
                prompt_tokens=len(ids_list[row]),
            ))
        return results


# --------------------------------------------------------------------------------------------
# HTTP layer
# --------------------------------------------------------------------------------------------
DEFAULT_MAX_QUEUE = 64
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_TOKENS_LIMIT = 1 << 20  # any larger max_tokens is a client bug (the engine caps it anyway)
MAX_STOPS = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` accepts connections from this machine only (127.0.0.0/8, ::1, localhost).

    ``""`` (all interfaces) and host names other than ``localhost`` count as reachable.

    Example:
        >>> [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "", "gpu-node")]
        [True, True, True, False, False, False]
    """
    name = host.strip().lower()
    if name in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: Optional[str], insecure_no_auth: bool = False) -> None:
    """Refuses a server that other machines can reach but that checks no API key.

    Raises:
        ValueError: ``host`` is not loopback (:func:`is_loopback`), ``api_key`` is empty and
            ``insecure_no_auth`` is False.
    """
    if api_key or insecure_no_auth or is_loopback(host):
        return
    raise ValueError(
        f"refusing to serve on {host or 'all interfaces'!r}, which other machines can reach, "
        "without an API key: set one (--api-key KEY or $ONI_SERVE_API_KEY; api_key= in Python) "
        "or pass --insecure-no-auth (insecure_no_auth=True) on a trusted network")


def _error(status: int, message: str, param: Optional[str] = None,
           code: Optional[str] = None, headers: Optional[Dict[str, str]] = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status=status, headers=headers,
    )


class _NonFinite:
    """A JSON ``NaN``/``Infinity`` (or a number that overflows a float), kept as its text so that
    validation rejects it with the field's name instead of computing with it."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parse_float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _loads(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("request body is not UTF-8 text") from None
    try:
        return json.loads(text, parse_constant=_NonFinite, parse_float=_parse_float)
    except RecursionError:
        raise RequestError("request body is not valid JSON (nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, or an integer of more than 4300 digits
        raise RequestError(f"request body is not valid JSON ({err})") from None


def _number(body: dict, key: str, default, kind=float, lo=None, hi=None):
    """``body[key]`` as a finite ``kind`` in ``[lo, hi]`` (``default`` when absent or null)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, _NonFinite):
        raise RequestError(f"'{key}' must be a finite number, not {value!r}", param=key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number", param=key)
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise RequestError(f"'{key}' must be an integer", param=key)
        value = int(value)
    # Compared before converting: a huge integer would overflow float().
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (f"between {lo} and {hi}" if lo is not None and hi is not None
                  else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise RequestError(f"'{key}' must be {bounds}", param=key)
    return kind(value)


def _utf8_len(text: str, param: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise RequestError(f"'{param}' is not valid Unicode (it holds a lone surrogate)",
                           param=param) from None


def _stops(body: dict) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(s, str) for s in stops)):
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOPS} strings",
                           param="stop")
    for s in stops:
        _utf8_len(s, "stop")
    return stops


@dataclass
class _Job:
    prompts: List[str]
    key: Tuple
    future: asyncio.Future


class OpenAIServer:
    """The aiohttp application around an engine (``complete`` + ``render_chat``).

    Concurrent requests with the same settings are merged into one engine call (up to
    ``max_batch`` prompts); the engine runs in one worker thread.

    Protection against clients (every refusal is an OpenAI-style JSON error, never a 500):

    * ``api_key``: every route but ``/health`` needs ``Authorization: Bearer <key>`` (401,
      ``code: "invalid_api_key"``, otherwise).
    * at most ``max_queue`` requests wait for the engine; more get 503 with ``Retry-After``.
    * a request whose client disconnects leaves the queue at once; its prompts are skipped or
      dropped from the running batch at the engine's next step (the runner must be made with
      ``handler_cancellation=True``, as :class:`ServerHandle` does).
    * a body larger than ``max_body_bytes`` gets 413 (from ``Content-Length`` before reading);
      a body not received within ``read_timeout`` seconds gets 408; :meth:`watch_connections`
      closes connections that hold a half-sent request head (or sit idle) that long.
    * a prompt longer than ``max_prompt_bytes`` gets 400 before it is tokenised, one whose
      tokens do not fit the model's context gets 400 after; numbers must be finite and in
      range (JSON ``NaN``/``Infinity`` are refused naming the field).

    Args:
        engine: a :class:`TransformersEngine` or :class:`ScriptedEngine`.
        served_name: the model name to list and accept (default: the engine's).
        max_batch: the most prompts merged into one engine call.
        max_prompts: the most prompts one request may carry.
        api_key: the key clients must send; None or ``""`` checks none.
        max_queue: the most requests waiting for the engine (the running batch not counted).
        read_timeout: seconds a client may take to send a request (head, then body).
        max_body_bytes: the largest request body accepted.
        max_prompt_bytes: the longest prompt accepted, in UTF-8 bytes (default: the engine's
            ``max_prompt_bytes``; None: no limit but the body's).
    """

    def __init__(self, engine, served_name: Optional[str] = None, max_batch: int = 64,
                 max_prompts: int = 1024, *, api_key: Optional[str] = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, read_timeout: float = DEFAULT_READ_TIMEOUT,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_prompt_bytes: Optional[int] = None) -> None:
        if max_queue < 1 or not read_timeout > 0 or max_body_bytes < 1:
            raise ValueError("max_queue, read_timeout and max_body_bytes must be positive")
        self.engine = engine
        self.model = served_name or engine.model_name
        self.accepted = {self.model, engine.model_name}
        self.max_batch = max_batch
        self.max_prompts = max_prompts
        self.api_key = api_key or None
        self._key = self.api_key.encode("utf-8") if self.api_key else None
        self.max_queue = int(max_queue)
        self.read_timeout = float(read_timeout)
        self.max_body_bytes = int(max_body_bytes)
        self.max_prompt_bytes = (max_prompt_bytes if max_prompt_bytes is not None
                                 else getattr(engine, "max_prompt_bytes", None))
        self.created = int(time.time())
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oni-engine")
        self.pending: Deque[_Job] = collections.deque()
        self._in_engine: List[_Job] = []
        self._wakeup: Optional[asyncio.Event] = None
        self.worker: Optional[asyncio.Task] = None
        self._prompts_per_s: Optional[float] = None  # running estimate, for Retry-After
        # Per connection (aiohttp's RequestHandler): requests in progress, and since when idle.
        self._busy: Dict[Any, int] = {}
        self._idle_since: Dict[Any, float] = {}
        self.stats = {"requests": 0, "prompts": 0, "engine_calls": 0, "cancelled": 0,
                      "aborted_prompts": 0, "busy": 0}

    def app(self) -> web.Application:
        @web.middleware
        async def guard(request: web.Request, handler):
            return await self._guard(request, handler)

        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[guard])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._drain)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        self._wakeup = asyncio.Event()
        self.worker = asyncio.get_running_loop().create_task(self._work())

    async def _drain(self, app) -> None:
        # Shutting down: waiting requests get a 503 now instead of holding the shutdown, and
        # the running batch stops at its next step (its futures are done: ``alive`` is False).
        for job in list(self.pending) + self._in_engine:
            if not job.future.done():
                job.future.set_exception(RequestError("server is shutting down", status=503))
        self.pending.clear()

    async def _stop(self, app) -> None:
        if self.worker is not None:
            self.worker.cancel()
            try:
                await self.worker
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- the engine queue ----------------------------------------------------------------------
    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self.pending.popleft()
            jobs, total = [job], len(job.prompts)
            for other in list(self.pending):  # merge same-settings jobs that wait, in arrival order
                if other.key == job.key and total + len(other.prompts) <= self.max_batch:
                    jobs.append(other)
                    self.pending.remove(other)
                    total += len(other.prompts)
            prompts = [p for j in jobs for p in j.prompts]
            owners = [j.future for j in jobs for _ in j.prompts]
            # Read from the engine thread between steps: a future is done there only when its
            # request was cancelled (client gone) or failed by a shutdown.
            alive = lambda: [not f.done() for f in owners]  # noqa: E731
            max_tokens, temperature, top, stop, chat = job.key
            if not any(alive()):  # every client left while they were being merged
                self.stats["aborted_prompts"] += len(prompts)
                continue
            self.stats["engine_calls"] += 1
            started = time.monotonic()
            self._in_engine = jobs
            try:
                results = await loop.run_in_executor(
                    self.executor,
                    lambda: self.engine.complete(prompts, max_tokens=max_tokens,
                                                 temperature=temperature, top_logprobs=top,
                                                 stop=list(stop), chat=chat, alive=alive),
                )
            except Exception as err:  # hand the failure to every waiting request
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(err)
                continue
            finally:
                self._in_engine = []
            rate = len(prompts) / max(time.monotonic() - started, 1e-3)
            self._prompts_per_s = rate if self._prompts_per_s is None else (
                0.8 * self._prompts_per_s + 0.2 * rate)
            offset = 0
            for j in jobs:
                part = results[offset:offset + len(j.prompts)]
                offset += len(j.prompts)
                self.stats["aborted_prompts"] += sum(r.finish_reason == "abort" for r in part)
                if j.future.done():
                    continue
                refused = next((r.error for r in part if r.error), None)
                if refused:
                    j.future.set_exception(RequestError(refused, param="prompt",
                                                        code="context_length_exceeded"))
                else:
                    j.future.set_result(part)

    def _retry_after(self) -> int:
        """Seconds until the queue has likely drained (1 to 60), for ``Retry-After``."""
        queued = sum(len(j.prompts) for j in self.pending)
        seconds = queued / self._prompts_per_s if self._prompts_per_s else 1.0
        return int(min(60, max(1, math.ceil(seconds))))

    async def _run(self, prompts: List[str], key: Tuple) -> List[Completion]:
        if len(self.pending) >= self.max_queue:
            self.stats["busy"] += 1
            wait = self._retry_after()
            raise RequestError(
                f"server busy: {len(self.pending)} requests are waiting for the model (the "
                f"most it queues); retry in {wait} s", status=503, code="server_busy",
                headers={"Retry-After": str(wait)})
        job = _Job(prompts, key, asyncio.get_running_loop().create_future())
        self.pending.append(job)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            job.future.cancel()
            try:
                self.pending.remove(job)
            except ValueError:  # already taken by the worker: it sees the future cancelled
                pass
            self.stats["cancelled"] += 1
            raise

    # -- connections ---------------------------------------------------------------------------
    async def watch_connections(self, server: web.Server) -> None:
        """Closes connections that hold no request in progress for ``read_timeout`` seconds.

        That covers a request head that never finishes arriving (slowloris), which no handler
        sees, and idle keep-alive connections. Runs until cancelled; :class:`ServerHandle`
        starts it with its runner's ``server``.
        """
        period = min(1.0, self.read_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            connections = server.connections
            for conn in connections:
                if self._busy.get(conn):
                    continue  # a handler runs: the body timeout and the engine govern it
                if now - self._idle_since.setdefault(conn, now) > self.read_timeout:
                    conn.force_close()
            gone = set(self._idle_since).difference(connections)
            for conn in gone:
                del self._idle_since[conn]

    # -- handlers ----------------------------------------------------------------------------
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        conn = request.protocol
        self._busy[conn] = self._busy.get(conn, 0) + 1
        try:
            self._authorize(request)
            size = request.content_length
            if size is not None and size > self.max_body_bytes:
                raise self._too_large(size)
            return await handler(request)
        except RequestError as err:
            return _error(err.status, str(err), err.param, err.code, err.headers)
        except web.HTTPException as err:  # the router's 404 / 405
            return _error(err.status, f"{err.reason}: {request.method} {request.path}")
        except Exception as err:  # an engine failure: a JSON 500, the server keeps running
            return _error(500, f"{type(err).__name__}: {err}")
        finally:
            left = self._busy.pop(conn, 1) - 1
            if left > 0:
                self._busy[conn] = left
            self._idle_since[conn] = time.monotonic()

    def _authorize(self, request: web.Request) -> None:
        if self._key is None or request.path == "/health":
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and hmac.compare_digest(
                token.encode("utf-8", "replace"), self._key):
            return
        problem = "incorrect API key" if token else "no API key"
        raise RequestError(
            f"{problem}: this server needs 'Authorization: Bearer <key>' with its key "
            "(OPENAI_API_KEY for OpenAI clients)", status=401, code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"})

    def _too_large(self, size: Optional[int] = None) -> RequestError:
        what = f"request body of {size} bytes" if size is not None else "request body"
        return RequestError(f"{what} exceeds this server's limit of {self.max_body_bytes} bytes",
                            status=413, code="request_too_large")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model, "queued": len(self.pending),
                                  **self.stats})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "torchrl_oni"}
        ]})

    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), self.read_timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"request body not received within {self.read_timeout:g} s",
                               status=408, code="timeout") from None
        except web.HTTPRequestEntityTooLarge:  # no Content-Length (chunked): found while reading
            raise self._too_large() from None
        body = _loads(raw)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError("'model' must be a string", param="model")
        if model is not None and model not in self.accepted:
            raise RequestError(f"model {model!r} is not served here; this server serves "
                               f"{self.model!r}", status=404, param="model",
                               code="model_not_found")
        return body

    def _check_prompt_size(self, size: int, param: str, what: str) -> None:
        limit = self.max_prompt_bytes
        if limit is not None and size > limit:
            context = getattr(self.engine, "max_context", None)
            why = f" (the model's context is {context} tokens)" if context else ""
            raise RequestError(f"{what} is {size} bytes, more than the {limit} bytes this "
                               f"server accepts per prompt{why}", param=param,
                               code="context_length_exceeded")

    def _settings(self, body: dict, top: Optional[int], chat: bool) -> Tuple:
        length_key = ("max_completion_tokens"
                      if chat and body.get("max_completion_tokens") is not None else "max_tokens")
        max_tokens = _number(body, length_key, 16, int, 1, MAX_TOKENS_LIMIT)
        temperature = _number(body, "temperature", 0.0, float, 0.0, 2.0)
        # Accepted and ignored by the engines, but validated like the others.
        _number(body, "top_p", 1.0, float, 0.0, 1.0)
        _number(body, "presence_penalty", 0.0, float, -2.0, 2.0)
        _number(body, "frequency_penalty", 0.0, float, -2.0, 2.0)
        _number(body, "seed", None, int, -(2 ** 63), 2 ** 64 - 1)
        for key in ("n", "best_of"):
            if _number(body, key, 1, int, 1, 128) != 1:
                raise RequestError(f"only {key}=1 is supported", param=key)
        stream = body.get("stream")
        if stream not in (None, False):
            raise RequestError("streaming is not supported" if stream is True
                               else "'stream' must be true or false", param="stream")
        return (max_tokens, temperature, top, tuple(_stops(body)), chat)

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        else:
            raise RequestError("'prompt' must be a string or a non-empty list of strings",
                               param="prompt")
        if len(prompts) > self.max_prompts:
            raise RequestError(f"at most {self.max_prompts} prompts per request", param="prompt")
        for index, text in enumerate(prompts):
            self._check_prompt_size(_utf8_len(text, "prompt"), "prompt", f"prompt {index}")
        top = body.get("logprobs")
        if top is not None:
            top = _number(body, "logprobs", 0, int, 0, 20)
        key = self._settings(body, top, chat=False)
        self.stats["requests"] += 1
        self.stats["prompts"] += len(prompts)
        results = await self._run(prompts, key)
        choices = []
        for index, res in enumerate(results):
            logprobs = None
            if top is not None:
                offsets, pos = [], 0
                for t in res.tokens:
                    offsets.append(pos)
                    pos += len(t)
                logprobs = {
                    "tokens": res.tokens,
                    "token_logprobs": res.token_logprobs,
                    "top_logprobs": [dict(cands) for cands in res.top_logprobs] if top else None,
                    "text_offset": offsets,
                }
            choices.append({"index": index, "text": res.text, "logprobs": logprobs,
                            "finish_reason": res.finish_reason})
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": self.model, "choices": choices,
            "usage": self._usage(results),
        })

    @staticmethod
    def _usage(results: Sequence[Completion]) -> dict:
        prompt = sum(r.prompt_tokens for r in results)
        completion = sum(len(r.tokens) for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
            raise RequestError("'messages' must be a non-empty list of {role, content} objects "
                               "with string content", param="messages")
        size = sum(_utf8_len(m["role"], "messages") + _utf8_len(m["content"], "messages")
                   for m in messages)
        self._check_prompt_size(size, "messages", "the conversation")
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise RequestError("'logprobs' must be true or false", param="logprobs")
        top = None
        if want:
            top = _number(body, "top_logprobs", 0, int, 0, 20)
        key = self._settings(body, top, chat=True)
        try:
            prompt = self.engine.render_chat([{"role": m["role"], "content": m["content"]}
                                              for m in messages])
        except Exception as err:  # e.g. a template that only takes alternating user/assistant
            raise RequestError(f"'messages' do not fit the model's chat template: {err}",
                               param="messages") from None
        self._check_prompt_size(_utf8_len(prompt, "messages"), "messages", "the conversation")
        self.stats["requests"] += 1
        self.stats["prompts"] += 1
        (res,) = await self._run([prompt], key)
        logprobs = None
        if want:
            content = []
            for i, (tok, lp) in enumerate(zip(res.tokens, res.token_logprobs)):
                cands = res.top_logprobs[i] if i < len(res.top_logprobs) else []
                content.append({
                    "token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                     for t, v in cands],
                })
            logprobs = {"content": content}
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                         "logprobs": logprobs, "finish_reason": res.finish_reason}],
            "usage": self._usage([res]),
        })


# --------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------
def make_engine(backend: str = "embedded", model: Optional[str] = None, *, dtype: str = "auto",
                threads: Optional[int] = None, max_tokens_cap: int = 128):
    """Builds the engine for ``backend`` (``"embedded"`` or ``"scripted"``)."""
    if backend == "scripted":
        return ScriptedEngine()
    if backend != "embedded":
        raise ValueError(f"unknown backend {backend!r} for the embedded server; "
                         "choose embedded or scripted")
    from torchrl_oni.serve.models import DEFAULT_MODEL, load_model

    loaded = load_model(model or DEFAULT_MODEL, dtype=dtype, threads=threads)
    return TransformersEngine(loaded, max_tokens_cap=max_tokens_cap)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerHandle:
    """A server running in a background thread: ``.url`` (``http://host:port/v1``), ``.stop()``.

    Use as a context manager to stop it on exit. It runs the application with handler
    cancellation (a request whose client disconnects stops waiting for the engine) and
    :meth:`OpenAIServer.watch_connections`.

    Args:
        server: the application.
        host, port: where to listen; port 0 picks a free port.
        insecure_no_auth: allow a ``host`` other machines can reach without an API key
            (:func:`check_exposure`).

    Raises:
        ValueError: a reachable ``host`` and no API key, without ``insecure_no_auth``.
    """

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0, *,
                 insecure_no_auth: bool = False) -> None:
        check_exposure(host, server.api_key, insecure_no_auth)
        self.server = server
        self.model = server.model
        self.host = host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._runner: Optional[web.AppRunner] = None
        self._watcher: Optional[asyncio.Task] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, name="oni-serve", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            # A body still arriving after an error answer is read for at most this long.
            lingering = min(10.0, self.server.read_timeout)
            self._runner = web.AppRunner(self.server.app(), access_log=None,
                                         handler_cancellation=True, lingering_time=lingering)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            self._watcher = self._loop.create_task(
                self.server.watch_connections(self._runner.server))
        except BaseException as err:  # reported to the starting thread
            self._error = err
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._watcher.cancel()
        self._loop.run_until_complete(asyncio.gather(self._watcher, return_exceptions=True))
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self, timeout: float = 30.0) -> "ServerHandle":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server did not start within {timeout} s")
        if self._error is not None:
            raise OSError(f"cannot serve on {self.host}:{self.port}: {self._error}")
        return self

    def stop(self) -> None:
        """Stops the server and joins its thread. Safe to call twice."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_embedded_server(
    model: Optional[str] = None,
    *,
    backend: str = "embedded",
    host: str = "127.0.0.1",
    port: int = 0,
    threads: Optional[int] = None,
    dtype: str = "auto",
    served_name: Optional[str] = None,
    max_tokens_cap: int = 128,
    max_batch: int = 64,
    api_key: Optional[str] = None,
    insecure_no_auth: bool = False,
    max_queue: int = DEFAULT_MAX_QUEUE,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> ServerHandle:
    """Loads the model and serves it in a background thread; returns once it accepts requests.

    Args:
        model: a packaged model name or alias (default :data:`~torchrl_oni.serve.models.DEFAULT_MODEL`);
            ignored by the scripted backend.
        backend: ``"embedded"`` (a packaged model) or ``"scripted"`` (rules, no model).
        host, port: where to listen; port 0 picks a free port (read it from ``.url``).
        threads: torch threads for the model (``None``: torch's default).
        dtype: ``"auto"``, ``"bfloat16"`` or ``"float32"``.
        served_name: the name clients use (default: the model's name).
        max_tokens_cap: the most tokens generated per prompt.
        max_batch: the most prompts per forward pass.
        api_key: the key clients must send as ``Authorization: Bearer <key>`` (``/health``
            excepted); None checks none.
        insecure_no_auth: allow a non-loopback ``host`` without ``api_key``.
        max_queue: the most requests waiting for the model; more are answered 503.
        read_timeout: seconds a client may take to send its request.
        max_body_bytes: the largest request body accepted (413 beyond).

    Returns:
        A :class:`ServerHandle` (a context manager) with ``.url`` and ``.stop()``.

    Raises:
        ValueError: unknown backend, or a reachable ``host`` without ``api_key`` (checked
            before the model loads).
    """
    check_exposure(host, api_key, insecure_no_auth)
    engine = make_engine(backend, model, dtype=dtype, threads=threads,
                         max_tokens_cap=max_tokens_cap)
    if isinstance(engine, TransformersEngine):
        engine.max_batch = min(engine.max_batch, max_batch)
    server = OpenAIServer(engine, served_name=served_name, max_batch=max_batch, api_key=api_key,
                          max_queue=max_queue, read_timeout=read_timeout,
                          max_body_bytes=max_body_bytes)
    return ServerHandle(server, host, port, insecure_no_auth=insecure_no_auth).start()


def start_embedded_process(model: Optional[str] = None, *, threads: Optional[int] = None,
                           startup_timeout: float = 900.0, log_path: Optional[str] = None):
    """The embedded server in a child process of its own (``python -m torchrl_oni.serve``).

    Why a process: a model served from a thread of the training process shares that process's
    GIL and torch thread pool with the learner, so on a busy machine it answers a few prompts a
    minute; a process of its own gets its share of the cores from the OS. The child stops with
    its parent (process group, ``PR_SET_PDEATHSIG``), as vLLM does under :class:`VLLMServer`.

    Returns:
        A started :class:`~torchrl_oni.serve.vllm.VLLMServer` with ``.url``, ``.model``, ``.stop()``.

    Raises:
        VLLMLaunchError: the process exited or did not answer within ``startup_timeout``.
    """
    import sys

    from torchrl_oni.serve.models import DEFAULT_MODEL
    from torchrl_oni.serve.vllm import VLLMServer

    name = model or DEFAULT_MODEL
    return VLLMServer(name, port=0, served_model_name=name,
                      launcher=[sys.executable, "-m", "torchrl_oni.serve", "--backend", "embedded"],
                      extra_args=["--threads", str(threads)] if threads else [],
                      startup_timeout=startup_timeout, log_path=log_path).start()
