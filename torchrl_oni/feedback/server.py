"""The labelling page's server: people label captions (and caption pairs) in a browser.

:func:`serve_feedback` runs an aiohttp app in its own thread with its own asyncio loop (like
:class:`~torchrl_oni.annotation.AnnotationWorker`), on a live
:class:`~torchrl_oni.store.CaptionStore`: a person's answer lands in the store at once, with
provenance ``Provenance("human", <labeller>, "feedback-v1")``, and the store keeps it over any later
non-human label (:data:`~torchrl_oni.store.HUMAN` precedence). Nothing waits for people: the
trainer never calls into the server, a closed page or a person who walks away costs nothing.
``oni-label`` (:mod:`torchrl_oni.feedback.cli`) serves a saved store the same way.

What the page shows: the captions that have no human label yet, most useful first — the captions
given as ``first`` (the reward-hacking diagnostics' flagged captions, with why), then the most
seen (:func:`torchrl_oni.queries.select`, rule ``frequency``), or, when a reward-model ensemble is
given, the ones its members disagree on most (``disagree``) — each with how often it was seen,
the game screen it appeared on (:class:`~torchrl_oni.feedback.screens.ScreenSnapshots`) and the
current LLM label, hidden until asked for (no anchoring). One key per answer, undo, a counter,
and a panel of human–LLM agreement so far.

JSON API (ids are strings: a caption hash does not fit a JavaScript number):

=========================  =======================================================================
request                    answer
=========================  =======================================================================
``GET /api/state``         counters, agreement series, what is waiting
``GET /api/queue``         ``?kind=captions|pairs&limit=N``: the next items, most useful first
``GET /api/screen``        ``?id=HASH``: ``{"rows": [24 strings], "colors": [[80 ints] × 24]}``
``POST /api/label``        ``{"id": HASH, "answer": "progress"|"not_progress"|"skip"}``
``POST /api/prefer``       ``{"id": PAIR, "answer": "left"|"right"|"equal"|"skip"}``
``POST /api/undo``         ``{}``: reverts this server's last answer (409 when there is none)
=========================  =======================================================================

Bad input gets a 400 with ``{"error": "..."}`` (malformed JSON, unknown hash or pair, an answer
outside the allowed set). Safe by default: bound to 127.0.0.1; on any other address a random
access token is required (generated and printed once unless given), sent by the page as the
``X-ONI-Token`` header; on loopback the Host header must name the loopback (DNS rebinding) and a
POST must be JSON from the same origin (cross-site forms). Every caption reaches the page as JSON
and is put in the DOM with ``textContent``; a strict Content-Security-Policy forbids inline
scripts.

Example:
    >>> import json, urllib.request
    >>> from torchrl_oni.annotators.base import Provenance
    >>> from torchrl_oni.captions import encode_messages, hash_messages
    >>> from torchrl_oni.feedback.server import serve_feedback
    >>> from torchrl_oni.store import CaptionStore
    >>> store = CaptionStore(capacity=8)
    >>> msgs = encode_messages(["You kill the newt!", "It's a wall.", "It's a wall."])
    >>> _ = store.add(msgs, hash_messages(msgs))
    >>> with serve_feedback(store, port=0) as page:
    ...     queue = json.load(urllib.request.urlopen(page.url + "api/queue?kind=captions"))
    ...     first = queue["items"][0]
    ...     body = json.dumps({"id": first["id"], "answer": "not_progress"}).encode()
    ...     req = urllib.request.Request(page.url + "api/label", body, {"Content-Type": "application/json"})
    ...     answer = json.load(urllib.request.urlopen(req))
    >>> first["text"], answer["given"], store.provenances[0].annotator
    ("It's a wall.", 1, 'human')
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from aiohttp import web

from torchrl_oni.annotators.base import FIRST, SECOND, TIE, Provenance
from torchrl_oni.feedback._page_queue import _QueueMethods, _StoreView
from torchrl_oni.feedback.screens import ScreenSnapshots
from torchrl_oni.net import AppThread, ConnectionWatch, HostCheck, is_loopback, post_refusal
from torchrl_oni.store import HUMAN, LABELLED, CaptionStore

__all__ = ["FeedbackServer", "serve_feedback", "HUMAN", "FEEDBACK_VERSION", "CAPTION_ANSWERS", "PAIR_ANSWERS"]

logger = logging.getLogger(__name__)

FEEDBACK_VERSION = "feedback-v1"
CAPTION_ANSWERS = {"progress": 1.0, "not_progress": 0.0, "skip": None}
PAIR_ANSWERS = {"left": FIRST, "right": SECOND, "equal": TIE, "skip": None}
TOKEN_HEADER = "X-ONI-Token"
STATIC_DIR = Path(__file__).with_name("static")
READ_TIMEOUT = 30.0
"""Seconds a browser may take to send a request (head and body), as ``oni-serve``'s default;
idle keep-alive connections are closed after as long."""
_MAX_LIMIT = 100
_SERIES_POINTS = 400  # agreement points sent to the page (downsampled beyond)
_SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

# A member-prediction function for ordering: uint8[N, 256] -> float[N, M].
Scorer = Callable[[torch.Tensor], torch.Tensor]


class _BadRequest(Exception):
    """A client error: becomes a JSON ``{"error": ...}`` answer with ``status``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _parse_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _BadRequest(f"{what} must be a decimal string")
    text = str(value).strip()
    if not text or len(text) > 21 or not text.lstrip("-").isdigit():
        raise _BadRequest(f"{what} must be a decimal string")
    number = int(text)
    if not -(2 ** 63) <= number < 2 ** 63:
        raise _BadRequest(f"{what} is out of range")
    return number


