"""BALROG's progression metric for NetHack: how far an episode got, as the share of human games that
reached as far and went on to ascend.

BALROG (github.com/balrog-ai/BALROG) scores an NLE episode by the largest of
P(a human game ascends | it reached dungeon level d) and P(it ascends | it reached experience
level x) over the levels the episode reached, both estimated from human games. Its numbers ship
here as data, ``torchrl_oni/data/balrog_progression.json``, whose ``source`` field names the
repository, file and commit they were read from; this module only looks them up, so our
evaluations read beside BALROG's NetHack leaderboard (which prints the mean in %).

How a level is looked up (BALROG's rule, ``progress.py``):

* dungeon level 1 and experience level 1 count 0: every game starts there;
* a level the table lacks counts 0, as BALROG skips every level it has no entry for: dungeon
  levels above 50, experience levels above 30 (NetHack's highest) and anything below 1;
* both tables never decrease with the level, so the largest value over the levels an episode went
  through is the value of its deepest dungeon level and of its highest experience level.

BALROG sees every level an episode passes through, we see only its deepest: a game that went below
level 50 gets only what its experience level gives here, a lower bound of BALROG's value (which
also counts the levels up to 50 it passed on the way down). The data's ascension entry (100 %) is
not looked up by BALROG's code either: an episode that ascends is rated by its levels like any
other.

Example:
    >>> from torchrl_oni.progression import progression
    >>> progression(1, 1)  # where every game starts
    0.0
    >>> round(100 * progression(max_dlvl=5, xlvl=1), 2)  # of human games reaching level 5, 2.65 % ascended
    2.65
    >>> round(100 * progression(max_dlvl=2, xlvl=10), 2)  # experience level 10 counts more than dungeon level 2
    17.91
    >>> progression(60, 1)  # beyond the table: counts 0, as in BALROG
    0.0
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Dict

__all__ = ["TABLE_FILE", "progression", "progression_table"]

TABLE_FILE = Path(__file__).resolve().parent / "data" / "balrog_progression.json"


@functools.lru_cache(maxsize=1)
def progression_table() -> dict:
    """The table, read once: ``{"dungeon_level": {level: p}, "experience_level": {level: p},
    "source": {...}}`` with int levels and p in [0, 1].

    Example:
        >>> t = progression_table()
        >>> min(t["dungeon_level"]), max(t["dungeon_level"]), max(t["experience_level"])
        (1, 50, 30)
        >>> t["source"]["repository"]
        'https://github.com/balrog-ai/BALROG'
    """
    raw = json.loads(TABLE_FILE.read_text(encoding="utf-8"))

    def levels(name: str) -> Dict[int, float]:
        return {int(level): float(p) for level, p in raw[name].items()}

    return {"dungeon_level": levels("dungeon_level"), "experience_level": levels("experience_level"),
            "source": dict(raw["source"])}


def progression(max_dlvl: int, xlvl: int) -> float:
    """BALROG's progression of an episode whose deepest dungeon level was ``max_dlvl`` and highest
    experience level ``xlvl``: a share in [0, 1] (a level the table lacks counts 0).

    Example:
        >>> round(progression(10, 6), 4), round(progression(3, 14), 4)
        (0.1256, 0.494)
    """
    table = progression_table()
    return max(table["dungeon_level"].get(int(max_dlvl), 0.0), table["experience_level"].get(int(xlvl), 0.0))
