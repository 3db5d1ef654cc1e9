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

import logging
import warnings
from typing import Protocol, Tuple, runtime_checkable

import torch

__all__ = ["LabelLookup", "RetrievalReward", "SNAPSHOT_WARNING"]

# said once per reward, where it computes from a copy of the store that no longer follows the live one
SNAPSHOT_WARNING = (
    "{cls} reads a snapshot of the CaptionStore taken when it was copied to this process; labels that "
    "arrive later are not seen — compute the reward in the main process (outer TransformedEnv, or on "
    "the collected batch)"
)

logger = logging.getLogger(__name__)


def _silenced_by_a_blanket_filter(text: str, category=UserWarning) -> bool:
    """True when the first warning filter that matches ``text`` ignores every warning.

    TorchRL's env and collector workers run under ``warnings.filterwarnings("ignore")``
    (``torchrl.filter_warnings_subprocess``); a filter aimed at this warning is the user's choice.
    """
    for action, message, cat, module, _ in warnings.filters:
        if not issubclass(category, cat) or (message is not None and not message.match(text)):
            continue
        if module is not None and not module.match(__name__):
            continue
        return action == "ignore" and message is None and module is None and cat is Warning
    return False


def _say(text: str) -> None:
    """A ``UserWarning``, or a log record where every warning is silenced (a TorchRL worker)."""
    if _silenced_by_a_blanket_filter(text):
        logger.warning(text)
    else:
        warnings.warn(text, UserWarning, stacklevel=3)


@runtime_checkable
class LabelLookup(Protocol):
    """What :class:`RetrievalReward` needs from a caption store."""

    def lookup(self, hashes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``hashes int64[N]`` → ``(labels float32[N], found bool[N])``; labels of unfound rows
        are ignored."""
        ...


class RetrievalReward:
    """``R(m)`` = the stored label of ``m``'s hash; unlabelled captions get 0.

    Stateless apart from the store, so no ``state_dict``: the labels are saved by the store
    (``CaptionStore.save``) or in the ``state_dict()`` of the
    :class:`~torchrl_oni.annotation.LLMAnnotationTransform` that fills it, never twice. Thread
    safety is the store's: lookups are reads.

    **Copies.** A deep copy in this process reads the same live store (a
    :class:`~torchrl_oni.store.CaptionStore` deep-copies to itself). A pickled reward (a
    ``ParallelEnv`` worker, a collector worker, ``torch.save``) reads a snapshot of the store taken
    when it was pickled, and says so the first time it computes (:data:`SNAPSHOT_WARNING`; a
    ``UserWarning``, or a log record in TorchRL's workers, which silence every warning): labels
    that arrive later are not seen there.

    Args:
        store: a :class:`LabelLookup`.
    """

    def __init__(self, store: LabelLookup):
        self.store = store
        self._snapshot_warned = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_snapshot_warned"] = False  # a copy in another process says it again, once
        return state

    def __call__(self, messages: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]``, before count scaling."""
        if not self.__dict__.get("_snapshot_warned", False) and getattr(self.store, "is_snapshot", False):
            self._snapshot_warned = True
            _say(SNAPSHOT_WARNING.format(cls=type(self).__name__))
        hashes = torch.as_tensor(hashes, dtype=torch.int64).reshape(-1)
        if hashes.numel() == 0:
            return torch.zeros(0, dtype=torch.float32)
        labels, found = self.store.lookup(hashes)
        labels = torch.as_tensor(labels, dtype=torch.float32).reshape(-1)
        found = torch.as_tensor(found, dtype=torch.bool, device=labels.device).reshape(-1)
        return torch.where(found, labels, torch.zeros_like(labels))
