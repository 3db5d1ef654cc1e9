"""Components registered by name: the small table behind ``--backend`` and ``--annotator``.

A :class:`Registry` maps a flag's values to entries (any object with a ``name``); the flag's
choices are its names, and the code that uses a component asks the entry, never the name.

Example:
    >>> from collections import namedtuple
    >>> Entry = namedtuple("Entry", "name help")
    >>> shapes = Registry("--shape")
    >>> _ = shapes.register(Entry("circle", "round")); _ = shapes.register(Entry("square", "four sides"))
    >>> shapes.names(), shapes.get("circle").help
    (('circle', 'square'), 'round')
    >>> shapes.get("cube")
    Traceback (most recent call last):
    ...
    ValueError: unknown --shape 'cube' (circle or square)
"""
from __future__ import annotations

from typing import Dict, Generic, Tuple, TypeVar

__all__ = ["Registry"]

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """Entries by name, in registration order; ``flag`` names the setting in error messages."""

    def __init__(self, flag: str):
        self.flag = flag
        self.entries: Dict[str, Entry] = {}

    def register(self, entry: Entry, *, replace: bool = False) -> Entry:
        """Adds ``entry`` under ``entry.name`` (``replace=True`` to override an existing one)."""
        if entry.name in self.entries and not replace:
            raise ValueError(f"{self.flag} {entry.name!r} is already registered")
        self.entries[entry.name] = entry
        return entry

    def names(self) -> Tuple[str, ...]:
        return tuple(self.entries)

    def get(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            names = list(self.entries)
            either = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            raise ValueError(f"unknown {self.flag} {name!r} ({either})") from None
