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
* :class:`OpenAIGoalSuggester`: the goal prompt sent to any OpenAI-compatible server (or a
  pool of them) through an :class:`~torchrl_oni.annotators.client.LLMClient`
  (:meth:`~torchrl_oni.annotators.client.LLMClient.complete`), the client labels go through
  too, so goals get the budgets and fault handling of labels: adaptive request sizes and time
  limits, retries with backoff on another server, circuit breakers with health checks, and
  failures returned (never raised) for the goal table to queue again later.

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

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

from torchrl_oni.annotators.base import AnnotatorStats, Provenance
from torchrl_oni.annotators.client import LLMClient, LLMClientFacade

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


# ------------------------------------------------------------------ OpenAI-compatible servers
class OpenAIGoalSuggester(LLMClientFacade):
    """Asks OpenAI-compatible servers (vLLM, the embedded server...) for goals, through an
    :class:`~torchrl_oni.annotators.client.LLMClient` (``.client``).

    Labels and goals share one HTTP client class and one fault-handling policy: the goal prompts
    go through :meth:`LLMClient.complete <torchrl_oni.annotators.client.LLMClient.complete>`
    (a pool of servers, request sizes and time limits adapted to each server's latency, retries
    with backoff on another server, circuit breakers with health checks, HTTP 401 not retried,
    requests cancelled at :meth:`aclose`), and failures come back per state, never raised, for the
    :class:`~torchrl_oni.rewards.ellm.GoalTable` to queue again (server faults) or count
    (``"unparsable"``). The goal worker is steered by the client as the annotation worker is
    (:meth:`available`, :attr:`recoveries`, :meth:`batch_hint`, :meth:`concurrency_hint`).

    Args:
        base_url: a server, e.g. ``http://gpu-node:8000/v1`` (``host:port`` accepted), or a list
            of servers that all serve ``model`` (a pool).
        model: the served model name; ``None``: the only model the servers list (found by
            :meth:`check`, which must then be awaited first).
        api: ``"chat"`` (``/v1/chat/completions``, one request per state) or ``"completions"``
            (up to ``batch_size`` prompts per ``/v1/completions`` request).
        max_goals: goals asked for and kept per state.
        batch_size: most prompts per ``completions`` request.
        max_concurrency: most requests in flight per server.
        timeout_s: a fixed time limit per request; ``None`` (default): adapted to the latency
            each server shows, as for labels.
        max_retries: extra attempts for a failed request within one call.
        backoff_s, max_backoff_s: first and longest retry delay (doubling, with jitter).
        temperature: sampling temperature.
        max_tokens: answer length limit.
        text_style: ``completions`` layout, ``"plain"`` or ``"llama-3"`` (default from the name).
        api_key: bearer token; ``None`` reads ``OPENAI_API_KEY`` (no header when unset).
        circuit_failures, circuit_cooldown_s, probe_interval_s: the circuit breaker and health
            checks (see :class:`~torchrl_oni.annotators.client.LLMClient`).
        **client_kwargs: further ``LLMClient`` options (``adaptive``,
            ``initial_batch_size``, ``target_latency_s``, ``min_timeout_s``, ``max_timeout_s``,
            ``first_timeout_s``).

    Raises:
        ValueError: bad URL or option (one line).

    Example:
        >>> s = OpenAIGoalSuggester("localhost:8000", "qwen")
        >>> s.base_url, s.provenance.prompt_version
        ('http://localhost:8000/v1', 'ellm-goals-v1')
        >>> OpenAIGoalSuggester(["gpu-1:8000", "gpu-2:8000"], "qwen").base_urls
        ['http://gpu-1:8000/v1', 'http://gpu-2:8000/v1']
    """

    def __init__(
        self,
        base_url: Union[str, Sequence[str]],
        model: Optional[str],
        *,
        api: str = "chat",
        max_goals: int = MAX_GOALS,
        batch_size: int = 32,
        max_concurrency: int = 4,
        timeout_s: Optional[float] = None,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        temperature: float = 0.2,
        max_tokens: int = 96,
        text_style: Optional[str] = None,
        api_key: Optional[str] = None,
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 30.0,
        probe_interval_s: float = 2.0,
        **client_kwargs: Any,
    ):
        if max_goals < 1 or max_tokens < 1:
            raise ValueError("max_goals and max_tokens must be >= 1")
        self.client = LLMClient(
            base_url, model, api=api, batch_size=batch_size, max_concurrency=max_concurrency,
            timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
            temperature=temperature, max_tokens=max_tokens, text_style=text_style, api_key=api_key,
            circuit_failures=circuit_failures, circuit_cooldown_s=circuit_cooldown_s,
            probe_interval_s=probe_interval_s, **client_kwargs)
        self.max_goals = int(max_goals)

    # ------------------------------------------------------------------ the client's
    # (base_url, base_urls, model, api, stats, recoveries, check, aclose, the steering methods
    # and metrics come from LLMClientFacade; stats.labelled counts the states given goals)
    @property
    def provenance(self) -> Provenance:
        return Provenance("openai", self.client.model or "", GOAL_PROMPT_VERSION)

    # ------------------------------------------------------------------ goals
    async def suggest(self, captions: Sequence[str]) -> List[GoalSuggestion]:
        """One :class:`GoalSuggestion` per caption, in order; failures carry ``error``."""
        captions = [str(c) for c in captions]
        self.client.stats.captions += len(captions)
        answers = await self.client.complete([goal_messages(c, self.max_goals) for c in captions],
                                             max_tokens=self.client.max_tokens)
        provenance = self.provenance
        out: List[GoalSuggestion] = []
        for answer in answers:
            if not answer.ok:
                out.append(GoalSuggestion(None, provenance, error=answer.error))
                continue
            goals = parse_goals(answer.text, self.max_goals)
            self.client.record_parse(goals is not None, answer)
            if goals is None:
                out.append(GoalSuggestion(None, provenance, error="unparsable", raw=answer.text))
            else:
                out.append(GoalSuggestion(tuple(goals), provenance, raw=answer.text))
        return out
