"""A rule-based annotator: NetHack game knowledge written as regexes, no LLM involved.

:class:`ScriptedAnnotator` is a **fallback and test tool**, not a substitute for an LLM: it knows
a few dozen message patterns (kills, level-ups, gold, stairs, hidden passages, eating, healing,
attribute gains; death, hunger, choking, being hit) and calls everything else "no progress".
Use it to run the whole ONI pipeline without a server, to test code that needs an annotator, and
as the answer key of the fake LLM server in the tests. Its labels carry
``Provenance(annotator="scripted", ...)`` so they can never pass for LLM labels.

Each rule has a category and a weight. A caption's score is the sum of the weights of the rules
it matches whose category the goal counts; the label is 1.0 when the score is positive.
``compare`` ranks two captions by score (equal scores are a tie).

=================  =========================================================
goal               categories that count
=================  =========================================================
``default``        combat, gold, stairs, explore, wellbeing, harm
``combat``         combat, harm
``gold``           gold, harm
``stairs``         stairs, explore, harm
``zero-knowledge`` same as ``default`` (rules *are* knowledge; kept for API symmetry)
=================  =========================================================

Example:
    >>> import asyncio
    >>> from torchrl_oni.annotators.scripted import ScriptedAnnotator
    >>> ann = ScriptedAnnotator()
    >>> [l.value for l in asyncio.run(ann.annotate(["You kill the newt!", "It's a wall.", ""]))]
    [1.0, 0.0, 0.0]
    >>> ScriptedAnnotator(goal="gold").label("You kill the newt!")
    0.0
    >>> [p.value for p in asyncio.run(ann.compare([("It's a wall.", "12 gold pieces.")]))]
    [1.0]
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from torchrl_oni.annotators.base import (
    FIRST,
    SECOND,
    TIE,
    AnnotatorStats,
    Label,
    Preference,
    Provenance,
)
from torchrl_oni.annotators.prompts import canonical_goal

RULES_VERSION = "rules-v1"


@dataclass(frozen=True)
class Rule:
    """One message pattern: ``weight`` is added to the score when ``pattern`` matches."""

    name: str
    pattern: str
    category: str
    weight: float


DEFAULT_RULES: Tuple[Rule, ...] = (
    # combat
    Rule("kill", r"\bYou (?:kill|destroy|slay)\b", "combat", 2.0),
    Rule("level_up", r"\bWelcome to experience level \d+", "combat", 3.0),
    Rule("skill", r"\bYou feel more confident in your\b", "combat", 1.0),
    # gold
    Rule("gold", r"\b\d+ gold pieces?\b", "gold", 2.0),
    Rule("counting_money", r"\bsomeone counting money\b", "gold", 1.0),
    Rule("vault_guard", r"\bfootsteps of a guard on patrol\b", "gold", 1.0),
    # stairs
    Rule("stairs_down_seen", r"\b(?:staircase|ladder) down\b", "stairs", 2.0),
    Rule("descend", r"\bYou (?:climb|fly|float|go) down\b", "stairs", 3.0),
    Rule("trap_door", r"\b(?:trap door|hole) opens up under you\b", "stairs", 1.0),
    # exploration
    Rule("hidden", r"\bYou find a hidden (?:passage|door)\b", "explore", 1.0),
    # well-being
    Rule("finish_eating", r"\bYou finish eating\b", "wellbeing", 1.0),
    Rule("healed", r"\bYou feel (?:much )?better\b", "wellbeing", 1.0),
    Rule("attribute_up", r"\bYou feel (?:strong|tough|agile|smart|wise|charismatic)!",
         "wellbeing", 1.0),
    # harm: counted for every goal (a dead player makes no progress)
    Rule("death", r"\bYou die\b", "harm", -5.0),
    Rule("hungry", r"\bYou are beginning to feel (?:hungry|weak)\b|\bYou faint\b", "harm", -1.0),
    Rule("choking", r"\bhard time getting all of it down\b|\bYou choke\b", "harm", -2.0),
    Rule("hit", r"\bhits!|\bbites!|\bstings!", "harm", -1.0),
)

# Messages that are explicitly *not* progress (documentation and tests; they score 0 anyway).
NOT_PROGRESS_EXAMPLES = (
    "", "It's a wall.", "It's solid stone.", "You can't move diagonally out of an intact doorway.",
    "Never mind.", "That door is closed.", "What do you want to eat? [abc or ?*]",
    "Really attack the shopkeeper?", "You miss the jackal.", "Unknown command ' '.",
)

_GOAL_CATEGORIES = {
    "default": {"combat", "gold", "stairs", "explore", "wellbeing", "harm"},
    "zero-knowledge": {"combat", "gold", "stairs", "explore", "wellbeing", "harm"},
    "combat": {"combat", "harm"},
    "gold": {"gold", "harm"},
    "stairs": {"stairs", "explore", "harm"},
}


class ScriptedAnnotator:
    """Labels NetHack messages with hand-written game rules (no LLM; a fallback and test tool).

    Args:
        goal: ``"default"``, ``"combat"``, ``"gold"``, ``"stairs"`` or ``"zero-knowledge"``;
            decides which rule categories count (see the module docstring).
        rules: the rules to use; :data:`DEFAULT_RULES` by default.

    Example:
        >>> ann = ScriptedAnnotator(goal="stairs")
        >>> ann.score("There is a staircase down here."), ann.label("You kill the newt!")
        (2.0, 0.0)
        >>> ann.provenance.annotator
        'scripted'
    """

    def __init__(self, goal: str = "default", *, rules: Sequence[Rule] = DEFAULT_RULES) -> None:
        self.goal = canonical_goal(goal)
        categories = _GOAL_CATEGORIES[self.goal]
        self.rules = tuple(rules)
        self._active = [(re.compile(r.pattern, re.I), r.weight) for r in self.rules
                        if r.category in categories]
        self.provenance = Provenance(
            annotator="scripted", model=RULES_VERSION, prompt_version=f"{RULES_VERSION}:{self.goal}"
        )
        self.stats = AnnotatorStats()

    def score(self, caption: str) -> float:
        """Sum of the weights of the counted rules that ``caption`` matches."""
        return float(sum(w for pattern, w in self._active if pattern.search(caption or "")))

    def label(self, caption: str) -> float:
        """1.0 when the caption shows progress for the goal, else 0.0."""
        return 1.0 if self.score(caption) > 0 else 0.0

    def preference(self, first: str, second: str) -> float:
        """P(second is better): FIRST, SECOND or TIE from the two scores."""
        a, b = self.score(first), self.score(second)
        return TIE if a == b else (SECOND if b > a else FIRST)

    async def annotate(self, captions: Sequence[str]) -> List[Label]:
        """One label per caption; never fails."""
        self.stats.requests += 1
        self.stats.captions += len(captions)
        self.stats.labelled += len(captions)
        return [Label(value=self.label(c), provenance=self.provenance) for c in captions]

    async def compare(self, pairs: Sequence[Tuple[str, str]]) -> List[Preference]:
        """One preference per pair, derived from the rule scores (equal scores tie)."""
        self.stats.requests += 1
        return [Preference(value=self.preference(a, b), provenance=self.provenance)
                for a, b in pairs]

    async def aclose(self) -> None:
        """Nothing to release."""
