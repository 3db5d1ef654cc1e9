"""Prompt templates that ask an LLM whether NetHack messages show progress.

Three template families, each with its own version string (kept in every label's provenance so
labels made with different wordings are never mixed silently):

* **classification, tagged** (:data:`CLS_PROMPT_VERSION`): ONI's structure — context, an
  instruction to state knowledge, analyse and label, a goal sentence, two neutral nonsense label
  tokens (:data:`POSITIVE_TOKEN` / :data:`NEGATIVE_TOKEN`), few-shot examples, the message and a
  strict tagged output format (``<knowledge>``, ``<analysis>``, ``<label>``). Meant for capable
  instruction-tuned models (e.g. Llama-3.1-8B-Instruct on vLLM).
* **classification, short** (:data:`SHORT_PROMPT_VERSION`): a few-shot question whose whole
  answer is one token, ``yes`` or ``no``. Small CPU models cannot follow the tagged format, but the
  probability they give to ``yes`` ranks messages well (AUC ≈0.9 for a 0.5B model), so this
  variant is meant to be read through the label token's logprob.
* **ranking** (:data:`RANK_PROMPT_VERSION`): Motif/ONI's pairwise structure — state knowledge
  and the goal, analyse each message from its text only, compare, then answer in a ``<best>`` tag
  with ``1``, ``2`` or ``tie``.

Goals (:data:`GOALS`): ``default`` (score: kill, collect gold, descend), ``combat``, ``gold``,
``stairs`` and ``zero-knowledge`` (no goal sentence, no examples), for every family.

Position bias: small models asked "which of two messages is better" nearly always pick the same
position. :class:`~torchrl_oni.annotators.openai.OpenAIAnnotator` can therefore ask both orders
(a disagreement becomes a tie) or derive the preference from two classification scores; the
ranking prompt itself is only used for the ``direct`` and ``both_orders`` modes.

Every prompt renders to chat messages (``/v1/chat/completions``) with
:func:`classification_messages` and friends, and to one plain string (``/v1/completions``)
with :func:`render_text`, either plain or in Llama-3's chat layout (what ONI sent to its
completions endpoint).

Example:
    >>> from torchrl_oni.annotators.prompts import (
    ...     classification_messages, extract_captions, render_text)
    >>> msgs = classification_messages("You kill the newt!", goal="combat")
    >>> [m["role"] for m in msgs]
    ['system', 'user']
    >>> "<message>You kill the newt!</message>" in msgs[1]["content"]
    True
    >>> text = render_text(msgs, style="llama-3")
    >>> text.startswith("<|begin_of_text|>") and text.endswith("<|end_header_id|>\\n\\n")
    True
    >>> extract_captions(render_text(msgs))
    ['You kill the newt!']
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

CLS_PROMPT_VERSION = "cls-tagged-v1"
SHORT_PROMPT_VERSION = "cls-short-v1"
RANK_PROMPT_VERSION = "rank-tagged-v1"

GOALS = ("default", "combat", "gold", "stairs", "zero-knowledge")
_GOAL_ALIASES = {"defaultgoal": "default", "zeroknowledge": "zero-knowledge", "score": "default"}

# Neutral tokens: a meaningless label keeps the model from leaning on the connotations of words
# such as "good"/"bad" (as ONI does).
POSITIVE_TOKEN = "FOO"
NEGATIVE_TOKEN = "BAR"
SHORT_POSITIVE = "yes"
SHORT_NEGATIVE = "no"

Message = Dict[str, str]

SYSTEM_PROMPT = (
    "You are an impartial judge of NetHack gameplay. You know the game well and you judge how "
    "much an in-game event moves a player towards their goal. Be useful and truthful; when you "
    "are unsure, say so instead of inventing facts."
)

_GOAL_SENTENCES = {
    "default": (
        "The player wants the highest possible score: killing monsters, picking up gold, "
        "gaining experience levels and going down to deeper dungeon levels all count as progress."
    ),
    "combat": (
        "The player only cares about fighting: killing monsters and gaining experience levels "
        "count as progress. Never treat collecting gold or taking stairs as progress."
    ),
    "gold": (
        "The player only cares about wealth: finding and picking up gold counts as progress. "
        "Never treat fighting monsters or taking stairs as progress."
    ),
    "stairs": (
        "The player only cares about going deeper: finding a staircase down and descending "
        "count as progress. Never treat fighting monsters or collecting gold as progress."
    ),
    "zero-knowledge": "",
}

# (message, helpful?) per goal. Our own examples; the structure follows ONI (4 shots).
_EXAMPLES: Dict[str, Tuple[Tuple[str, bool], ...]] = {
    "default": (
        ("You kill the jackal! Welcome to experience level 3.", True),
        ("You see here 14 gold pieces.", True),
        ("There is a staircase down here.", True),
        ("It's a wall.", False),
    ),
    "combat": (
        ("You kill the giant rat!", True),
        ("Welcome to experience level 5.", True),
        ("You see here 14 gold pieces.", False),
        ("There is a staircase down here.", False),
    ),
    "gold": (
        ("You see here 14 gold pieces.", True),
        ("You hear the footsteps of a guard on patrol.", True),
        ("You kill the jackal!", False),
        ("There is a staircase down here.", False),
    ),
    "stairs": (
        ("There is a staircase down here.", True),
        ("You find a hidden passage.", True),
        ("You kill the jackal!", False),
        ("You see here 14 gold pieces.", False),
    ),
    "zero-knowledge": (),
}


def canonical_goal(goal: str) -> str:
    """Returns the canonical goal name; raises a one-line ``ValueError`` for an unknown one."""
    key = _GOAL_ALIASES.get(goal, goal)
    if key not in GOALS:
        raise ValueError(f"unknown goal {goal!r}; choose one of {', '.join(GOALS)}")
    return key


def prompt_version(family: str, goal: str) -> str:
    """The provenance string of a template family and goal, e.g. ``'cls-tagged-v1:combat'``."""
    versions = {"tagged": CLS_PROMPT_VERSION, "short": SHORT_PROMPT_VERSION,
                "ranking": RANK_PROMPT_VERSION}
    if family not in versions:
        raise ValueError(f"unknown prompt family {family!r}; choose one of {', '.join(versions)}")
    return f"{versions[family]}:{canonical_goal(goal)}"


def _clean(caption: str) -> str:
    # Line breaks would break the one-message-per-tag layout; NetHack messages are one line.
    return caption.replace("\r", " ").replace("\n", " ")


def classification_user_prompt(caption: str, goal: str = "default") -> str:
    """The user turn of the tagged classification prompt."""
    goal = canonical_goal(goal)
    pos, neg = POSITIVE_TOKEN, NEGATIVE_TOKEN
    parts = [
        "I am playing NetHack and will show you one message the game printed during play.",
        "First write down what you know about NetHack and what its goal is. Then work out what "
        "the message means. Finally decide whether the situation it describes helps the player "
        "make progress towards the goal. Helpful means useful for winning the game, not merely "
        "informative.",
    ]
    if _GOAL_SENTENCES[goal]:
        parts.append(_GOAL_SENTENCES[goal])
    parts.append(
        f"Use the label {pos} for a message that shows clear progress, and the label {neg} for a "
        "message that is unhelpful, neutral or only slightly useful."
    )
    if _EXAMPLES[goal]:
        shots = "\n".join(
            f"<message>{m}</message> -> {pos if ok else neg}" for m, ok in _EXAMPLES[goal]
        )
        parts.append("Examples:\n" + shots)
    parts.append(f"Here is the message to judge:\n<message>{_clean(caption)}</message>")
    parts.append(
        "Reply in exactly this format and write nothing after it:\n"
        "<knowledge>what you know about NetHack and its goal</knowledge>\n"
        "<analysis>one sentence about the message</analysis>\n"
        f"<label>{pos} or {neg}</label>"
    )
    return "\n\n".join(parts)


def classification_messages(caption: str, goal: str = "default") -> List[Message]:
    """System + user chat messages of the tagged classification prompt."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": classification_user_prompt(caption, goal)},
    ]


