"""ONI-Retrieval: the intrinsic reward is the LLM's own label, looked up by caption hash.

``R(m) = label(m)`` (1 helpful, 0 not) when the caption has been labelled, else 0
(oni_spec §2.1). No model, no training: the reward changes only as labels arrive in the store.

The store is duck-typed (:class:`LabelLookup`): anything with
``lookup(hashes int64[N]) -> (labels float32[N], found bool[N])``, e.g. ``CaptionStore``.

Example:
    >>> import torch
    >>> from torchrl_oni.captions import encode_messages, hash_messages
    >>> from torchrl_oni.rewards.retrieval import RetrievalReward
    >>> class DictStore:
    ...     def __init__(self, labels): self.labels = labels
    ...     def lookup(self, hashes):
    ...         found = torch.tensor([int(h) in self.labels for h in hashes])
    ...         labels = torch.tensor([self.labels.get(int(h), 0.0) for h in hashes])
    ...         return labels, found
    >>> msgs = encode_messages(["You kill the newt!", "It's a wall.", "Hello"])
    >>> hashes = torch.as_tensor(hash_messages(msgs))
    >>> store = DictStore({int(hashes[0]): 1.0, int(hashes[1]): 0.0})
    >>> RetrievalReward(store)(torch.as_tensor(msgs), hashes)
    tensor([1., 0., 0.])
"""
from __future__ import annotations

from typing import Protocol, Tuple, runtime_checkable

import torch

__all__ = ["LabelLookup", "RetrievalReward"]


@runtime_checkable
class LabelLookup(Protocol):
    """What :class:`RetrievalReward` needs from a caption store."""

    def lookup(self, hashes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``hashes int64[N]`` → ``(labels float32[N], found bool[N])``; labels of unfound rows
        are ignored."""
        ...


class RetrievalReward:
    """``R(m)`` = the stored label of ``m``'s hash; unlabelled captions get 0.

    Stateless apart from the store (which checkpoints itself), so no ``state_dict``. Thread
    safety is the store's: lookups are reads.

    Args:
        store: a :class:`LabelLookup`.
    """

    def __init__(self, store: LabelLookup):
        self.store = store

    def __call__(self, messages: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]``, before count scaling."""
        hashes = torch.as_tensor(hashes, dtype=torch.int64).reshape(-1)
        if hashes.numel() == 0:
            return torch.zeros(0, dtype=torch.float32)
        labels, found = self.store.lookup(hashes)
        labels = torch.as_tensor(labels, dtype=torch.float32).reshape(-1)
        found = torch.as_tensor(found, dtype=torch.bool, device=labels.device).reshape(-1)
        return torch.where(found, labels, torch.zeros_like(labels))
