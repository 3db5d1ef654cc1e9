"""A batch of prompts as one token tree: each distinct run of leading tokens computed once.

The embedded judge scores a request's prompts in one forward pass after their shared prefix (the
few-shot template, cached). Padded to a common width, real captions spend about a third of that
pass on pad tokens, and captions that begin alike ("You see here ...") compute their common words
once per caption. :func:`token_tree` lays a batch's suffixes (what follows the shared prefix) out
as a trie packed into a few rows. Its 4D attention mask lets each node see the shared prefix and
its own ancestors only, and its position is the one it has in its prompt, so a node's output is
the one it would have in its own prompt: a prompt's last node gives that prompt's next-token
logits. A prompt's leading tokens may come from earlier batches (``cached``, see
:mod:`._node_cache`): they sit after the prefix among the ``past_width`` columns the model is
given, and the prompt's new nodes see the ones on its path.

Example:
    >>> tree = token_tree([[5, 6, 7], [5, 6, 8], [9]], prefix_len=2, pad_id=0)
    >>> tree.input_ids.tolist()  # 5 and 6 once; nodes in prompt order, one row
    [[5, 6, 7, 8, 9]]
    >>> tree.position_ids.tolist()  # after the 2 prefix tokens, each node at its depth
    [[2, 3, 4, 4, 2]]
    >>> tree.last.tolist()  # (row, column) of each prompt's last token
    [[0, 2], [0, 3], [0, 4]]
    >>> tree.mask[0, 0, 3].int().tolist()  # node 8 sees the prefix, 5, 6 and itself
    [1, 1, 1, 1, 0, 1, 0]
    >>> tree.columns[1]  # prompt 1's tokens, in order
    [0, 1, 3]
    >>> # 5 and 6 computed before, given as past columns 0 and 1: only 7, 8 and 9 run
    >>> tree = token_tree([[5, 6, 7], [5, 6, 8], [9]], prefix_len=2, pad_id=0,
    ...                   cached=[[0, 1], [0, 1], []], past_width=2)
    >>> tree.input_ids.tolist(), tree.position_ids.tolist()
    ([[7, 8, 9]], [[4, 4, 2]])
    >>> tree.mask[0, 0, 1].int().tolist()  # node 8: the prefix, past 5 and 6, itself
    [1, 1, 1, 1, 0, 1, 0]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["TokenTree", "token_tree", "ROW_TOKENS"]

# About the most nodes a row holds: a row's attention costs its length times (prefix + length), so
# a large batch runs as several rows, of about equal length so that few pads even them out.
ROW_TOKENS = 256


@dataclass
class TokenTree:
    """One batch laid out as a packed trie.

    Attributes:
        input_ids: ``[rows, width]`` node tokens; pads (``pad_id``) fill short rows.
        position_ids: ``[rows, width]`` each node's position in its prompts (prefix length +
            depth); pads sit at the prefix length.
        mask: ``[rows, 1, width, prefix_len + past_width + width]`` bool, True where a node may
            attend: the shared prefix, its cached ancestors, its ancestors in the row and itself
            (a pad: the prefix and itself).
        last: ``[prompts, 2]`` the ``(row, column)`` of each prompt's last token.
        columns: for each prompt, the columns of its suffix's new (not cached) tokens in its
            row, in order.
        nodes: the nodes computed (the tokens of all suffixes less what they share).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    last: torch.Tensor
    columns: List[List[int]]
    nodes: int

    @property
    def rows(self) -> List[int]:
        """The row of each prompt."""
        return self.last[:, 0].tolist()


def token_tree(suffixes: Sequence[Sequence[int]], prefix_len: int, pad_id: int,
               row_tokens: int = ROW_TOKENS, cached: Optional[Sequence[Sequence[int]]] = None,
               past_width: int = 0) -> TokenTree:
    """Packs ``suffixes`` (each at least one token) into a trie of rows of about equal length, as
    few as hold the nodes at about ``row_tokens`` a row.

    Prompts are taken in sorted order so that those sharing a beginning share a row; a row is
    closed once it holds its share of the nodes (a prompt is never split across rows), so the
    pads that even out the rows' lengths stay few. ``cached[i]`` lists the past columns
    (``0 .. past_width - 1``) holding prompt i's first ``len(cached[i])`` tokens, computed
    before; at least its last token is new.
    """
    if not suffixes or any(len(s) == 0 for s in suffixes):
        raise ValueError("every prompt needs at least one token after the shared prefix")
    cached = cached if cached is not None else [()] * len(suffixes)
    if any(len(c) >= len(s) for c, s in zip(cached, suffixes)):
        raise ValueError("a prompt's last token cannot be cached: its logits are what is asked")
    order = sorted(range(len(suffixes)), key=lambda i: tuple(suffixes[i]))
    rows: List[Tuple[List[int], List[int], List[int]]] = []  # (tokens, depths, parents) per row
    columns: List[List[int]] = [[] for _ in suffixes]
    where: List[Tuple[int, int]] = [(0, 0)] * len(suffixes)
    index: Dict[Tuple[int, ...], int] = {}
    firsts: List[Tuple[int, int, int]] = []  # each row's first new nodes (their cached ancestors are set below)
    nodes = len({tuple(s[:d + 1]) for s, c in zip(suffixes, cached) for d in range(len(c), len(s))})
    share = math.ceil(nodes / math.ceil(nodes / max(row_tokens, 1)))  # each row's share of the nodes
    for i in order:
        suffix = tuple(suffixes[i])
        known = len(cached[i])
        if not rows or len(rows[-1][0]) >= share:
            rows.append(([], [], []))
            index = {}
        tokens, depths, parents = rows[-1]
        parent = -1
        for depth in range(known, len(suffix)):
            key = suffix[:depth + 1]
            col = index.get(key)
            if col is None:
                col = index[key] = len(tokens)
                tokens.append(suffix[depth])
                depths.append(depth)
                parents.append(parent)
                if parent < 0:
                    firsts.append((len(rows) - 1, col, i))
            columns[i].append(col)
            parent = col
        where[i] = (len(rows) - 1, parent)
    width = max(len(r[0]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.full((len(rows), width), prefix_len, dtype=torch.long)
    mask = torch.zeros((len(rows), 1, width, prefix_len + past_width + width), dtype=torch.bool)
    mask[..., :prefix_len] = True
    own = mask[:, 0, :, prefix_len:]  # [rows, width, past_width + width], a view
    own[:, torch.arange(width), past_width + torch.arange(width)] = True
    for r, col, i in firsts:  # a path's first new node sees the prompt's cached tokens
        own[r, col, list(cached[i])] = True
    for r, (tokens, depths, parents) in enumerate(rows):
        n = len(tokens)
        input_ids[r, :n] = torch.tensor(tokens, dtype=torch.long)
        position_ids[r, :n] = prefix_len + torch.tensor(depths, dtype=torch.long)
        for col, parent in enumerate(parents):  # parents come before their children
            if parent >= 0:
                own[r, col] |= own[r, parent]
    return TokenTree(input_ids=input_ids, position_ids=position_ids, mask=mask,
                     last=torch.tensor(where, dtype=torch.long), columns=columns,
                     nodes=sum(len(r[0]) for r in rows))