def short_user_prompt(caption: str, goal: str = "default") -> str:
    """The user turn of the one-token (``yes``/``no``) classification prompt."""
    goal = canonical_goal(goal)
    question = "Does this NetHack message show progress towards the goal? Answer yes or no."
    head = "Goal: " + (_GOAL_SENTENCES[goal] or "win the game.")
    shots = "".join(
        f"Message: {m}\nProgress: {SHORT_POSITIVE if ok else SHORT_NEGATIVE}\n"
        for m, ok in _EXAMPLES[goal]
    )
    # The message comes last so a server can reuse the shared prefix across captions.
    return f"{head}\n{question}\n\n{shots}Message: <message>{_clean(caption)}</message>\nProgress:"


def short_messages(caption: str, goal: str = "default") -> List[Message]:
    """System + user chat messages of the one-token classification prompt."""
    return [
        {"role": "system", "content": "You judge NetHack messages. Answer with one word."},
        {"role": "user", "content": short_user_prompt(caption, goal)},
    ]


def ranking_user_prompt(first: str, second: str, goal: str = "default") -> str:
    """The user turn of the pairwise ranking prompt (message 1 vs message 2)."""
    goal = canonical_goal(goal)
    sentence = _GOAL_SENTENCES[goal]
    parts = [
        "I will show you two messages that NetHack printed during two moments of play.",
        "First write down what you know about NetHack and what its goal is."
        + (f" {sentence}" if sentence else ""),
        "Then analyse each message on its own, using only its text (a message may be empty) and "
        "your knowledge of the game. Then compare the two from first principles. Finally say "
        "which message is more likely to come from a player who is making progress towards the "
        "goal; answer tie when neither is.",
        f"<message_1>{_clean(first)}</message_1>\n<message_2>{_clean(second)}</message_2>",
        "Reply in exactly this format and write nothing after it:\n"
        "<knowledge>what you know about NetHack and its goal</knowledge>\n"
        "<analysis>one sentence per message and one comparing them</analysis>\n"
        "<best>1, 2 or tie</best>",
    ]
    return "\n\n".join(parts)


