"""The task ids and their settings: a table without NLE, so that ``import torchrl_oni`` can tell
gymnasium every id (:func:`register_with_gymnasium`) without loading NetHack.

Each full id maps to the keyword arguments of :class:`~torchrl_oni.envs.tasks.ONITask`; the short
aliases (``score``, ``staircase-lvl3``...) are what ``oni-train --task`` shows first.

Example:
    >>> import gymnasium
    >>> import torchrl_oni  # registers every id
    >>> gymnasium.spec("NetHackStaircaseLvl3ExtendedActions-v1").kwargs
    {'name': 'NetHackStaircaseLvl3ExtendedActions-v1'}
"""
from __future__ import annotations

from typing import Dict

__all__ = ["TASKS", "TASK_ALIASES", "task_names", "resolve_task", "register_with_gymnasium"]


def _spec(extended, goal, level=2, sober=False, continual=False):
    return dict(extended_actions=extended, goal=goal, target_level=level, sober=sober, continual=continual)


TASKS: Dict[str, dict] = {
    # the paper's four (28 actions)
    "NetHackScoreExtendedActions-v1": _spec(True, "score"),
    "NetHackOracleExtendedActions-v1": _spec(True, "oracle"),
    "NetHackStaircaseLvl3ExtendedActions-v1": _spec(True, "staircase", 3),
    "NetHackStaircaseLvl4ExtendedActions-v1": _spec(True, "staircase", 4),
    # also registered by ONI
    "NetHackStaircaseExtendedActions-v1": _spec(True, "staircase", 2),
    "NetHackOracleSoberExtendedActions-v1": _spec(True, "oracle", sober=True),
    # Motif's (23 actions)
    "NetHackScore-v1": _spec(False, "score"),
    "NetHackStaircase-v1": _spec(False, "staircase", 2),
    "NetHackStaircaseLvl3-v1": _spec(False, "staircase", 3),
    "NetHackStaircaseLvl4-v1": _spec(False, "staircase", 4),
    "NetHackOracle-v1": _spec(False, "oracle"),
    "NetHackOracleSober-v1": _spec(False, "oracle", sober=True),
    "NetHackStaircaseContinual-v1": _spec(False, "staircase", 2, continual=True),
    "NetHackStaircaseLvl3Continual-v1": _spec(False, "staircase", 3, continual=True),
    "NetHackStaircaseLvl4Continual-v1": _spec(False, "staircase", 4, continual=True),
}

TASK_ALIASES = {
    "score": "NetHackScoreExtendedActions-v1",
    "oracle": "NetHackOracleExtendedActions-v1",
    "oracle-sober": "NetHackOracleSoberExtendedActions-v1",
    "staircase": "NetHackStaircaseExtendedActions-v1",
    "staircase-lvl3": "NetHackStaircaseLvl3ExtendedActions-v1",
    "staircase-lvl4": "NetHackStaircaseLvl4ExtendedActions-v1",
}


def task_names() -> list:
    """Every accepted task name: the short aliases, then the full ids."""
    return list(TASK_ALIASES) + list(TASKS)


def resolve_task(name: str) -> str:
    """Short alias or full id → full id; ``ValueError`` with the valid names otherwise.

    Example:
        >>> resolve_task("staircase-lvl3")
        'NetHackStaircaseLvl3ExtendedActions-v1'
    """
    if name in TASKS:
        return name
    key = name.strip().lower().replace("_", "-")
    if key in TASK_ALIASES:
        return TASK_ALIASES[key]
    for full in TASKS:  # case-insensitive full ids
        if full.lower() == name.strip().lower():
            return full
    raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(task_names())}")


def register_with_gymnasium() -> None:
    """Registers every full id with gymnasium (``gymnasium.make(id)``); ids already there are left
    as they are. The entry point loads NetHack only when an env is made."""
    import gymnasium

    for task_id in TASKS:
        if task_id not in gymnasium.registry:
            gymnasium.register(task_id, entry_point="torchrl_oni.envs.tasks:make_task", kwargs={"name": task_id})