# ---------------------------------------------------------------------------------------- the server
@dataclass
class _Action:
    kind: str  # "caption" | "pair"
    key: int  # caption hash or pair slot
    answer: str
    value: Optional[float] = None  # what was written (None for a skip)
    prev: Dict[str, Any] = field(default_factory=dict)
    compared: bool = False


class FeedbackServer(_QueueMethods):
    """The labelling page over a live :class:`~torchrl_oni.store.CaptionStore`, in its own thread.

    Args:
        store (CaptionStore): captions come from it, human labels go to it.
        host (str): address to bind. Default ``"127.0.0.1"``.
        port (int): port (0: any free port; read :attr:`port` after :meth:`start`).
        token (str, optional): access token. ``None``: none on loopback, a random one (printed
            once) elsewhere. ``""``: none — refused off loopback.
        snapshots (ScreenSnapshots, optional): game screens to show beside captions.
        scorer (callable, optional): ``uint8[N,256] -> float[N, M]`` member predictions of a
            reward-model ensemble: the queue is then ordered by their disagreement.
        pair_scorer (callable, optional): ``(uint8[K,256], uint8[K,256]) -> float[K, M]`` members'
            P(second better) for pairs (e.g. ``RankingEnsemble.pair_probabilities``).
        save_path (str, optional): save the store there (atomically) after answers, at most every
            ``save_interval_s``, and when the server stops (``oni-label``; a trainer saves its
            store itself).
        labeller (str): who labels, recorded in the provenance's ``model`` field.
        pool_size (int): most-seen captions scored by ``scorer`` per queue request.
        announce (bool): print the address (and a generated token) once to stderr.
        first (list, optional): ``[(caption hash, why)]`` shown before every other caption, in
            this order, while they wait for a person (``oni-label --first``: the captions the
            reward-hacking diagnostics flagged, :func:`torchrl_oni.reward_hacking.read_flagged`);
            each item then carries ``note``: why.

    Example:
        >>> from torchrl_oni.store import CaptionStore
        >>> server = FeedbackServer(CaptionStore(capacity=4), port=0, announce=False).start()
        >>> server.url.startswith("http://127.0.0.1:"), server.token is None
        (True, True)
        >>> server.stop()
    """

    def __init__(
        self,
        store: CaptionStore,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: Optional[str] = None,
        *,
        snapshots: Optional[ScreenSnapshots] = None,
        scorer: Optional[Scorer] = None,
        pair_scorer: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        save_path: Optional[Union[str, os.PathLike]] = None,
        save_interval_s: float = 2.0,
        labeller: str = "web",
        pool_size: int = 512,
        announce: bool = True,
        read_timeout: float = READ_TIMEOUT,
        first: Optional[List[Tuple[int, str]]] = None,
    ):
        loopback = is_loopback(host)
        if token is None:
            token = None if loopback else secrets.token_urlsafe(24)
        elif token == "":
            if not loopback:
                raise ValueError(f"refusing to serve the labelling page on {host} without an access token "
                                 "(bind 127.0.0.1, or give a token)")
            token = None
        elif len(token) < 16:
            raise ValueError("the access token must be at least 16 characters")
        if not 0 <= int(port) < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        self.store = store
        self.host = host
        self.requested_port = int(port)
        self.port: Optional[int] = None
        self.token = token
        self.loopback = loopback
        self._hosts = HostCheck(host)  # on loopback: DNS rebinding
        self.snapshots = snapshots
        self.scorer = scorer
        self.pair_scorer = pair_scorer
        self.save_path = None if save_path is None else Path(save_path)
        self.save_interval_s = float(save_interval_s)
        self.provenance = Provenance(HUMAN, labeller, FEEDBACK_VERSION)
        self.pool_size = int(pool_size)
        self.announce = announce
        self.view = _StoreView(store)
        self.first: Dict[int, str] = {}  # caption hash -> why, in the order to show them
        for h, why in first or ():
            self.first.setdefault(int(h), str(why))
        self._actions: List[_Action] = []
        self._skipped: Dict[str, set] = {"caption": set(), "pair": set()}
        self._agree: Dict[str, List[int]] = {"caption": [], "pair": []}
        self._lock = threading.Lock()  # the server's own state (answers arrive on one loop, metrics from others)
        self._save_lock = threading.Lock()
        self._dirty_since_save = False
        self.save_error: Optional[str] = None
        self.saves = 0
        self._app: Optional[AppThread] = None
        self.read_timeout = float(read_timeout)
        self._connections = ConnectionWatch(self.read_timeout)  # slow request heads, idle keep-alives
        self._dirty_event: Optional[asyncio.Event] = None
        self._human_pid: Optional[int] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        """Serving, with its port known (another thread that sees it running can call it)."""
        return self._app is not None and self._app.running and self.port is not None

    @property
    def url(self) -> str:
        """The page's address (without the token)."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}/"

    @property
    def url_with_token(self) -> str:
        return self.url + (f"?token={self.token}" if self.token else "")

    def start(self, timeout: float = 30.0) -> "FeedbackServer":
        """Binds and starts serving in a daemon thread; raises ``OSError`` if the port is taken."""
        if self.running:
            return self
        saver = [lambda runner: self._saver()] if self.save_path is not None else []
        watch = [lambda runner: self._connections.watch(runner.server)]
        self._app = AppThread(self._app_on_loop, self.host, self.requested_port, name="oni-feedback",
                              lingering_time=min(10.0, self.read_timeout), background=saver + watch)
        try:
            self._app.start(timeout)
        except TimeoutError:
            raise RuntimeError("the labelling page did not start in time") from None
        self.port = self._app.port
        if self.announce:
            where = self.url_with_token if self.token else self.url
            extra = " (access token required: keep this address private)" if self.token else ""
            print(f"labelling page: {where}{extra}", file=sys.stderr, flush=True)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops serving, then saves the store once more when ``save_path`` is set. Idempotent."""
        if self._app is not None:
            self._app.stop(timeout)
            self._app = None
        if self.save_path is not None and self._dirty_since_save:
            self._save_now()

    def __enter__(self) -> "FeedbackServer":
        return self.start() if not self.running else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def metrics(self) -> Dict[str, float]:
        """For the trainer's logs: ``human_labels`` (this session), ``human_agreement`` (NaN when
        nothing was compared yet), ``human_compared``."""
        with self._lock:
            given = sum(1 for a in self._actions if a.value is not None)
            agree = self._agree["caption"] + self._agree["pair"]
        return {"human_labels": float(given), "human_compared": float(len(agree)),
                "human_agreement": float(np.mean(agree)) if agree else float("nan")}

    def _app_on_loop(self) -> web.Application:
        # Called on the page's own loop at every start: the event the saver waits on belongs there.
        self._dirty_event = asyncio.Event()
        return self.make_app()

    # ------------------------------------------------------------------ saving
    def _changed(self) -> None:
        self._dirty_since_save = True
        if self._dirty_event is not None:
            self._dirty_event.set()

    async def _saver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._dirty_event.wait()
            self._dirty_event.clear()
            await loop.run_in_executor(None, self._save_now)
            await asyncio.sleep(self.save_interval_s)  # answers in a burst are saved together

    def _save_now(self) -> None:
        with self._save_lock:
            self._dirty_since_save = False
            try:
                self.store.save(self.save_path)
                self.saves += 1
                self.save_error = None
            except Exception as err:  # noqa: BLE001 - keep serving; the page shows the error
                self._dirty_since_save = True
                self.save_error = f"{type(err).__name__}: {err}"
                logger.error("could not save the caption store to %s: %s", self.save_path, self.save_error)

    # ------------------------------------------------------------------ the app
    def make_app(self) -> web.Application:
        """The aiohttp application (also usable with aiohttp's test client)."""
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._api_state)
        app.router.add_get("/api/queue", self._api_queue)
        app.router.add_get("/api/screen", self._api_screen)
        app.router.add_post("/api/label", self._api_label)
        app.router.add_post("/api/prefer", self._api_prefer)
        app.router.add_post("/api/undo", self._api_undo)
        return app

    def _host_ok(self, host_header: str) -> bool:
        if not self.loopback:
            return True  # off loopback the token is the gate
        return self._hosts(host_header)

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        api = request.path.startswith("/api/")
        self._connections.enter(request.protocol)
        try:
            if not self._host_ok(request.host):
                raise _BadRequest("unexpected Host header", 403)
            if api:
                if self.token is not None:
                    given = request.headers.get(TOKEN_HEADER, "")
                    if not hmac.compare_digest(given.encode(), self.token.encode()):
                        raise _BadRequest("missing or wrong access token", 401)
                refused = post_refusal(request)
                if refused is not None:
                    raise _BadRequest(refused[1], refused[0])
            response = await handler(request)
        except _BadRequest as err:
            response = web.json_response({"error": str(err)}, status=err.status)
        except web.HTTPException as err:
            if not api:
                raise
            response = web.json_response({"error": err.reason}, status=err.status)
        finally:
            self._connections.leave(request.protocol)
        response.headers.update(_SECURITY_HEADERS)
        return response

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Content-Type": "text/html; charset=utf-8"})

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        types = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
        if name not in types:  # a fixed list: no path walking
            raise web.HTTPNotFound()
        return web.FileResponse(STATIC_DIR / name, headers={"Content-Type": types[name]})

    async def _body(self, request: web.Request) -> Dict[str, Any]:
        try:
            raw = await asyncio.wait_for(request.read(), self.read_timeout)
        except asyncio.TimeoutError:
            raise _BadRequest(f"the body did not arrive within {self.read_timeout:g} s", 408) from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise _BadRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        return body

    # ------------------------------------------------------------------ state
    def _human_pid_now(self) -> int:
        """The id of this server's provenance in the store's table (it exists once we wrote)."""
        if self._human_pid is None:
            self._human_pid = self.store.provenances.index(self.provenance)
        return self._human_pid

    def state(self) -> Dict[str, Any]:
        """What ``GET /api/state`` answers."""
        with self._lock:
            given = sum(1 for a in self._actions if a.value is not None)
            agreement = {}
            for kind, hits in self._agree.items():
                rates = np.cumsum(hits) / np.arange(1, len(hits) + 1) if hits else np.zeros(0)
                step = max(1, -(-len(rates) // _SERIES_POINTS))
                points = [[int(i + 1), round(float(rates[i]), 4)] for i in range(step - 1, len(rates), step)]
                if len(rates) and points[-1][0] != len(rates):
                    points.append([len(rates), round(float(rates[-1]), 4)])
                agreement[kind] = {"compared": len(hits), "agree": int(sum(hits)), "series": points}
            can_undo = bool(self._actions)
            skipped = {k: set(v) for k, v in self._skipped.items()}
        waiting = len(self.view.caption_candidates(skipped["caption"])["slots"])
        pairs_waiting = len(self.view.pair_candidates(skipped["pair"]))
        stats = self.store.stats()
        return {
            "given": given,
            "human_total": self.store.count_by(HUMAN),
            "waiting": {"captions": waiting, "pairs": pairs_waiting},
            "agreement": agreement,
            "order": "disagree" if self.scorer is not None else "frequency",
            "first": self._first_waiting(skipped["caption"]),
            "can_undo": can_undo,
            "labeller": self.provenance.model,
            "store": {k: stats[k] for k in ("size", "labelled", "unseen", "pending", "pairs", "pairs_labelled")},
            "save_error": self.save_error,
        }

    async def _api_state(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.state())

    async def _api_queue(self, request: web.Request) -> web.StreamResponse:
        kind = request.query.get("kind", "captions")
        if kind not in ("captions", "pairs"):
            raise _BadRequest("kind must be 'captions' or 'pairs'")
        limit = _parse_int(request.query.get("limit", "10"), "limit")
        if not 1 <= limit <= _MAX_LIMIT:
            raise _BadRequest(f"limit must be in [1, {_MAX_LIMIT}]")
        work = self._queue_captions if kind == "captions" else self._queue_pairs
        # a scorer runs a network: keep it off the loop so other requests are answered meanwhile
        result = await asyncio.get_running_loop().run_in_executor(None, work, limit)
        return web.json_response(result)

    async def _api_screen(self, request: web.Request) -> web.StreamResponse:
        h = _parse_int(request.query.get("id", ""), "id")
        found = None if self.snapshots is None else self.snapshots.get(h)
        if found is None:
            raise _BadRequest("no screen kept for this caption", 404)
        chars, colors = found
        return web.json_response({
            "rows": [bytes(row).decode("latin-1") for row in chars],
            "colors": colors.astype(int).tolist(),
        })

    # ------------------------------------------------------------------ answers
    async def _api_label(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        h = _parse_int(body.get("id"), "id")
        answer = body.get("answer")
        if not isinstance(answer, str) or answer not in CAPTION_ANSWERS:
            raise _BadRequest(f"answer must be one of {', '.join(CAPTION_ANSWERS)}")
        self.label_caption(h, answer)
        return web.json_response({"ok": True, **self.state()})

    def label_caption(self, caption_hash: int, answer: str) -> None:
        """Records a person's answer for a caption (what ``POST /api/label`` does)."""
        row = self.view.caption_row(caption_hash)
        if row is None:
            raise _BadRequest("unknown caption id")
        value = CAPTION_ANSWERS[answer]
        if value is None:
            with self._lock:
                self._skipped["caption"].add(caption_hash)
                self._actions.append(_Action("caption", caption_hash, answer))
            return
        prev_pid = int(row["provenance"])
        compared = (int(row["status"]) == LABELLED and prev_pid >= 0
                    and self.store.provenances[prev_pid].annotator != HUMAN)
        self.store.set_labels([caption_hash], [value], self.provenance)
        self._human_pid_now()
        with self._lock:
            if compared:
                self._agree["caption"].append(int((float(row["label"]) >= 0.5) == (value >= 0.5)))
            self._actions.append(_Action("caption", caption_hash, answer, value, row, compared))
        if self.snapshots is not None:
            self.snapshots.unpin([caption_hash])
        self._changed()

    async def _api_prefer(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        slot = _parse_int(body.get("id"), "id")
        answer = body.get("answer")
        if not isinstance(answer, str) or answer not in PAIR_ANSWERS:
            raise _BadRequest(f"answer must be one of {', '.join(PAIR_ANSWERS)}")
        self.prefer_pair(slot, answer)
        return web.json_response({"ok": True, **self.state()})

    def prefer_pair(self, slot: int, answer: str) -> None:
        """Records a person's preference for a pair (what ``POST /api/prefer`` does)."""
        if not 0 <= slot < self.store.num_pairs:
            raise _BadRequest("unknown pair id")
        rows = self.view.pair_rows(np.array([slot]))
        row = {k: v[0] for k, v in rows.items()}
        value = PAIR_ANSWERS[answer]
        if value is None:
            with self._lock:
                self._skipped["pair"].add(slot)
                self._actions.append(_Action("pair", slot, answer))
            return
        prev_pid = int(row["provenance"])
        compared = (int(row["status"]) == LABELLED and prev_pid >= 0
                    and self.store.provenances[prev_pid].annotator != HUMAN)
        self.store.set_preferences([slot], [value], self.provenance)
        self._human_pid_now()
        with self._lock:
            if compared:
                self._agree["pair"].append(int(float(row["preference"]) == value))
            self._actions.append(_Action("pair", slot, answer, value, row, compared))
        self._changed()

    async def _api_undo(self, request: web.Request) -> web.StreamResponse:
        await self._body(request)
        undone = self.undo()
        if undone is None:
            raise _BadRequest("nothing to undo", 409)
        return web.json_response({"ok": True, "undone": undone, **self.state()})

    def undo(self) -> Optional[Dict[str, Any]]:
        """Reverts the last answer given through this server; ``None`` when there is none.

        A label is only put back if the store still holds it (an LLM label written since wins).
        """
        with self._lock:
            if not self._actions:
                return None
            action = self._actions.pop()
            if action.value is None:
                self._skipped[action.kind].discard(action.key)
            elif action.compared:
                self._agree[action.kind].pop()
        restored = True
        if action.value is not None:
            pid = self._human_pid_now()
            if action.kind == "caption":
                restored = self.store.restore_label(action.key, action.prev, expect_provenance=pid,
                                                    expect_label=action.value)
            else:
                restored = self.store.restore_preference(action.key, action.prev, expect_provenance=pid,
                                                         expect_preference=action.value)
            self._changed()
        return {"kind": action.kind, "id": str(action.key), "answer": action.answer, "restored": restored}


def serve_feedback(
    store: CaptionStore,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: Optional[str] = None,
    **kwargs,
) -> FeedbackServer:
    """Starts the labelling page on a live store and returns its handle (a :class:`FeedbackServer`).

    What ``oni-train --human-feedback [--feedback-port P]`` calls. The page runs in its own
    thread; call ``handle.stop()`` (or use it as a context manager) at the end of the run.

    Raises:
        ValueError: off loopback with ``token=""``, or a bad argument.
        OSError: the address cannot be bound (port in use, unknown host).
    """
    return FeedbackServer(store, host, port, token, **kwargs).start()
