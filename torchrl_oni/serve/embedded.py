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
import concurrent.futures
import json
import math
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from aiohttp import web

__all__ = [
    "Completion",
    "ScriptedEngine",
    "TransformersEngine",
    "OpenAIServer",
    "ServerHandle",
    "start_embedded_server",
    "make_engine",
    "SCRIPTED_MODEL_NAME",
]

SCRIPTED_MODEL_NAME = "scripted"


class RequestError(Exception):
    """A client error, answered with a 4xx JSON body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass
class Completion:
    """One prompt's answer from an engine.

    ``top_logprobs[i]`` lists ``(token, logprob)`` candidates at generated position ``i`` (empty
    when logprobs were not asked for).
    """

    text: str
    tokens: List[str] = field(default_factory=list)
    token_logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[List[Tuple[str, float]]] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0


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
                 chat: bool = False) -> List[Completion]:
        out = []
        for prompt in prompts:
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
                 chat: bool = False) -> List[Completion]:
        """Generates for each prompt; batches of at most ``max_batch`` prompts."""
        out: List[Completion] = []
        for start in range(0, len(prompts), self.max_batch):
            out.extend(self._complete_batch(prompts[start:start + self.max_batch], max_tokens,
                                            temperature, top_logprobs, stop, chat))
        return out

    def _complete_batch(self, prompts, max_tokens, temperature, top_logprobs, stop, chat):
        torch = self.torch
        # Chat prompts already hold the template's special tokens.
        ids_list = [self.tokenizer(p, add_special_tokens=not chat).input_ids for p in prompts]
        ids_list = [ids if ids else [self.pad_id] for ids in ids_list]
        longest = max(len(ids) for ids in ids_list)
        max_new = max(1, min(int(max_tokens), self.max_tokens_cap))
        if longest + max_new > self.max_context:
            raise RequestError(f"prompt of {longest} tokens plus {max_new} new tokens exceeds the "
                               f"model's context of {self.max_context}", param="prompt")
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
def _error(status: int, message: str, param: Optional[str] = None,
           code: Optional[str] = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404 and code is None:
        code = "model_not_found"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status
    )


def _number(body: dict, key: str, default, kind=float, lo=None, hi=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number", param=key)
    if kind is int and float(value) != int(value):
        raise RequestError(f"'{key}' must be an integer", param=key)
    value = kind(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{key}' must be between {lo} and {hi}", param=key)
    return value


def _stops(body: dict) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise RequestError("'stop' must be a string or a list of strings", param="stop")


@dataclass
class _Job:
    prompts: List[str]
    key: Tuple
    future: asyncio.Future


class OpenAIServer:
    """The aiohttp application around an engine (``complete`` + ``render_chat``).

    Concurrent requests with the same settings are merged into one engine call (up to
    ``max_batch`` prompts); the engine runs in one worker thread.

    Args:
        engine: a :class:`TransformersEngine` or :class:`ScriptedEngine`.
        served_name: the model name to list and accept (default: the engine's).
        max_batch: the most prompts merged into one engine call.
        max_prompts: the most prompts one request may carry.
    """

    def __init__(self, engine, served_name: Optional[str] = None, max_batch: int = 64,
                 max_prompts: int = 1024) -> None:
        self.engine = engine
        self.model = served_name or engine.model_name
        self.accepted = {self.model, engine.model_name}
        self.max_batch = max_batch
        self.max_prompts = max_prompts
        self.created = int(time.time())
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oni-engine")
        self.queue: Optional[asyncio.Queue] = None
        self.worker: Optional[asyncio.Task] = None
        self.stats = {"requests": 0, "prompts": 0, "engine_calls": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        self.queue = asyncio.Queue()
        self.worker = asyncio.get_running_loop().create_task(self._work())

    async def _stop(self, app) -> None:
        if self.worker is not None:
            self.worker.cancel()
            try:
                await self.worker
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        held: List[_Job] = []
        while True:
            job = held.pop(0) if held else await self.queue.get()
            jobs, total = [job], len(job.prompts)
            while not self.queue.empty():
                held.append(self.queue.get_nowait())
            for other in list(held):  # merge same-settings jobs that wait, in arrival order
                if other.key == job.key and total + len(other.prompts) <= self.max_batch:
                    jobs.append(other)
                    held.remove(other)
                    total += len(other.prompts)
            prompts = [p for j in jobs for p in j.prompts]
            max_tokens, temperature, top, stop, chat = job.key
            self.stats["engine_calls"] += 1
            try:
                results = await loop.run_in_executor(
                    self.executor,
                    lambda: self.engine.complete(prompts, max_tokens=max_tokens,
                                                 temperature=temperature, top_logprobs=top,
                                                 stop=list(stop), chat=chat),
                )
            except Exception as err:  # hand the failure to every waiting request
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(err)
                continue
            offset = 0
            for j in jobs:
                if not j.future.done():
                    j.future.set_result(results[offset:offset + len(j.prompts)])
                offset += len(j.prompts)

    async def _run(self, prompts: List[str], key: Tuple) -> List[Completion]:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put(_Job(prompts, key, future))
        return await future

    # -- handlers ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model, **self.stats})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "torchrl_oni"}
        ]})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise RequestError("request body is not valid JSON")
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in self.accepted:
            raise RequestError(f"model {model!r} is not served here; this server serves "
                               f"{self.model!r}", status=404, param="model")
        return body

    async def _guard(self, handler, request):
        try:
            return await handler(request)
        except RequestError as err:
            return _error(err.status, str(err), err.param, err.code)
        except Exception as err:  # an engine failure: a JSON 500, the server keeps running
            return _error(500, f"{type(err).__name__}: {err}")

    async def completions(self, request: web.Request) -> web.Response:
        return await self._guard(self._completions, request)

    async def chat_completions(self, request: web.Request) -> web.Response:
        return await self._guard(self._chat_completions, request)

    def _settings(self, body: dict, top: Optional[int], chat: bool) -> Tuple:
        max_tokens = _number(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                             else "max_tokens", 16, int, 1)
        temperature = _number(body, "temperature", 0.0, float, 0.0, 2.0)
        if _number(body, "n", 1, int, 1) != 1:
            raise RequestError("only n=1 is supported", param="n")
        if body.get("stream"):
            raise RequestError("streaming is not supported", param="stream")
        return (max_tokens, temperature, top, tuple(_stops(body)), chat)

    async def _completions(self, request: web.Request) -> web.Response:
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

    async def _chat_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
            raise RequestError("'messages' must be a non-empty list of {role, content} objects "
                               "with string content", param="messages")
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise RequestError("'logprobs' must be true or false", param="logprobs")
        top = None
        if want:
            top = _number(body, "top_logprobs", 0, int, 0, 20)
        key = self._settings(body, top, chat=True)
        prompt = self.engine.render_chat([{"role": m["role"], "content": m["content"]}
                                          for m in messages])
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

    Use as a context manager to stop it on exit.
    """

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.model = server.model
        self.host = host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._runner: Optional[web.AppRunner] = None
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
            self._runner = web.AppRunner(self.server.app(), access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as err:  # reported to the starting thread
            self._error = err
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
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

    Returns:
        A :class:`ServerHandle` (a context manager) with ``.url`` and ``.stop()``.
    """
    engine = make_engine(backend, model, dtype=dtype, threads=threads,
                         max_tokens_cap=max_tokens_cap)
    if isinstance(engine, TransformersEngine):
        engine.max_batch = min(engine.max_batch, max_batch)
    server = OpenAIServer(engine, served_name=served_name, max_batch=max_batch)
    return ServerHandle(server, host, port).start()
