"""Keys and values of prompt tokens computed in earlier batches, kept as a trie under one root.

The embedded judge sees thousands of captions that begin alike ("You see here ...", "The newt
bites!"). Within a batch the token tree (:mod:`._token_tree`) computes a common beginning once;
this cache carries the tokens it computed over to later batches, so a caption whose beginning
was seen before computes only what is new. A token's keys and values depend on every token
before it, so a node is identified by its whole path from the root (the prompt template, which
every prompt of a judge shares): the same path gives the same numbers.

Nodes are stored in per-layer ``[kv_heads, capacity, head_dim]`` tensors, allocated at the first
store. When full, the least recently used nodes go first, deepest first among equals: a walk
touches every node on its path, so a node is never used later than its parent and the trie never
loses a node's parent before the node.

Example:
    >>> import torch
    >>> cache = NodeCache(capacity=4)
    >>> cache.reset(root=(1, 2))
    >>> cache.walk([7, 8, 9], limit=2)  # nothing stored yet
    []
    >>> layer = (torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))   # [heads, nodes, dim]
    >>> cache.store([(-1, 7), (-2, 8), (-3, 9)], [layer])  # 7 under the root, 8 under 7, 9 under 8
    [0, 1, 2]
    >>> cache.walk([7, 8, 9], limit=2), cache.walk([7, 5], limit=1)
    ([0, 1], [0])
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["NodeCache", "DEFAULT_NODE_CACHE_MB"]

# The cache's size when the engine is not told: about 21k tokens of Qwen2.5-0.5B in bfloat16
# (12 kB a token), which holds the beginnings of the captions of a long run.
DEFAULT_NODE_CACHE_MB = 256


class NodeCache:
    """A bounded trie of computed tokens below ``root``, with their keys and values.

    Args:
        capacity: the most tokens kept.

    Attributes:
        root: the token ids every cached path continues (``None`` until :meth:`reset`).
        ending: the token ids every prompt under ``root`` ends with (the template after the
            caption), as its user last found them; not stored, since they follow each caption once.
        hits: tokens taken from the cache instead of being computed.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.root: Optional[Tuple[int, ...]] = None
        self.ending: Tuple[int, ...] = ()  # the template's tokens after the caption, once a batch showed them
        self.hits = 0
        self._tensors: Optional[List[Tuple[Any, Any]]] = None
        self._children: Dict[Tuple[int, int], int] = {}
        self._parent = np.full(self.capacity, -1, np.int64)
        self._token = np.zeros(self.capacity, np.int64)
        self._depth = np.zeros(self.capacity, np.int64)
        # the batch that last walked or stored each slot; -1: free
        self._used = np.full(self.capacity, -1, np.int64)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._clock = 0  # the current batch: walks and the store that ends it share it

    def __len__(self) -> int:
        return self.capacity - len(self._free)

    def reset(self, root: Sequence[int]) -> None:
        """Forgets every node and roots the trie at ``root``."""
        self.root = tuple(root)
        self.ending = ()
        self._children.clear()
        self._used[:] = -1
        self._free = list(range(self.capacity - 1, -1, -1))

    def walk(self, suffix: Sequence[int], limit: int) -> List[int]:
        """The slots of the longest run of ``suffix``'s leading tokens held (at most ``limit``);
        they are kept at least until this batch's :meth:`store`."""
        slots: List[int] = []
        node = -1
        children = self._children
        for token in suffix[:limit]:
            node = children.get((node, int(token)), -1)
            if node < 0:
                break
            slots.append(node)
        if slots:
            self._used[slots] = self._clock
            self.hits += len(slots)
        return slots

    def gather(self, slots: Sequence[int]) -> List[Tuple[Any, Any]]:
        """Per layer, ``(keys, values)`` of ``slots`` as ``[1, heads, len(slots), dim]``."""
        import torch

        index = torch.as_tensor(list(slots), dtype=torch.long)
        return [(k[:, index][None], v[:, index][None]) for k, v in self._tensors]

    def store(self, nodes: Sequence[Tuple[int, int]], kv: Sequence[Tuple[Any, Any]]) -> List[int]:
        """Stores new nodes and ends the batch: ``nodes[j] = (parent, token)`` where ``parent`` is
        a slot this batch's :meth:`walk` returned, ``-1`` for the root, or ``-2 - i`` for
        ``nodes[i]`` (an earlier node of the same call); ``kv`` holds per layer their ``(keys,
        values)`` as ``[heads, len(nodes), dim]``. Returns the slots (``-1`` for a node not kept:
        its parent was not kept, or the cache is full of this batch's nodes)."""
        import torch

        if self._tensors is None and nodes:
            self._tensors = [(torch.empty((k.shape[0], self.capacity, k.shape[2]), dtype=k.dtype),
                              torch.empty((v.shape[0], self.capacity, v.shape[2]), dtype=v.dtype)) for k, v in kv]
        if len(self._free) < len(nodes):
            self._evict(len(nodes) - len(self._free) + self.capacity // 8)
        slots: List[int] = []
        taken, source = [], []
        for parent, token in nodes:
            if parent <= -2:
                parent = slots[-2 - parent]
                if parent < 0:
                    slots.append(-1)
                    continue
            key = (parent, int(token))
            held = self._children.get(key, -1)
            if held >= 0 or not self._free:
                slots.append(held)
                continue
            slot = self._free.pop()
            self._children[key] = slot
            self._parent[slot] = parent
            self._token[slot] = token
            self._depth[slot] = 0 if parent < 0 else self._depth[parent] + 1
            self._used[slot] = self._clock
            slots.append(slot)
            taken.append(slot)
            source.append(len(slots) - 1)
        if taken:
            dest = torch.as_tensor(taken, dtype=torch.long)
            src = torch.as_tensor(source, dtype=torch.long)
            for (k_store, v_store), (k, v) in zip(self._tensors, kv):
                k_store[:, dest] = k[:, src]
                v_store[:, dest] = v[:, src]
        self._clock += 1
        return slots

    def _evict(self, count: int) -> None:
        """Frees up to ``count`` slots not used by this batch, least recently used first and
        deepest first among equals (children before parents)."""
        old = np.flatnonzero((self._used >= 0) & (self._used < self._clock))
        if old.size == 0:
            return
        order = old[np.lexsort((-self._depth[old], self._used[old]))][:count]
        gone = set(order.tolist())
        # a node whose parent goes could never be reached again: it goes too (an old node's
        # children are older still, so they are in ``old``)
        for s in old[np.argsort(self._depth[old], kind="stable")]:
            if int(self._parent[s]) in gone:
                gone.add(int(s))
        for s in gone:
            del self._children[(int(self._parent[s]), int(self._token[s]))]
            self._used[s] = -1
            self._free.append(s)