def ranking_messages(first: str, second: str, goal: str = "default") -> List[Message]:
    """System + user chat messages of the ranking prompt."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": ranking_user_prompt(first, second, goal)},
    ]


def render_text(messages: Sequence[Message], style: str = "plain") -> str:
    """Renders chat messages into one prompt string for ``/v1/completions``.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]``.
        style: ``"plain"`` (role-less paragraphs, then an empty answer line) or ``"llama-3"``
            (Llama-3 header/``<|eot_id|>`` layout ending with an open assistant turn, as ONI sent).
    """
    if style == "plain":
        body = "\n\n".join(m["content"] for m in messages)
        # The short prompt already ends with its answer cue; the others get one.
        return body if body.endswith(":") else body + "\n\nAnswer:\n"
    if style == "llama-3":
        out = ["<|begin_of_text|>"]
        for m in messages:
            header = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
            out.append(f"{header}{m['content']}<|eot_id|>")
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(out)
    raise ValueError(f"unknown prompt style {style!r}; choose 'plain' or 'llama-3'")


def default_text_style(model: str) -> str:
    """``'llama-3'`` when the model name says Llama-3 (ONI's rule), else ``'plain'``."""
    name = model.lower().replace("_", "-")
    return "llama-3" if ("llama-3" in name or "llama3" in name) else "plain"


_MSG_RE = re.compile(r"<message>(.*?)</message>", re.S)
_PAIR_RE = re.compile(r"<message_1>(.*?)</message_1>\s*<message_2>(.*?)</message_2>", re.S)


def extract_captions(prompt: str) -> List[str]:
    """The caption(s) a prompt asks about: ``[caption]`` or ``[first, second]`` (for test servers).

    Few-shot examples come before the judged message, so the last tagged message is the one.
    """
    pair = _PAIR_RE.findall(prompt)
    if pair:
        return list(pair[-1])
    found = _MSG_RE.findall(prompt)
    return [found[-1]] if found else []


def prompt_family(prompt: str) -> Optional[str]:
    """``'tagged'``, ``'short'`` or ``'ranking'`` for a rendered prompt; ``None`` if not ours."""
    if "<best>" in prompt:
        return "ranking"
    if "<label>" in prompt:
        return "tagged"
    if "Progress:" in prompt and "<message>" in prompt:
        return "short"
    return None
