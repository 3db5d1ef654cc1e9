"""ScreenSnapshots: the game screen a caption appeared on, for the captions shown to people.

A caption alone can be ambiguous ("You hear some noises." — where? after what?); the 24×80
terminal the player saw settles it. The caption store keeps no screens (3.8 kB each, for
millions of captions), so this small side table does, for a bounded number of captions:

==========  ===================  =================================================================
field       dtype / shape        meaning
==========  ===================  =================================================================
``hash``    int64                the caption hash (:func:`torchrl_oni.captions.caption_hash`)
``chars``   uint8[24, 80]        NLE's ``tty_chars`` when the caption was first offered
``colors``  uint8[24, 80]        NLE's ``tty_colors`` (0–15, curses colour numbers)
``pinned``  bool                 shown to a person: never evicted until unpinned
==========  ===================  =================================================================

:meth:`ScreenSnapshots.offer` keeps the first screen of each caption it has not got; when the
table is full the oldest *unpinned* screen makes room. The labelling page pins the captions it
is about to show, so the screens people need stay. Saved with :func:`torch.save` (tensors only,
read back with ``weights_only=True``) through :func:`torchrl_oni.atomic.atomic_write`.

Example:
    >>> import numpy as np
    >>> from torchrl_oni.feedback.screens import ScreenSnapshots
    >>> snaps = ScreenSnapshots(capacity=2)
    >>> screen = np.full((24, 80), ord(" "), np.uint8); screen[0, :5] = np.frombuffer(b"Hello", np.uint8)
    >>> colors = np.full((24, 80), 7, np.uint8)
    >>> snaps.offer([11, 12, 13], np.stack([screen] * 3), np.stack([colors] * 3))   # 11 is evicted
    3
    >>> 11 in snaps, 13 in snaps, len(snaps)
    (False, True, 2)
    >>> snaps.text(13).splitlines()[0]
    'Hello'
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Optional, Tuple, Union

import numpy as np
import torch

from torchrl_oni.atomic import UnreadableFileError, atomic_write, safe_torch_load

__all__ = ["ScreenSnapshots", "ROWS", "COLS"]

ROWS, COLS = 24, 80
_FORMAT = "torchrl_oni.ScreenSnapshots"
_VERSION = 1


def _hashes(hashes) -> np.ndarray:
    if isinstance(hashes, torch.Tensor):
        hashes = hashes.detach().cpu().numpy()
    return np.asarray(hashes, dtype=np.int64).reshape(-1)


def _screens(x, n: int, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.shape != (n, ROWS, COLS):
        raise ValueError(f"{name} must be [{n}, {ROWS}, {COLS}], got shape {tuple(x.shape)}")
    # tty_colors is int8 in NLE; colours are 0..15
    return np.clip(x, 0, 255).astype(np.uint8) if x.dtype != np.uint8 else x


class ScreenSnapshots:
    """A bounded map ``caption hash -> (chars uint8[24,80], colors uint8[24,80])``. Thread-safe.

    Args:
        capacity (int): most screens kept (3,840 bytes each). Default 4096 (15 MB).
    """

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._screens: "OrderedDict[int, Tuple[np.ndarray, np.ndarray]]" = OrderedDict()
        self._pinned: set = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._screens)

    def __contains__(self, caption_hash) -> bool:
        return int(caption_hash) in self._screens

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={len(self)}, capacity={self.capacity}, pinned={len(self._pinned)})"

    def offer(self, hashes, chars, colors) -> int:
        """Keeps the screens of captions not in the table yet; returns how many were added.

        Args:
            hashes: ``int64[N]`` caption hashes (e.g. those ``CaptionStore.add`` found new).
            chars, colors: ``[N, 24, 80]`` NLE ``tty_chars`` / ``tty_colors`` of the same steps.
        """
        hashes = _hashes(hashes)
        chars = _screens(chars, len(hashes), "chars")
        colors = _screens(colors, len(hashes), "colors")
        added = 0
        with self._lock:
            for i, h in enumerate(hashes.tolist()):
                if h in self._screens:
                    continue
                if len(self._screens) >= self.capacity and not self._evict_one():
                    break  # every screen is pinned: keep those people are looking at
                self._screens[h] = (chars[i].copy(), colors[i].copy())
                added += 1
        return added

    def _evict_one(self) -> bool:
        for h in self._screens:  # insertion order: oldest first
            if h not in self._pinned:
                del self._screens[h]
                return True
        return False

    def get(self, caption_hash) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """``(chars, colors)`` copies, or ``None`` when no screen was kept."""
        with self._lock:
            found = self._screens.get(int(caption_hash))
            return None if found is None else (found[0].copy(), found[1].copy())

    def text(self, caption_hash) -> Optional[str]:
        """The screen as 24 lines of text (latin-1, trailing spaces removed), or ``None``."""
        found = self.get(caption_hash)
        if found is None:
            return None
        return "\n".join(bytes(row).decode("latin-1").rstrip() for row in found[0])

    def pin(self, hashes: Iterable[int]) -> None:
        """Protects these screens from eviction (captions being shown to a person)."""
        with self._lock:
            self._pinned.update(int(h) for h in _hashes(list(hashes)))

    def unpin(self, hashes: Iterable[int]) -> None:
        with self._lock:
            self._pinned.difference_update(int(h) for h in _hashes(list(hashes)))

    # ------------------------------------------------------------------ persistence
    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Writes the table to one file, atomically (tensors only: loads with ``weights_only``)."""
        with self._lock:
            keys = list(self._screens)
            n = len(keys)
            chars = np.zeros((n, ROWS, COLS), np.uint8)
            colors = np.zeros((n, ROWS, COLS), np.uint8)
            for i, h in enumerate(keys):
                chars[i], colors[i] = self._screens[h]
            pinned = np.array([h in self._pinned for h in keys], dtype=bool)
        data = {
            "format": _FORMAT,
            "version": _VERSION,
            "capacity": self.capacity,
            "hashes": torch.as_tensor(np.array(keys, dtype=np.int64)),
            "chars": torch.from_numpy(chars),
            "colors": torch.from_numpy(colors),
            "pinned": torch.from_numpy(pinned),
        }
        return atomic_write(path, lambda f: torch.save(data, f))

    @classmethod
    def load(cls, path: Union[str, os.PathLike], capacity: Optional[int] = None) -> "ScreenSnapshots":
        """Reads a table written by :meth:`save` (``capacity`` overrides the saved one)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no ScreenSnapshots file at {path}")
        data = safe_torch_load(path, what="ScreenSnapshots file")  # one-line UnreadableFileError
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise UnreadableFileError(f"{path} is not a ScreenSnapshots file")
        if data.get("version") != _VERSION:
            raise UnreadableFileError(f"{path}: unsupported ScreenSnapshots version {data.get('version')}")
        try:
            snaps = cls(capacity or int(data["capacity"]))
            hashes = data["hashes"].numpy().reshape(-1)
            chars, colors, pinned = data["chars"].numpy(), data["colors"].numpy(), data["pinned"].numpy()
            n = len(hashes)
            if chars.shape != (n, ROWS, COLS) or colors.shape != (n, ROWS, COLS) or pinned.shape != (n,):
                raise ValueError("arrays of other shapes")
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise UnreadableFileError(f"{path} is a damaged ScreenSnapshots file ({err})") from None
        keep = slice(max(len(hashes) - snaps.capacity, 0), None)  # the newest, if capacity shrank
        for h, c, k, p in zip(hashes[keep].tolist(), chars[keep], colors[keep], pinned[keep]):
            snaps._screens[h] = (c.copy(), k.copy())
            if p:
                snaps._pinned.add(h)
        return snaps
