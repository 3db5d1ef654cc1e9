"""ELLM's matching rule: transition captions, their similarity to goals, the threshold, and paying each
goal once per episode (:mod:`torchrl_oni.rewards.ellm` explains the rule, the rewrite of inventory
lines and how the thresholds were fitted).

* :func:`transition_sentences` / :func:`transition_caption`: NetHack's message as the sentences
  matched against goals;
* :func:`sentence_goal_similarity`: best cosine of a caption's sentences with each goal;
* :func:`calibrate_threshold` on :data:`CALIBRATION_PAIRS` gave :data:`DEFAULT_THRESHOLDS`;
* :func:`pay_once_per_episode`: ELLM's reward with each goal paid at most once per episode.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

__all__ = [
    "CALIBRATION_PAIRS",
    "DEFAULT_THRESHOLDS",
    "calibrate_threshold",
    "pay_once_per_episode",
    "sentence_goal_similarity",
    "transition_caption",
    "transition_sentences",
]


# threshold per encoder name (how they were fitted: "Threshold" in the package docstring)
DEFAULT_THRESHOLDS = {"minilm": 0.81, "hashed": 0.51}

# (transition message, goal, should the goal count as achieved?) -- our own examples
CALIBRATION_PAIRS: Tuple[Tuple[str, str, bool], ...] = (
    ("You kill the newt!", "kill the newt", True),
    ("You kill the jackal!", "kill the jackal", True),
    ("You destroy the kobold zombie!", "kill the kobold zombie", True),
    ("You kill the grid bug!", "kill the grid bug", True),
    ("You kill the sewer rat!", "attack the sewer rat", True),
    ("You kill the poor little dog!", "kill the little dog", True),
    ("$ - 41 gold pieces.", "pick up the gold", True),
    ("$ - 3 gold pieces.", "collect the gold", True),
    ("f - a food ration.", "pick up the food ration", True),
    ("g - an uncursed wand.", "pick up the wand", True),
    ("h - a bubbly potion.", "pick up the potion", True),
    ("You finish eating the food ration.", "eat the food ration", True),
    ("This newt corpse tastes terrible!", "eat the newt corpse", True),
    ("The door opens.", "open the door", True),
    ("You descend the stairs.", "descend the stairs", True),
    ("You climb down the ladder.", "go down the ladder", True),
    ("The cool draught refreshes you.", "drink from the fountain", True),
    ("Welcome to experience level 2.", "gain an experience level", True),
    ("You find a hidden passage.", "search for hidden passages", True),
    ("You miss the newt.", "kill the newt", False),
    ("The newt bites!", "kill the newt", False),
    ("You kill the newt!", "kill the jackal", False),
    ("You kill the jackal!", "pick up the gold", False),
    ("It's a wall.", "open the door", False),
    ("You see here a newt corpse.", "eat the newt corpse", False),
    ("You see here 12 gold pieces.", "kill the jackal", False),
    ("$ - 12 gold pieces.", "kill the newt", False),
    ("You hear some noises in the distance.", "explore the level", False),
    ("The door opens.", "descend the stairs", False),
    ("You are beginning to feel hungry.", "eat the food ration", False),
    ("What do you want to eat? [f or ?*]", "eat the food ration", False),
    ("There is a staircase down here.", "descend the stairs", False),
    ("There is a doorway here.", "open the door", False),
    ("This door is locked.", "open the door", False),
    ("Never mind.", "pick up the potion", False),
    ("You stop. Your kitten is in the way.", "kill the newt", False),
    ("", "explore the level", False),
    ("The jackal misses!", "kill the jackal", False),
    ("You see here a wand.", "pick up the wand", False),
    ("Welcome to experience level 2.", "kill the jackal", False),
)

_INVENTORY_LINE = re.compile(r"^[a-zA-Z$#] - (.+?)\.?$")
_INVENTORY_NOTE = re.compile(r"\s*\((?:weapon in hand|alternate weapon|in quiver|being worn|wielded|"
                             r"on left hand|on right hand|in use|lit)[^)]*\)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def transition_sentences(message: str) -> List[str]:
    """The transition's caption as sentences (see :mod:`torchrl_oni.rewards.ellm`).

    NLE joins the messages of one step ("You swap places with your kitten. You see here a newt
    corpse."); each sentence is matched against the goals on its own.

    Example:
        >>> transition_sentences("You kill the newt!  $ - 41 gold pieces.")
        ['You kill the newt!', 'You pick up 41 gold pieces.']
        >>> transition_sentences("")
        []
    """
    out = []
    for part in _SENTENCE_END.split(" ".join(message.split())):
        found = _INVENTORY_LINE.match(part)
        if found:
            part = f"You pick up {_INVENTORY_NOTE.sub('', found.group(1))}."
        if part:
            out.append(part)
    return out


def transition_caption(message: str) -> str:
    """The transition's caption as one text (its sentences joined), for display.

    Example:
        >>> transition_caption("f - a food ration.")
        'You pick up a food ration.'
    """
    return " ".join(transition_sentences(message))


def sentence_goal_similarity(encoder, sentences: Sequence[Sequence[str]], goal_vectors: torch.Tensor
                             ) -> torch.Tensor:
    """``[U, G]``: for each caption (a list of sentences), the best cosine of its sentences with
    each goal vector (``goal_vectors`` ``[G, D]``, unit rows); 0 for a caption without sentences."""
    flat = [x for caption in sentences for x in caption]
    out = torch.zeros(len(sentences), goal_vectors.shape[0])
    if not flat or goal_vectors.shape[0] == 0:
        return out
    owner = torch.repeat_interleave(torch.arange(len(sentences)), torch.tensor([len(c) for c in sentences]))
    cos = encoder.encode(flat) @ goal_vectors.T  # the encoder computes each distinct sentence once
    best = torch.full_like(out, -float("inf")).scatter_reduce_(
        0, owner.unsqueeze(1).expand_as(cos), cos, reduce="amax")
    return torch.where(torch.isinf(best), out, best)


def calibrate_threshold(encoder, pairs: Sequence[Tuple[str, str, bool]] = CALIBRATION_PAIRS
                        ) -> Tuple[float, float]:
    """``(threshold, accuracy)``: the middle of the threshold interval with the best accuracy.

    ``match = max over the message's sentences of cos(sentence, goal) > threshold``, as the
    reward computes it.

    Example:
        >>> from torchrl_oni.rewards.text import HashedSentenceEncoder
        >>> t, acc = calibrate_threshold(HashedSentenceEncoder())
        >>> round(t, 2), round(acc, 3)
        (0.51, 0.85)
    """
    goals = encoder.encode([g for _, g, _ in pairs])
    cos = torch.stack([
        sentence_goal_similarity(encoder, [transition_sentences(m)], goals[i : i + 1])[0, 0]
        for i, (m, _, _) in enumerate(pairs)
    ]).double().numpy()
    labels = np.array([y for _, _, y in pairs], dtype=bool)
    cuts = np.unique(cos)
    # candidate thresholds: just below the smallest value, and every value (match is "> t")
    candidates = np.concatenate([[cuts[0] - 1e-6], cuts])
    accuracy = np.array([((cos > t) == labels).mean() for t in candidates])
    best = int(np.argmax(accuracy))
    upper = cuts[np.searchsorted(cuts, candidates[best], side="right")] if best < len(cuts) else 1.0
    return float((candidates[best] + upper) / 2), float(accuracy[best])


def pay_once_per_episode(sims: torch.Tensor, goal_ids: torch.Tensor, threshold: float,
                         episodes: torch.Tensor, paid: Optional[Dict[int, Set[int]]] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """ELLM's reward with each goal paid at most once per episode.

    Args:
        sims: ``float[N, M]`` cosine between each step's caption and each of its state's goals.
        goal_ids: ``int[N, M]`` goal ids (``-1``: no goal in that slot).
        threshold: a goal matches when its cosine is above it.
        episodes: ``int[N]`` episode key of each step; the steps of one episode must appear in
            time order (the row-major flattening of a ``[K, T]`` batch does that).
        paid: episode key → goal ids already paid (updated in place; carry it across batches).
            ``None``: a fresh dict (no carry-over).

    Returns:
        ``(reward float32[N], paid_goal int64[N])``: the paid cosine (0 if none) and the goal that
        paid (``-1`` if none). Among the matching goals not yet paid in the episode, the one with
        the highest cosine pays and is marked paid.

    The matching is vectorised; only the (few) steps with a match are visited one by one.

    Example:
        >>> sims = torch.tensor([[0.9, 0.2], [0.95, 0.85], [0.9, 0.1]])
        >>> ids = torch.tensor([[0, 1], [0, 1], [0, 1]])
        >>> r, g = pay_once_per_episode(sims, ids, 0.8, torch.tensor([7, 7, 8]))
        >>> [round(x, 2) for x in r.tolist()], g.tolist()  # step 1: goal 0 was paid, goal 1 pays
        ([0.9, 0.85, 0.9], [0, 1, 0])
    """
    paid = {} if paid is None else paid
    n = sims.shape[0]
    reward = torch.zeros(n, dtype=torch.float32)
    which = torch.full((n,), -1, dtype=torch.int64)
    match = (sims > threshold) & (goal_ids >= 0)
    rows = torch.nonzero(match.any(1)).squeeze(1)
    if len(rows) == 0:
        return reward, which
    # per candidate step: its matches, best first (non-matches pushed to the end)
    masked = torch.where(match[rows], sims[rows].float(), torch.full_like(sims[rows].float(), -np.inf))
    order = torch.argsort(masked, dim=1, descending=True)
    cand_sims = torch.gather(masked, 1, order).tolist()
    cand_ids = torch.gather(goal_ids[rows].long(), 1, order).tolist()
    eps = episodes.reshape(-1)[rows].tolist()
    out_r, out_g = [], []
    for ep, s_row, g_row in zip(eps, cand_sims, cand_ids):
        done = paid.setdefault(ep, set())
        value, goal = 0.0, -1
        for s, g in zip(s_row, g_row):
            if s == -np.inf:
                break
            if g not in done:
                value, goal = s, g
                done.add(g)
                break
        out_r.append(value)
        out_g.append(goal)
    reward[rows] = torch.tensor(out_r, dtype=torch.float32)
    which[rows] = torch.tensor(out_g, dtype=torch.int64)
    return reward, which
