"""ELLM goal suggestions: a prompt, a robust parser, a scripted suggester and an async client.

ELLM (Du et al., 2023) asks a language model, for each state, "what could the agent do now?"
and rewards the agent when what it does matches one of the answers. Here a state is a state
caption (:mod:`torchrl_oni.envs.state_captions`) and an answer is a short list of goals.

* :func:`goal_messages`: the prompt (our own wording; version :data:`GOAL_PROMPT_VERSION`,
  kept in every suggestion's provenance): the state in a ``<state>`` tag, one worked example,
  and a request for at most ``max_goals`` goals, one ``- goal`` line each.
* :func:`parse_goals`: bullet lines, numbered lines, a JSON list or one ``;``-separated line →
  a de-duplicated, lower-cased list of at most ``max_goals`` goals of at most ``max_words``
  words; ``None`` when nothing usable is there (the state is then retried, never given 0 goals).
* :class:`ScriptedGoalSuggester`: goals from the caption's visible features (``descend the
  stairs`` when a staircase down is visible, ``kill the jackal`` for a jackal...), no LLM; a
  test tool and a fallback, like :class:`~torchrl_oni.annotators.scripted.ScriptedAnnotator`.
* :class:`OpenAIGoalSuggester`: an aiohttp client for any OpenAI-compatible server, with the
  same fault handling as :class:`~torchrl_oni.annotators.openai.OpenAIAnnotator` (whose
  :class:`~torchrl_oni.annotators.openai.CircuitBreaker` and URL check it reuses): bounded
  concurrency, retries with backoff on 5xx/429/timeouts/connection errors/malformed JSON, a
  circuit breaker while the server is down, and failures returned (never raised) for the
  caller to queue again later.

Example:
    >>> import asyncio
    >>> from torchrl_oni.annotators.goals import ScriptedGoalSuggester, goal_messages, parse_goals
    >>> parse_goals("Sure! Here are goals:\\n- Kill the newt.\\n- kill the newt\\n2. **Pick up the gold**")
    ['kill the newt', 'pick up the gold']
    >>> parse_goals("I don't know.") is None
    True
    >>> state = "Dungeon level 1. You are healthy and hungry. Next to you: a newt. Nearby: a staircase down."
    >>> asyncio.run(ScriptedGoalSuggester().suggest([state]))[0].goals
    ('kill the newt', 'descend the stairs', 'find something to eat')
    >>> goal_messages(state)[1]["content"].count("<state>")
    2
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import aiohttp

from torchrl_oni.annotators import prompts as P
from torchrl_oni.annotators.base import AnnotatorStats, Provenance
from torchrl_oni.annotators.openai import AnnotatorUnavailable, CircuitBreaker, normalize_base_url

__all__ = [
    "GOAL_PROMPT_VERSION",
    "GoalSuggestion",
    "GoalSuggester",
    "ScriptedGoalSuggester",
    "OpenAIGoalSuggester",
    "goal_messages",
    "goal_user_prompt",
    "extract_state",
    "parse_goals",
]

GOAL_PROMPT_VERSION = "ellm-goals-v1"
SCRIPTED_GOALS_VERSION = "goal-rules-v1"
MAX_GOALS = 5
MAX_WORDS = 10

GOAL_SYSTEM_PROMPT = (
    "You coach a NetHack player. You know the game well and give short, concrete, practical "
    "advice about what to do next."
)

_EXAMPLE_STATE = (
    "Dungeon level 2. You are wounded and hungry. Next to you: a jackal. "
    "Nearby: a staircase down, a food ration."
)
_EXAMPLE_GOALS = ("kill the jackal", "eat the food ration", "descend the stairs")


def _clean(text: str) -> str:
    return " ".join(str(text).split())


def goal_user_prompt(caption: str, max_goals: int = MAX_GOALS) -> str:
    """The user turn of the goal prompt for one state caption."""
    return "\n\n".join([
        "I will describe what a NetHack player sees and feels right now. Suggest what they could "
        f"achieve in the next few moves: at most {max_goals} goals, most useful first.",
        "Each goal is one short instruction of at most eight words that names a single concrete "
        "action, such as attacking a monster, picking up an item, opening a door or going down a "
        "staircase. Only suggest goals that the described situation makes possible.",
        "Example:\n<state>" + _EXAMPLE_STATE + "</state>\n"
        + "\n".join(f"- {g}" for g in _EXAMPLE_GOALS),
        f"Now the real situation:\n<state>{_clean(caption)}</state>",
        "Answer with one goal per line, each line starting with \"- \", and write nothing else.",
    ])


def goal_messages(caption: str, max_goals: int = MAX_GOALS) -> List[Dict[str, str]]:
    """System + user chat messages asking for goals for ``caption``."""
    return [
        {"role": "system", "content": GOAL_SYSTEM_PROMPT},
        {"role": "user", "content": goal_user_prompt(caption, max_goals)},
    ]


_STATE_RE = re.compile(r"<state>(.*?)</state>", re.S)


def extract_state(prompt: str) -> Optional[str]:
    """The state caption a goal prompt asks about (the last ``<state>``; for test servers)."""
    found = _STATE_RE.findall(prompt)
    return found[-1] if found else None


# ------------------------------------------------------------------ parsing
_BULLET = re.compile(r"^\s*(?:[-*•+]|\(?\d{1,2}[.)]|goal\s*\d*\s*[:.)-])\s*", re.I)
_WRAP = " \t\"'`*_“”‘’"
_PREAMBLE = re.compile(r"^(?:sure|okay|ok|here|goals?|the player|i would|i suggest|suggested)\b.*:$", re.I)


def _normalise_goal(text: str) -> str:
    text = re.sub(r"[*_`]+", "", text)  # markdown emphasis
    text = _clean(text).strip(_WRAP).rstrip(".!;:,").strip(_WRAP).lower()
    text = re.sub(r"^(?:to|try to|you should|you could|you can)\s+", "", text)
    return text


# a goal is an instruction; a line that starts with a subject or an apology is prose
_PROSE = re.compile(r"^(?:i|i'm|i'd|we|you|he|she|it|it's|they|this|that|there|sorry|as an|"
                    r"unfortunately|the player|note|answer|goals?)\b")


def _valid(goal: str, max_words: int, max_chars: int) -> bool:
    return (bool(re.search(r"[a-z]", goal)) and len(goal.split()) <= max_words
            and len(goal) <= max_chars and not re.search(r"[<>?]", goal)
            and not _PROSE.match(goal))


def _candidates(text: str) -> List[str]:
    body = re.sub(r"```[a-z]*", "", text)
    start, end = body.find("["), body.rfind("]")
    if 0 <= start < end:
        try:
            data = json.loads(body[start : end + 1])
            if isinstance(data, list) and all(isinstance(x, str) for x in data):
                return data
        except ValueError:
            pass
    lines = [ln for ln in body.splitlines() if ln.strip()]
    bulleted = [_BULLET.sub("", ln, count=1) for ln in lines if _BULLET.match(ln)]
    if bulleted:
        return bulleted
    lines = [ln for ln in lines if not _PREAMBLE.match(ln.strip())]
    if len(lines) == 1 and ";" in lines[0]:
        return lines[0].split(";")
    return lines


def parse_goals(text: str, max_goals: int = MAX_GOALS, *, max_words: int = MAX_WORDS,
                max_chars: int = 80) -> Optional[List[str]]:
    """Goals from a model's answer, or ``None`` when it holds none.

    Accepted layouts: ``- goal`` / ``* goal`` / ``1. goal`` / ``Goal 1: goal`` lines (other lines
    are then ignored), a JSON list of strings, one goal per plain line, or one line of goals
    separated by ``;``. Goals are lower-cased, stripped of markdown, quotes and final
    punctuation, de-duplicated (first kept), and dropped when longer than ``max_words`` words or
    ``max_chars`` characters (an explanation, not a goal); at most ``max_goals`` are kept.

    Example:
        >>> parse_goals('["Open the door", "open the door.", "Kill the newt"]')
        ['open the door', 'kill the newt']
        >>> parse_goals("- a\\n- b\\n- c", max_goals=2)
        ['a', 'b']
    """
    if not text or not text.strip():
        return None
    out: List[str] = []
    for raw in _candidates(text):
        goal = _normalise_goal(raw)
        if _valid(goal, max_words, max_chars) and goal not in out:
            out.append(goal)
        if len(out) >= max_goals:
            break
    return out or None


# ------------------------------------------------------------------ protocol
@dataclass
class GoalSuggestion:
    """The goals suggested for one state, or why there are none.

    Attributes:
        goals: the goals (a tuple, maybe empty for a scripted suggester with nothing to say);
            ``None`` when the request failed.
        provenance: who suggested them.
        error: ``"unparsable"``, ``"http 500"``, ``"timeout"``, ``"circuit open"``...; ``None`` if ok.
        raw: the model's answer, kept for inspection.
    """

    goals: Optional[Tuple[str, ...]]
    provenance: Provenance
    error: Optional[str] = None
    raw: str = ""

    @property
    def ok(self) -> bool:
        return self.goals is not None and self.error is None


@runtime_checkable
class GoalSuggester(Protocol):
    """What the goal worker needs from a goal source."""

    provenance: Provenance

    async def suggest(self, captions: Sequence[str]) -> List[GoalSuggestion]:
        """One :class:`GoalSuggestion` per state caption, in order (failures included)."""
        ...

    async def aclose(self) -> None:
        """Releases connections; safe to call twice."""
        ...


# ------------------------------------------------------------------ scripted
_SECTION = re.compile(r"(Next to you|Nearby|You carry|Message): (.*?)(?=(?: Next to you: | Nearby: "
                      r"| You carry: | Message: )|$)")
_HEALTH = re.compile(r"You are (healthy|wounded|badly wounded)?(?: and )?([a-z ]+)?\.")
# NetHack 3.6's food objects (what the state captions name; corpses are "<monster> corpse")
_FOODS = frozenset((
    "tripe ration", "egg", "meatball", "meat stick", "huge chunk of meat", "meat ring",
    "glob of gray ooze", "glob of brown pudding", "glob of green slime", "glob of black pudding",
    "kelp frond", "eucalyptus leaf", "apple", "orange", "pear", "melon", "banana", "carrot",
    "sprig of wolfsbane", "clove of garlic", "slime mold", "lump of royal jelly", "cream pie",
    "candy bar", "fortune cookie", "pancake", "lembas wafer", "cram ration", "food ration",
    "K-ration", "C-ration", "tin", "corpse",
))
_ITEMS = ("weapon", "piece of armor", "ring", "amulet", "tool", "potion", "scroll", "spellbook",
          "wand", "gem or stone")
_INERT = ("statue", "boulder", "iron ball", "iron chain", "venom")


def _strip_article(phrase: str) -> str:
    return re.sub(r"^(?:an?|the|some|your)\s+", "", phrase)


class ScriptedGoalSuggester:
    """Goals from a state caption's visible features, by hand-written rules (no LLM).

    Reads captions written by :class:`~torchrl_oni.envs.state_captions.StateCaptioner`:
    things next to the agent come first, then things nearby.

    ================================  ==========================================
    caption mentions                  goal
    ================================  ==========================================
    a monster (not a pet)             ``kill the <monster>``
    a staircase or ladder down        ``descend the stairs``
    gold                              ``pick up the gold``
    food (a corpse, a ration...)      ``eat the <food>`` if hungry, else
                                      ``pick up the <food>``
    another item                      ``pick up the <item>``
    a closed door                     ``open the door``
    a fountain                        ``drink from the fountain``
    hungry / weak, no food in sight   ``find something to eat``
    badly wounded                     ``rest to recover health``
    nothing of the above              ``explore the level``
    ================================  ==========================================

    Args:
        max_goals: at most this many goals per state.

    Example:
        >>> s = ScriptedGoalSuggester()
        >>> s.goals("Dungeon level 1. You are healthy and not hungry. Nearby: gold, a potion.")
        ('pick up the gold', 'pick up the potion')
    """

    def __init__(self, max_goals: int = MAX_GOALS):
        self.max_goals = int(max_goals)
        self.provenance = Provenance("scripted", SCRIPTED_GOALS_VERSION, SCRIPTED_GOALS_VERSION)
        self.stats = AnnotatorStats()

    def goals(self, caption: str) -> Tuple[str, ...]:
        sections = dict(_SECTION.findall(caption))
        health = _HEALTH.search(caption)
        wounds = (health.group(1) or "") if health else ""
        hunger = (health.group(2) or "") if health else ""
        hungry = any(w in hunger for w in ("hungry", "weak", "faint")) and "not hungry" not in hunger
        phrases = []
        for title in ("Next to you", "Nearby"):
            body = sections.get(title, "").rstrip(".")
            phrases += [p.strip() for p in body.split(",") if p.strip()]
        out: List[str] = []
        food_seen = False
        for phrase in phrases:
            name = _strip_article(phrase)
            if phrase.startswith("your ") or phrase == "the inside of a monster":
                continue
            if "staircase down" in phrase or "ladder down" in phrase:
                goal = "descend the stairs"
            elif phrase == "gold":
                goal = "pick up the gold"
            elif phrase == "a closed door":
                goal = "open the door"
            elif phrase == "a fountain":
                goal = "drink from the fountain"
            elif name in _FOODS or name.endswith(" corpse"):
                food_seen = True
                goal = f"eat the {name}" if hungry else f"pick up the {name}"
            elif name in _ITEMS:
                goal = f"pick up the {name}"
            elif name in _INERT or _is_feature(phrase):
                goal = None
            elif phrase[:2] in ("a ", "an") or phrase[0].isupper():  # what is left: monsters
                goal = f"kill the {name}"
            else:
                goal = None
            if goal and goal not in out:
                out.append(goal)
        if hungry and not food_seen:
            out.append("find something to eat")
        if wounds == "badly wounded":
            out.append("rest to recover health")
        if not out:
            out.append("explore the level")
        return tuple(out[: self.max_goals])

    async def suggest(self, captions: Sequence[str]) -> List[GoalSuggestion]:
        """One suggestion per caption; never fails."""
        self.stats.requests += 1
        self.stats.captions += len(captions)
        self.stats.labelled += len(captions)
        return [GoalSuggestion(self.goals(c), self.provenance) for c in captions]

    async def aclose(self) -> None:
        """Nothing to release."""


_FEATURE_WORDS = ("staircase", "ladder", "door", "doorway", "altar", "sink", "throne", "grave",
                  "tree", "drawbridge", "trap", "pit", "hole", "web", "portal", "teleporter",
                  "squeaky board", "land mine", "rolling boulder", "magic trap", "anti-magic field")


def _is_feature(phrase: str) -> bool:
    return any(w in phrase for w in _FEATURE_WORDS)


# ------------------------------------------------------------------ OpenAI-compatible client
_RETRYABLE = ("timeout", "connection error", "malformed json", "wrong count")


class _Failed(Exception):
    def __init__(self, kind: str, retryable: bool = True) -> None:
        super().__init__(kind)
        self.kind = kind
        self.retryable = retryable


class OpenAIGoalSuggester:
    """Asks an OpenAI-compatible server (vLLM, the embedded server...) for goals; async, fault tolerant.

    Args:
        base_url: e.g. ``http://gpu-node:8000/v1`` (``host:port`` accepted).
        model: the served model name; ``None``: the only model the server lists (found by
            :meth:`check`, which must then be awaited first).
        api: ``"chat"`` (``/v1/chat/completions``, one request per state) or ``"completions"``
            (``batch_size`` prompts per ``/v1/completions`` request).
        max_goals: goals asked for and kept per state.
        batch_size: prompts per ``completions`` request.
        max_concurrency: requests in flight at once.
        timeout_s: per-request time limit.
        max_retries: extra attempts for a failed request (then the failure is returned).
        backoff_s, max_backoff_s: first and longest retry delay (doubling, with jitter).
        temperature: sampling temperature.
        max_tokens: answer length limit.
        text_style: ``completions`` layout, ``"plain"`` or ``"llama-3"`` (default from the name).
        api_key: bearer token (local servers ignore it).
        circuit_failures, circuit_cooldown_s: the circuit breaker (see ``OpenAIAnnotator``).

    Raises:
        ValueError: bad URL or option (one line).

    Example:
        >>> s = OpenAIGoalSuggester("localhost:8000", "qwen")
        >>> s.base_url, s.provenance.prompt_version
        ('http://localhost:8000/v1', 'ellm-goals-v1')
    """

    def __init__(
        self,
        base_url: str,
        model: Optional[str],
        *,
        api: str = "chat",
        max_goals: int = MAX_GOALS,
        batch_size: int = 32,
        max_concurrency: int = 4,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        temperature: float = 0.2,
        max_tokens: int = 96,
        text_style: Optional[str] = None,
        api_key: str = "EMPTY",
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 30.0,
    ):
        self.base_url = normalize_base_url(base_url)
        if model is not None and not model:
            raise ValueError("model name is empty: pass the name the server lists at /v1/models")
        if api not in ("chat", "completions"):
            raise ValueError(f"unknown api {api!r}; choose 'chat' or 'completions'")
        if min(batch_size, max_concurrency, max_goals) < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("batch_size, max_concurrency and max_goals must be >= 1, "
                             "max_retries >= 0, timeout_s > 0")
        self.model = model
        self.api = api
        self.max_goals = int(max_goals)
        self.batch_size = int(batch_size)
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self._auto_style = text_style is None
        self.text_style = text_style or P.default_text_style(model or "")
        P.render_text([], self.text_style)  # validates the style
        self.api_key = api_key
        self.breaker = CircuitBreaker(circuit_failures, circuit_cooldown_s)
        self.stats = AnnotatorStats()
        self.provenance = Provenance("openai", model or "", GOAL_PROMPT_VERSION)
        self._session: Optional[aiohttp.ClientSession] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._semaphore: Optional[asyncio.Semaphore] = None

    # ------------------------------------------------------------------ session
    def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # a session belongs to one event loop: a new loop gets a new session
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._session

    async def aclose(self) -> None:
        """Closes the HTTP session (only from its own event loop; otherwise it is dropped)."""
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()

    async def check(self) -> List[str]:
        """Lists the served models; raises :class:`AnnotatorUnavailable` (one line) if unusable.

        With ``model=None`` the only served model is chosen (several: an error naming them).
        """
        session = self._ensure_session()
        limit = min(self.timeout_s, 10.0)
        try:
            async with session.get(f"{self.base_url}/models",
                                   timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                status, body = resp.status, await resp.read()
        except asyncio.TimeoutError:
            raise AnnotatorUnavailable(
                f"LLM server at {self.base_url} did not answer /models within {limit:g} s") from None
        except aiohttp.ClientError as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise AnnotatorUnavailable(f"cannot reach LLM server at {self.base_url}: {reason}") from None
        try:
            names = [str(m["id"]) for m in json.loads(body)["data"]] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            names = None
        if names is None:
            raise AnnotatorUnavailable(f"LLM server at {self.base_url} answered HTTP {status} to "
                                       "GET /models (is this an OpenAI-compatible /v1 URL?)")
        if self.model is None:
            if len(names) != 1:
                raise AnnotatorUnavailable(f"LLM server at {self.base_url} serves {len(names)} models "
                                           f"({', '.join(names) or 'none'}); name one")
            self.model = names[0]
            self.provenance = Provenance("openai", self.model, GOAL_PROMPT_VERSION)
            if self._auto_style:
                self.text_style = P.default_text_style(self.model)
        if self.model not in names:
            raise AnnotatorUnavailable(f"model {self.model!r} is not served at {self.base_url}; "
                                       f"served: {', '.join(names) or 'none'}")
        return names

    # ------------------------------------------------------------------ requests
    async def _post(self, path: str, payload: Dict[str, Any]) -> Dict[str, Any]:
        if not self.breaker.allow():
            raise _Failed("circuit open", retryable=False)
        session = self._ensure_session()
        start = time.perf_counter()
        self.stats.requests += 1
        try:
            async with session.post(f"{self.base_url}{path}", json=payload) as resp:
                status, body = resp.status, await resp.read()
        except asyncio.TimeoutError:
            raise _Failed("timeout") from None
        except aiohttp.ClientError:
            raise _Failed("connection error") from None
        finally:
            self.stats.latency_s_total += time.perf_counter() - start
        if status == 429 or status >= 500:
            raise _Failed(f"http {status}")
        if status >= 400:  # the request itself is wrong: asking again cannot help
            raise _Failed(f"http {status}", retryable=False)
        try:
            data = json.loads(body)
        except ValueError:
            raise _Failed("malformed json") from None
        if not isinstance(data, dict):
            raise _Failed("malformed json")
        return data

    @staticmethod
    def _texts(data: Dict[str, Any], n: int) -> List[str]:
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            raise _Failed("wrong count")
        out: List[Optional[str]] = [None] * n
        for pos, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise _Failed("malformed json")
            index = choice.get("index", pos if n == 1 else None)
            if not isinstance(index, int) or not 0 <= index < n or out[index] is not None:
                raise _Failed("wrong count")
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else choice.get("text")
            if text is not None and not isinstance(text, str):
                raise _Failed("malformed json")
            out[index] = text or ""
        return out  # type: ignore[return-value]

    def _count_failure(self, kind: str) -> None:
        self.stats.count_error(kind)
        if kind == "timeout":
            self.stats.timeouts += 1
        elif kind.startswith("http 5") or kind == "http 429" or kind in _RETRYABLE:
            self.stats.server_errors += 1

    async def _ask(self, captions: List[str]) -> List[str]:
        """Answer texts for ``captions`` (one request), with retries; raises ``_Failed``."""
        if self.model is None:
            raise _Failed("no model (await check() first)", retryable=False)
        convs = [goal_messages(c, self.max_goals) for c in captions]
        payload: Dict[str, Any] = {"model": self.model, "temperature": self.temperature,
                                   "max_tokens": self.max_tokens}
        if self.api == "chat":
            path, payload["messages"] = "/chat/completions", convs[0]
        else:
            path = "/completions"
            payload["prompt"] = [P.render_text(c, self.text_style) for c in convs]
        last: Optional[_Failed] = None
        for attempt in range(self.max_retries + 1):
            try:
                self._ensure_session()
                async with self._semaphore:  # type: ignore[union-attr]
                    data = await self._post(path, payload)
                texts = self._texts(data, len(captions))
                self.breaker.record_success()
                return texts
            except _Failed as failure:
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

    async def _suggest_chunk(self, captions: List[str], out: list, where: List[int]) -> None:
        try:
            texts = await self._ask([captions[i] for i in where])
        except _Failed as failure:
            for i in where:
                out[i] = GoalSuggestion(None, self.provenance, error=failure.kind)
            return
        except Exception as err:  # noqa: BLE001 - a client bug must not kill the worker
            kind = f"client error: {type(err).__name__}"
            self.stats.count_error(kind)
            for i in where:
                out[i] = GoalSuggestion(None, self.provenance, error=kind)
            return
        for i, text in zip(where, texts):
            goals = parse_goals(text, self.max_goals)
            if goals is None:
                self.stats.unparsable += 1
                self.stats.count_error("unparsable")
                out[i] = GoalSuggestion(None, self.provenance, error="unparsable", raw=text)
            else:
                self.stats.labelled += 1
                out[i] = GoalSuggestion(tuple(goals), self.provenance, raw=text)

    async def suggest(self, captions: Sequence[str]) -> List[GoalSuggestion]:
        """One :class:`GoalSuggestion` per caption, in order; failures carry ``error``."""
        captions = [str(c) for c in captions]
        self.stats.captions += len(captions)
        out: List[Optional[GoalSuggestion]] = [None] * len(captions)
        if not captions:
            return []
        self._ensure_session()
        step = self.batch_size if self.api == "completions" else 1
        chunks = [list(range(i, min(i + step, len(captions)))) for i in range(0, len(captions), step)]
        await asyncio.gather(*(self._suggest_chunk(captions, out, c) for c in chunks))
        return out  # type: ignore[return-value]
