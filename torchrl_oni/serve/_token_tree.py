"""A batch of prompts as one token tree: each distinct run of leading tokens computed once.

The embedded judge scores a request's prompts in one forward pass after their shared prefix (the
few-shot template, cached). Padded to a common width, real captions spend about a third of that
pass on pad tokens, and captions that begin alike ("You see here ...") compute their common words
once per caption. :func:`token_tree` lays a batch's suffixes (what follows the shared prefix) out
as a trie packed into a few rows. Its 4D attention mask lets each node see the shared prefix and
its own ancestors only, and its position is the one it has in its prompt, so a node's output is
the one it would have in its own prompt: a prompt's last node gives that prompt's next-token
logits.

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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["TokenTree", "token_tree", "ROW_TOKENS"]

# A row's attention costs its length times (prefix + length); past a few hundred nodes, more
# rows cost less attention than the pad tokens that even out their lengths.
ROW_TOKENS = 256


@dataclass
class TokenTree:
    """One batch laid out as a packed trie.

    Attributes:
        input_ids: ``[rows, width]`` node tokens; pads (``pad_id``) fill short rows.
        position_ids: ``[rows, width]`` each node's position in its prompts (prefix length +
            depth); pads sit at the prefix length.
        mask: ``[rows, 1, width, prefix_len + width]`` bool, True where a node may attend: the
            shared prefix, its ancestors and itself (a pad: the prefix and itself).
        last: ``[prompts, 2]`` the ``(row, column)`` of each prompt's last token.
        columns: for each prompt, the columns of its suffix's tokens in its row, in order.
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
               row_tokens: int = ROW_TOKENS) -> TokenTree:
    """Packs ``suffixes`` (each at least one token) into a trie of at most about ``row_tokens``
    nodes a row.

    Prompts are taken in sorted order so that those sharing a beginning share a row; a row is
    closed when the next prompt's new nodes would take it past ``row_tokens`` (a prompt is never
    split across rows).
    """
    if not suffixes or any(len(s) == 0 for s in suffixes):
        raise ValueError("every prompt needs at least one token after the shared prefix")
    order = sorted(range(len(suffixes)), key=lambda i: tuple(suffixes[i]))
    rows: List[Tuple[List[int], List[int], List[int]]] = []  # (tokens, depths, parents) per row
    columns: List[List[int]] = [[] for _ in suffixes]
    where: List[Tuple[int, int]] = [(0, 0)] * len(suffixes)
    index: Dict[Tuple[int, ...], int] = {}
    for i in order:
        suffix = tuple(suffixes[i])
        new = len(suffix) - _known(index, suffix)
        if not rows or (len(rows[-1][0]) + new > row_tokens and rows[-1][0]):
            rows.append(([], [], []))
            index = {}
        tokens, depths, parents = rows[-1]
        parent = -1
        for depth in range(len(suffix)):
            key = suffix[:depth + 1]
            col = index.get(key)
            if col is None:
                col = index[key] = len(tokens)
                tokens.append(suffix[depth])
                depths.append(depth)
                parents.append(parent)
            columns[i].append(col)
            parent = col
        where[i] = (len(rows) - 1, parent)
    width = max(len(r[0]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.full((len(rows), width), prefix_len, dtype=torch.long)
    mask = torch.zeros((len(rows), 1, width, prefix_len + width), dtype=torch.bool)
    mask[..., :prefix_len] = True
    own = mask[:, 0, :, prefix_len:]  # [rows, width, width], a view
    own[:, torch.arange(width), torch.arange(width)] = True
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


def _known(index: Dict[Tuple[int, ...], int], suffix: Tuple[int, ...]) -> int:
    """How many of ``suffix``'s leading tokens the row's trie already holds."""
    n = 0
    while n < len(suffix) and suffix[:n + 1] in index:
        n += 1
    return n
