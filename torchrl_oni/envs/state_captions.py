"""State captions: a short English description of the agent's situation, and its stable hash.

ELLM asks an LLM for goals given a text description of the state. This module writes that
text from what :class:`~torchrl_oni.envs.NLEBatchEnv` observes (``message``, ``blstats``,
``crop``; optionally NLE's ``inv_strs``) and hashes it like a caption (blake2b-64 of the UTF-8
text, a signed int64, stable across processes and runs: :func:`state_hash`).

How a caption is derived (sentences in this order; a sentence with nothing to say is left out):

=====================  ========================================  ===============================
sentence               source                                    rule
=====================  ========================================  ===============================
``Dungeon level D.``   ``blstats[NLE_BL_DEPTH]``                 depth below the surface
``You are H and U.``   ``blstats[NLE_BL_HP]``,                   H: ``healthy`` (3·hp ≥ 2·max),
                       ``blstats[NLE_BL_HPMAX]``                 ``wounded`` (3·hp ≥ max), else
                                                                 ``badly wounded``; left out when
                                                                 max ≤ 0 (after death)
                       ``blstats[NLE_BL_HUNGER]``                U: ``satiated``, ``not hungry``,
                                                                 ``hungry``, ``weak from
                                                                 hunger``, ``fainting``,
                                                                 ``fainted``, ``starved``
``Next to you: ….``    ``crop`` cells at Chebyshev distance 1    one phrase per distinct
                       from the centre (the agent)               feature, listed in a fixed order
                                                                 (dungeon features, traps,
                                                                 monsters, pets, items), at most
                                                                 ``max_features`` phrases
``Nearby: ….``         the other ``crop`` cells (C×C window,     same; includes remembered glyphs
                       9×9 by default), centre excluded          out of sight
``You carry: ….``      ``inv_strs`` when given (NLE's            the first ``max_items`` item
                       inventory strings)                        strings
``Message: M``         ``message`` (latin-1, whitespace          only with ``include_message``
                       collapsed)                                (off by default)
=====================  ========================================  ===============================

Glyph → phrase (:func:`glyph_phrases`, built once from NLE 1.3's glyph helpers): monsters
(``glyph_is_monster``, detected and ridden included) → ``"a newt"``; pets (``glyph_is_pet``)
→ ``"your kitten"`` (only with ``include_pets``); the remembered unseen monster (``glyph_is_invisible``) → ``"an unseen
monster"``; corpses (``glyph_is_body``) → ``"a newt corpse"``; objects (``glyph_is_object``)
→ their class (``"a weapon"``, ``"a potion"``, ``"gold"``...), except food, boulders and
statues, which are named (``"a food ration"``, ``"a boulder"``); statues (``glyph_is_statue``)
→ ``"a statue"``; dungeon features (``glyph_is_cmap``) → stairs, ladders, doors, doorways,
altars, fountains, sinks, thrones, graves, trees, iron bars, water, lava, ice, drawbridges;
traps (``glyph_is_trap``) → ``"a bear trap"``...; engulfing (``glyph_is_swallow``) → ``"the
inside of a monster"``. Floors, walls, corridors, dark areas, explosions, beams, warnings and
off-map cells say nothing. The agent's own cell (the centre) is skipped.

**Cost.** Captions are computed per *distinct state key*, not per step. The key of a step is a
fixed-width int32 row: the message hash (``caption_hash``, already in the batch), depth, health
bucket, hunger and the sorted, de-duplicated set of ``(feature id, adjacent?)`` tokens of its
crop; one ``numpy.unique`` over the batch's rows finds the distinct keys, and an LRU cache maps a
key to its (text, hash), so only keys never seen before are turned into text (Python).

The cost falls as a run goes on and more keys are cached (BENCHMARKS.md, "Measurements behind
design choices").

Example:
    >>> import numpy as np
    >>> from nle import nethack
    >>> from torchrl_oni.captions import encode_messages
    >>> from torchrl_oni.envs.state_captions import StateCaptioner, glyph_phrases
    >>> crop = np.full((1, 9, 9), nethack.GLYPH_CMAP_OFF + 19, np.int16)  # room floor
    >>> crop[0, 4, 5] = nethack.GLYPH_MON_OFF + 0                         # a monster east
    >>> crop[0, 1, 1] = nethack.GLYPH_CMAP_OFF + 24                       # stairs down
    >>> bl = np.zeros((1, 27), np.int64)
    >>> bl[0, nethack.NLE_BL_DEPTH], bl[0, nethack.NLE_BL_HP], bl[0, nethack.NLE_BL_HPMAX] = 1, 5, 14
    >>> bl[0, nethack.NLE_BL_HUNGER] = 1
    >>> caps = StateCaptioner(include_message=True)(encode_messages(["It's a wall."]), bl, crop)
    >>> caps.texts[0]
    "Dungeon level 1. You are wounded and not hungry. Next to you: a giant ant. Nearby: a staircase down. Message: It's a wall."
    >>> int(caps.hashes[0]) == caps.unique_hashes[0]
    True
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from torchrl_oni.captions import MESSAGE_LEN, decode_message, hash_bytes, hash_messages
from torchrl_oni.locks import OwnLockOnCopy

__all__ = [
    "STATE_HASH_KEY",
    "StateCaptioner",
    "StateCaptions",
    "glyph_phrases",
    "state_hash",
    "HUNGER_WORDS",
]

STATE_HASH_KEY = "state_hash"

HUNGER_WORDS = ("satiated", "not hungry", "hungry", "weak from hunger", "fainting", "fainted", "starved")
HEALTH_WORDS = ("healthy", "wounded", "badly wounded")

# dungeon features worth a phrase: NLE's symdef explanation -> our phrase
_CMAP_PHRASES = {
    "staircase down": "a staircase down",
    "staircase up": "a staircase up",
    "ladder down": "a ladder down",
    "ladder up": "a ladder up",
    "closed door": "a closed door",
    "open door": "an open door",
    "doorway": "a doorway",
    "altar": "an altar",
    "fountain": "a fountain",
    "sink": "a sink",
    "opulent throne": "a throne",
    "grave": "a grave",
    "tree": "a tree",
    "iron bars": "iron bars",
    "water": "water",
    "molten lava": "lava",
    "ice": "ice",
    "lowered drawbridge": "a drawbridge",
    "raised drawbridge": "a drawbridge",
}
# object classes named by their class noun (food, rocks and gold are named individually)
_CLASS_NOUNS = {
    "WEAPON_CLASS": "a weapon", "ARMOR_CLASS": "a piece of armor", "RING_CLASS": "a ring",
    "AMULET_CLASS": "an amulet", "TOOL_CLASS": "a tool", "POTION_CLASS": "a potion",
    "SCROLL_CLASS": "a scroll", "SPBOOK_CLASS": "a spellbook", "WAND_CLASS": "a wand",
    "GEM_CLASS": "a gem or stone", "BALL_CLASS": "an iron ball", "CHAIN_CLASS": "an iron chain",
    "VENOM_CLASS": "some venom", "COIN_CLASS": "gold",
}
_GROUP_ORDER = ("feature", "trap", "monster", "pet", "item")


def state_hash(text: str) -> int:
    """The stable signed 64-bit hash of a state caption (blake2b-64 of its UTF-8 bytes).

    Example:
        >>> state_hash("Dungeon level 1.") == state_hash("Dungeon level 1.")
        True
    """
    return hash_bytes(text.encode("utf-8"))


def _article(name: str) -> str:
    if not name or name[0].isupper():  # proper names: "Medusa", "Lord Surtur"
        return name
    vowel = name[0] in "aeiou" and not name.startswith(("uni", "use", "eu", "one"))
    return ("an " if vowel else "a ") + name


@dataclass(frozen=True)
class _GlyphTable:
    feature_of: np.ndarray  # int32[MAX_GLYPH + 1]: feature id per glyph, 0 = says nothing
    phrases: Tuple[str, ...]  # by feature id; phrases[0] = ""
    no_pets: np.ndarray  # int32[MAX_GLYPH + 1]: feature_of with pets mapped to 0


_TABLE: Optional[_GlyphTable] = None
_TABLE_LOCK = threading.Lock()


def _build_table() -> _GlyphTable:
    from nle import nethack as nh

    groups = {g: OrderedDict() for g in _GROUP_ORDER}  # phrase -> [glyphs] per group
    for glyph in range(nh.MAX_GLYPH):
        group, phrase = None, None
        if nh.glyph_is_pet(glyph):
            group, phrase = "pet", "your " + nh.permonst(nh.glyph_to_mon(glyph)).mname
        elif nh.glyph_is_invisible(glyph):
            group, phrase = "monster", "an unseen monster"
        elif nh.glyph_is_monster(glyph):  # normal, detected or ridden
            group, phrase = "monster", _article(nh.permonst(nh.glyph_to_mon(glyph)).mname)
        elif nh.glyph_is_body(glyph):
            mon = nh.permonst(glyph - nh.GLYPH_BODY_OFF).mname
            group, phrase = "item", _article(f"{mon} corpse")
        elif nh.glyph_is_statue(glyph):
            group, phrase = "item", "a statue"
        elif nh.glyph_is_object(glyph):
            obj = nh.objclass(nh.glyph_to_obj(glyph))
            oc_class = ord(obj.oc_class) if isinstance(obj.oc_class, str) else int(obj.oc_class)
            name = nh.OBJ_NAME(obj) or ""
            if oc_class in (nh.FOOD_CLASS, nh.ROCK_CLASS) and name:
                phrase = _article(name)
            else:
                phrase = next((p for c, p in _CLASS_NOUNS.items() if getattr(nh, c) == oc_class), None)
            group = "item" if phrase else None
        elif nh.glyph_is_swallow(glyph):
            group, phrase = "monster", "the inside of a monster"
        elif nh.glyph_is_trap(glyph):
            explanation = nh.symdef.from_idx(nh.glyph_to_cmap(glyph)).explanation
            if explanation:
                group, phrase = "trap", _article(explanation)
        elif nh.GLYPH_CMAP_OFF <= glyph < nh.GLYPH_EXPLODE_OFF:
            explanation = nh.symdef.from_idx(glyph - nh.GLYPH_CMAP_OFF).explanation
            if explanation in _CMAP_PHRASES:
                group, phrase = "feature", _CMAP_PHRASES[explanation]
        if group is not None:
            groups[group].setdefault(phrase, []).append(glyph)
    # stairs first among features: they matter most for NetHack's score and staircase tasks
    features = groups["feature"]
    stairs = [p for p in features if "stair" in p or "ladder" in p]
    groups["feature"] = OrderedDict([(p, features[p]) for p in stairs] +
                                    [(p, g) for p, g in features.items() if p not in stairs])
    feature_of = np.zeros(nh.MAX_GLYPH + 1, dtype=np.int32)  # + 1: the off-map glyph
    no_pets = feature_of.copy()
    phrases = [""]
    for group in _GROUP_ORDER:
        for phrase, glyphs in groups[group].items():
            feature_of[glyphs] = len(phrases)
            if group != "pet":
                no_pets[glyphs] = len(phrases)
            phrases.append(phrase)
    return _GlyphTable(feature_of, tuple(phrases), no_pets)


def _table() -> _GlyphTable:
    global _TABLE
    with _TABLE_LOCK:
        if _TABLE is None:
            _TABLE = _build_table()
        return _TABLE


def glyph_phrases() -> Tuple[np.ndarray, Tuple[str, ...]]:
    """``(feature_of int32[MAX_GLYPH + 1], phrases)``: glyph → feature id → phrase (0: none).

    Example:
        >>> from nle import nethack
        >>> feature_of, phrases = glyph_phrases()
        >>> phrases[feature_of[nethack.GLYPH_CMAP_OFF + 24]]
        'a staircase down'
        >>> phrases[feature_of[nethack.GLYPH_CMAP_OFF + 19]]  # floor of a room
        ''
    """
    t = _table()
    return t.feature_of, t.phrases


@dataclass
class StateCaptions:
    """Captions of a batch of states.

    Attributes:
        hashes: ``int64[*B]`` state hash per step.
        unique_hashes: the distinct state hashes of the batch (Python ints).
        texts: their captions, aligned with ``unique_hashes``.
        new_keys: how many state keys had never been captioned before (cache misses).
    """

    hashes: torch.Tensor
    unique_hashes: List[int]
    texts: List[str]
    new_keys: int = 0


class StateCaptioner(OwnLockOnCopy):
    """Writes state captions for a batch of observations, once per distinct state key.

    Args:
        include_message: end the caption with ``Message: …`` (NLE's message). Off by default:
            with it, 60 % of a random agent's steps are distinct states (1225 of 2048), without
            it 15 % (313), and each distinct state costs one LLM request. ELLM's own state
            descriptions had no message either.
        include_pets: list the agent's pets (off by default: a pet follows the agent around,
            multiplies the distinct states by 1.35 and rarely makes a goal).
        max_features: most phrases per ``Next to you`` / ``Nearby`` sentence.
        max_items: most inventory items listed (only when ``inv_strs`` is passed).
        cache_size: state keys whose caption is remembered (LRU).

    Thread-safe (one lock around the cache).
    """

    def __init__(self, *, include_message: bool = False, include_pets: bool = False,
                 max_features: int = 6, max_items: int = 5, cache_size: int = 200_000):
        self.include_message = bool(include_message)
        self.include_pets = bool(include_pets)
        self.max_features = int(max_features)
        self.max_items = int(max_items)
        self.cache_size = int(cache_size)
        self._cache: "OrderedDict[bytes, Tuple[str, int]]" = OrderedDict()
        self._lock = threading.Lock()
        self._adjacent_masks = {}
        self._lut: Optional[np.ndarray] = None

    def _copy_state(self, state: dict) -> None:
        # env workers receive a copy (a goal-conditioned policy's transform): a fresh cache
        state["_cache"] = OrderedDict()

    def _adjacent(self, c: int) -> Tuple[np.ndarray, np.ndarray]:
        """Flat (adjacent?, is centre?) masks of a C×C crop."""
        if c not in self._adjacent_masks:
            ys, xs = np.mgrid[0:c, 0:c]
            dist = np.maximum(abs(ys - c // 2), abs(xs - c // 2)).reshape(-1)
            self._adjacent_masks[c] = ((dist == 1).astype(np.int32), dist == 0)
        return self._adjacent_masks[c]

    def keys(self, message_hashes: np.ndarray, blstats: np.ndarray, crop: np.ndarray,
             inv_hashes: Optional[np.ndarray] = None) -> np.ndarray:
        """The int32 state-key rows ``[N, 6 (+2) + C·C]`` (vectorised; see the module docstring)."""
        from nle import nethack as nh

        n, c = len(blstats), crop.shape[-1]
        lut = self._token_lut()
        adjacent, centre = self._adjacent(c)
        head = 8 if inv_hashes is not None else 6
        out = np.empty((n, head + c * c), np.int32)
        # glyph -> 2·feature id (+1 when adjacent), 0 when the glyph says nothing; a glyph id out
        # of int16 range cannot occur (NLE glyphs < 6000), negative ones wrap to "nothing"
        tokens = lut[crop.reshape(n, c * c).astype(np.uint16, copy=False)]
        tokens += adjacent & (tokens > 0)
        tokens[:, centre] = 0
        tokens.sort(axis=1)
        tokens[:, 1:][tokens[:, 1:] == tokens[:, :-1]] = 0  # a set, not a multiset
        tokens.sort(axis=1)
        out[:, head:] = tokens
        if self.include_message:
            out[:, 0:2] = np.ascontiguousarray(message_hashes, dtype=np.int64).view(np.int32).reshape(n, 2)
        else:  # the message is not in the text: not in the key either
            out[:, 0:2] = 0
        hp, hpmax = blstats[:, nh.NLE_BL_HP], blstats[:, nh.NLE_BL_HPMAX]
        out[:, 2] = blstats[:, nh.NLE_BL_DEPTH]
        out[:, 3] = blstats[:, nh.NLE_BL_HUNGER]
        # health bucket: 0 healthy, 1 wounded, 2 badly wounded, 3 unknown (max <= 0)
        out[:, 4] = (3 * hp < 2 * hpmax).astype(np.int32) + (3 * hp < hpmax) + 3 * (hpmax <= 0)
        out[:, 5] = c
        if inv_hashes is not None:
            out[:, 6:8] = np.ascontiguousarray(inv_hashes, dtype=np.int64).view(np.int32).reshape(n, 2)
        return out

    def _token_lut(self) -> np.ndarray:
        """int32[65536]: uint16 glyph id → 2 · feature id (0: says nothing)."""
        if self._lut is None:
            table = _table()
            feature_of = table.feature_of if self.include_pets else table.no_pets
            lut = np.zeros(1 << 16, np.int32)
            lut[: len(feature_of)] = 2 * feature_of
            self._lut = lut
        return self._lut

    def describe(self, message: np.ndarray, blstats: np.ndarray, tokens: np.ndarray,
                 inv_strs: Optional[np.ndarray] = None) -> str:
        """One caption from one step's message bytes, blstats and sorted feature tokens."""
        from nle import nethack as nh

        _, phrases = glyph_phrases()
        parts = []
        depth = int(blstats[nh.NLE_BL_DEPTH])
        if depth > 0:
            parts.append(f"Dungeon level {depth}.")
        hp, hpmax = int(blstats[nh.NLE_BL_HP]), int(blstats[nh.NLE_BL_HPMAX])
        hunger = int(blstats[nh.NLE_BL_HUNGER])
        hunger_word = HUNGER_WORDS[hunger] if 0 <= hunger < len(HUNGER_WORDS) else None
        if hpmax > 0:
            health = HEALTH_WORDS[0 if 3 * hp >= 2 * hpmax else 1 if 3 * hp >= hpmax else 2]
            parts.append(f"You are {health} and {hunger_word}." if hunger_word else f"You are {health}.")
        elif hunger_word:
            parts.append(f"You are {hunger_word}.")
        tokens = tokens[tokens > 0]
        for adjacent_flag, title in ((1, "Next to you"), (0, "Nearby")):
            ids = tokens[(tokens & 1) == adjacent_flag] >> 1
            names = list(dict.fromkeys(phrases[i] for i in ids.tolist()))  # keeps the table order
            if names:
                parts.append(f"{title}: {', '.join(names[: self.max_features])}.")
        if inv_strs is not None:
            items = [decode_message(row).strip() for row in inv_strs]
            items = [i for i in items if i][: self.max_items]
            if items:
                parts.append(f"You carry: {'; '.join(items)}.")
        if self.include_message:
            text = " ".join(decode_message(message).split())
            if text:
                parts.append(f"Message: {text}")
        return " ".join(parts)

    def __call__(self, message, blstats, crop, message_hashes=None, inv_strs=None) -> StateCaptions:
        """Captions of a batch: ``message uint8[*B, 256]``, ``blstats int[*B, 27]``,
        ``crop int[*B, C, C]``, optional ``message_hashes int64[*B]`` (``caption_hash``; computed
        when absent) and ``inv_strs uint8[*B, I, L]``. Numpy arrays or tensors."""
        def arr(x):
            return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

        message, blstats, crop = arr(message), arr(blstats), arr(crop)
        batch_shape = blstats.shape[:-1]
        n = int(np.prod(batch_shape, dtype=np.int64))
        message = message.reshape(n, MESSAGE_LEN)
        blstats = blstats.reshape(n, blstats.shape[-1]).astype(np.int64, copy=False)
        crop = crop.reshape(n, crop.shape[-2], crop.shape[-1])
        if message_hashes is None:
            message_hashes = hash_messages(message) if self.include_message else np.zeros(n, np.int64)
        message_hashes = arr(message_hashes).reshape(n)
        inv = None
        inv_hashes = None
        if inv_strs is not None:
            inv = arr(inv_strs)
            inv = inv.reshape(n, -1, inv.shape[-1]).astype(np.uint8, copy=False)
            inv_hashes = np.fromiter((hash_bytes(row.tobytes()) for row in inv), np.int64, count=n)
        keys = self.keys(message_hashes, blstats, crop, inv_hashes)
        flat_keys = keys.view(np.dtype((np.void, keys.dtype.itemsize * keys.shape[1]))).reshape(n)
        _, first, inverse = np.unique(flat_keys, return_index=True, return_inverse=True)
        head = keys.shape[1] - crop.shape[-1] * crop.shape[-2]
        key_hashes = np.empty(len(first), dtype=np.int64)
        text_of = {}
        new = 0
        with self._lock:
            for k, row in enumerate(first.tolist()):
                key = flat_keys[row].tobytes()
                hit = self._cache.get(key)
                if hit is None:
                    text = self.describe(message[row], blstats[row], keys[row, head:],
                                         None if inv is None else inv[row])
                    hit = (text, state_hash(text))
                    self._cache[key] = hit
                    new += 1
                    if len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
                else:
                    self._cache.move_to_end(key)
                key_hashes[k] = hit[1]
                text_of.setdefault(hit[1], hit[0])
        hashes = torch.from_numpy(key_hashes[inverse.reshape(-1)].reshape(batch_shape))
        return StateCaptions(hashes, list(text_of), list(text_of.values()), new)
