"""The observation keys ONI needs, made on any NetHack env by three TorchRL transforms.

:class:`~torchrl_oni.envs.NLEBatchEnv` writes these keys itself. A TorchRL user who starts from
``GymEnv("NetHackScore-v0")``, ``GymWrapper(gymnasium.make(...))``, a ``SerialEnv`` or a
``ParallelEnv`` gets them from the transforms of this module, in this order:

==============================  ===================  ================  ==========================
transform                       reads                writes            note
==============================  ===================  ================  ==========================
:class:`CopyAliasedObservations` every observation  the same, copied  NLE's gymnasium env reuses
                                                                       its arrays between steps
:class:`CaptionHash`            ``message``          ``caption_hash``  int64, ``message.shape[:-1]``
                                uint8[..., 256]
:class:`MessageCounter`         ``caption_hash``     ``msg_count``     int64, same shape as the
                                                                       hash; 1 on first sighting
==============================  ===================  ================  ==========================

:class:`CaptionHash` and :class:`MessageCounter` leave a key the env already writes untouched,
so the same stack serves ``NLEBatchEnv`` and a plain ``GymEnv`` (and
:func:`torchrl_oni.stack.oni_transforms` puts all three first).

Why the copy: NLE's gymnasium env writes each observation into the same numpy arrays, and
``GymEnv`` hands them to TorchRL without copying, so a rollout or a replay buffer that keeps
the step's tensors keeps the *last* observation at every step (30 steps, one distinct stored
message). Rewards computed at step time are right; anything recomputed from stored data is not.
:class:`CopyAliasedObservations` notices that the env returned the same memory twice and from
then on copies every observation it hands out (a reset is always copied: the env may alias it
with the first step).

Example:
    >>> from torchrl.envs import Compose, GymEnv, TransformedEnv
    >>> from torchrl_oni.envs.caption_keys import CaptionHash, CopyAliasedObservations, MessageCounter
    >>> env = TransformedEnv(GymEnv("NetHackScore-v0"),
    ...                      Compose(CopyAliasedObservations(), CaptionHash(), MessageCounter()))
    >>> _ = env.set_seed(0)
    >>> td = env.rollout(20)
    >>> len({bytes(m.tolist()) for m in td["next", "message"]}) > 1  # not 20 copies of the last one
    True
    >>> td["caption_hash"].shape, td["msg_count"].dtype
    (torch.Size([20]), torch.int64)
    >>> env.transform[0].aliased
    True
    >>> env.close()
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Unbounded
from torchrl.envs.transforms import Transform

from ..captions import CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN, MSG_COUNT_KEY, message_bytes
from ..transform_keys import KeyedTransform, KeyRole
from .batched import _HashCache

__all__ = ["CopyAliasedObservations", "CaptionHash", "MessageCounter"]

log = logging.getLogger(__name__)


def _storage_pointers(td: TensorDictBase) -> Dict[object, int]:
    pointers = {}
    for key, value in td.items(True, True):
        if isinstance(value, torch.Tensor) and value.numel():
            pointers[key] = value.untyped_storage().data_ptr()
    return pointers


class CopyAliasedObservations(Transform):
    """Copies the observations of an env that reuses its buffers between steps.

    Each step it compares where the env's tensors live with where they lived on the previous
    step (or reset). The first time one is the same memory, the env is marked ``aliased``
    (logged once) and every step is copied from then on; a reset is always copied. On an env
    that returns fresh tensors (``NLEBatchEnv``, ``ParallelEnv``'s outputs) it costs a pointer
    comparison per key. On collected batches and replay-buffer samples it does nothing: those
    are copies already.

    Keyword Args:
        always (bool): copy every step without waiting to see aliasing. Default False.

    Example:
        >>> from torchrl.envs import GymEnv, TransformedEnv
        >>> env = TransformedEnv(GymEnv("NetHackScore-v0"), CopyAliasedObservations())
        >>> _ = env.set_seed(0)
        >>> td = env.rollout(20)
        >>> td["next", "blstats"].unique(dim=0).shape[0] > 1  # without it: 20 copies of the last step
        True
        >>> env.transform.aliased
        True
        >>> env.close()
    """

    def __init__(self, *, always: bool = False):
        super().__init__(in_keys=[], out_keys=[])
        self.always = bool(always)
        self.aliased = False
        self._previous: Dict[object, int] = {}

    def _seen_before(self, td: TensorDictBase) -> bool:
        pointers = _storage_pointers(td)
        repeated = any(self._previous.get(key) == ptr for key, ptr in pointers.items())
        self._previous = pointers
        return repeated

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if self.aliased or self.always:  # latched: no need to look at the pointers again
            return next_tensordict.clone()
        if self._seen_before(next_tensordict):
            self.aliased = True
            log.info("the env hands out the same observation buffers at every step (NLE's gymnasium "
                     "env does): copying each step's observations")
            return next_tensordict.clone()
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        if not (self.aliased or self.always):
            self._previous = _storage_pointers(tensordict_reset)
        return tensordict_reset.clone()

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict  # a batch or a sample is already a copy

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict


class CaptionHash(KeyedTransform, Transform):
    """Adds ``caption_hash``: the stable 64-bit hash of each ``message`` (int64, one per game).

    The hash is the one the store, the rewards and :class:`~torchrl_oni.envs.NLEBatchEnv` use
    (:func:`~torchrl_oni.captions.hash_messages`), shaped like the message without its last
    dimension. If the data already hold the key (the env writes it), it is left as it is. It is
    stateless, so it also fills the key in on collected batches and replay-buffer samples (root
    and ``"next"``).

    Args:
        in_keys: the message key (default ``["message"]``, uint8[..., 256]).
        out_keys: the hash key (default ``["caption_hash"]``). ``set_keys(message=...,
            caption_hash=...)`` changes them later, as on TorchRL's losses.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_oni.captions import caption_hash, encode_messages
        >>> msgs = torch.from_numpy(encode_messages(["You kill the newt!", "Hello."]))
        >>> td = CaptionHash()(TensorDict(message=msgs, batch_size=[2]))
        >>> td["caption_hash"][0].item() == caption_hash(msgs[0].numpy())
        True
    """

    _IN_ROLES = (KeyRole("message", MESSAGE_KEY),)
    _OUT_ROLES = (KeyRole("caption_hash", CAPTION_HASH_KEY),)

    def __init__(self, in_keys=None, out_keys=None):
        in_keys, out_keys = self._resolve_keys(in_keys, out_keys, {})
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self._cache = _HashCache()

    def _hash(self, messages: torch.Tensor) -> torch.Tensor:
        if messages.dtype != torch.uint8 or messages.shape[-1:] != (MESSAGE_LEN,):
            raise ValueError(f"CaptionHash: '{self.in_keys[0]}' must be uint8[..., {MESSAGE_LEN}] NetHack "
                             f"messages, got {messages.dtype} {list(messages.shape)}")
        flat = messages.reshape(-1, MESSAGE_LEN).cpu().numpy()
        # memoised: NetHack repeats a few thousand messages (hash_messages' hash, without rehashing)
        hashes = np.fromiter((self._cache[message_bytes(row)] for row in flat), dtype=np.int64, count=len(flat))
        return torch.from_numpy(hashes).reshape(messages.shape[:-1]).to(messages.device)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        if next_tensordict.get(self.out_keys[0], None) is None:
            messages = next_tensordict.get(self.in_keys[0], None)
            if messages is None:
                raise KeyError(f"CaptionHash: no '{self.in_keys[0]}' in the observation (keys: "
                               f"{sorted(map(str, next_tensordict.keys()))}); NetHack envs call it 'message'")
            next_tensordict.set(self.out_keys[0], self._hash(messages))
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._call(tensordict_reset)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.get(self.in_keys[0], None) is not None:
            self._call(tensordict)
        nxt = tensordict.get("next", None)
        if nxt is not None and nxt.get(self.in_keys[0], None) is not None:
            self._call(nxt)
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict

    def transform_observation_spec(self, observation_spec):
        key = self.out_keys[0]
        if key not in observation_spec.keys(True, True):
            ref = observation_spec[self.in_keys[0]]
            observation_spec[key] = Unbounded(ref.shape[:-1], dtype=torch.int64, device=ref.device)
        return observation_spec


class MessageCounter(KeyedTransform, Transform):
    """Adds ``msg_count``: how often this exact caption was seen in the current episode.

    Keyed on ``caption_hash``; the reset observation counts (it gives 1), as in ONI. One table
    per game of the batch; on a partial reset (``"_reset"`` of a ``SerialEnv``/``ParallelEnv``
    or a collector) only the games being reset start again, and the others keep their count.
    The count it hands out for a game that is not reset is its own last count, never read back
    from the input (TorchRL's ``ParallelEnv`` does not always pass it). Works inside a batched
    or parallel env's workers and outside, on the batched env. If the env already writes
    ``msg_count`` (``NLEBatchEnv``), the transform leaves it.

    It needs the env: the count is a running total along each episode, kept between steps. On a
    collected batch or a replay-buffer sample (``transform(td)``, a replay buffer's transform,
    a collector's ``postproc``) there is no such history, so calling it raises, as TorchRL's
    ``StepCounter`` does; such data already holds the ``msg_count`` the env wrote.

    Args:
        in_keys: the hash key (default ``["caption_hash"]``, one int64 per game; add
            :class:`CaptionHash` before it if the env has only ``message``).
        out_keys: the count key (default ``["msg_count"]``).

    Keyword Args:
        in_key, out_key: the same, as single names (the older keywords). ``set_keys(caption_hash=...,
            msg_count=...)`` changes them later.

    Example:
        >>> from torchrl.envs import Compose, GymEnv, TransformedEnv
        >>> env = TransformedEnv(GymEnv("NetHackScore-v0"), Compose(CaptionHash(), MessageCounter()))
        >>> td = env.rollout(5)
        >>> int(td["msg_count"][0])
        1
        >>> env.close()
    """

    _IN_ROLES = (KeyRole("caption_hash", CAPTION_HASH_KEY, "in_key"),)
    _OUT_ROLES = (KeyRole("msg_count", MSG_COUNT_KEY, "out_key"),)

    def __init__(self, in_keys=None, out_keys=None, *, in_key: Optional[str] = None,
                 out_key: Optional[str] = None):
        in_keys, out_keys = self._resolve_keys(in_keys, out_keys, {"in_key": in_key, "out_key": out_key})
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self._tables: Optional[List[dict]] = None
        self._last: Optional[List[int]] = None
        self._passthrough = False

    def _hashes(self, td: TensorDictBase) -> torch.Tensor:
        hashes = td.get(self.in_keys[0], None)
        if hashes is None:
            raise KeyError(f"MessageCounter: no '{self.in_keys[0]}' in the observation; add CaptionHash() "
                           "before MessageCounter (torchrl_oni.stack.oni_transforms does)")
        games = max(int(td.batch_size.numel()), 1)
        if hashes.is_floating_point() or hashes.dtype == torch.bool or hashes.numel() != games:
            raise ValueError(f"MessageCounter counts one integer caption hash per game: '{self.in_keys[0]}' is "
                             f"{hashes.dtype} {list(hashes.shape)} for batch {list(td.batch_size)} "
                             "(give it the caption_hash key, not the message)")
        return hashes

    def _ensure(self, n: int) -> bool:
        if self._tables is None or len(self._tables) != n:
            self._tables = [dict() for _ in range(n)]
            self._last = [0] * n
            return True
        return False

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        if self._passthrough or next_tensordict.get(self.out_keys[0], None) is not None:
            self._passthrough = True  # the env counts itself
            return next_tensordict
        hashes = self._hashes(next_tensordict)
        flat = hashes.reshape(-1).tolist()
        self._ensure(len(flat))
        counts = []
        for i, h in enumerate(flat):
            n = self._tables[i].get(h, 0) + 1
            self._tables[i][h] = n
            self._last[i] = n
            counts.append(n)
        next_tensordict.set(self.out_keys[0], torch.tensor(counts, dtype=torch.int64).reshape(hashes.shape))
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        if self._passthrough or tensordict_reset.get(self.out_keys[0], None) is not None:
            self._passthrough = True
            return tensordict_reset
        hashes = self._hashes(tensordict_reset)
        flat = hashes.reshape(-1).tolist()
        first = self._ensure(len(flat))
        reset = tensordict.get("_reset", None) if tensordict is not None else None
        if reset is None or first:
            mask = [True] * len(flat)
        else:
            mask = reset.reshape(-1).tolist()
            if len(mask) != len(flat):
                raise ValueError(f"MessageCounter: '_reset' has {len(mask)} entries for {len(flat)} games")
        counts = []
        for i, h in enumerate(flat):
            if mask[i]:
                self._tables[i].clear()
                self._tables[i][h] = 1
                self._last[i] = 1
            counts.append(self._last[i])
        tensordict_reset.set(self.out_keys[0], torch.tensor(counts, dtype=torch.int64).reshape(hashes.shape))
        return tensordict_reset

    def transform_observation_spec(self, observation_spec):
        key = self.out_keys[0]
        if key not in observation_spec.keys(True, True):
            if self.in_keys[0] not in observation_spec.keys(True, True):
                raise KeyError(f"MessageCounter: the env has no '{self.in_keys[0]}' observation; add "
                               "CaptionHash() before MessageCounter (torchrl_oni.stack.oni_transforms does)")
            ref = observation_spec[self.in_keys[0]]
            observation_spec[key] = Unbounded(ref.shape, dtype=torch.int64, device=ref.device)
        return observation_spec

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        # Transform.forward would copy caption_hash into msg_count through _apply_transform:
        # a count of ~1e18 that IntrinsicRewardTransform then turns into a reward of ~0
        raise NotImplementedError(
            f"{type(self).__name__} counts captions along episodes as an env steps and cannot be "
            "applied to a batch or a replay-buffer sample; the data already holds the env's "
            f"'{self.out_keys[0]}'. Append it to the env (TransformedEnv) or drop it from this transform."
        )

    def _apply_transform(self, obs):  # not used: _call is overridden and forward refuses
        raise NotImplementedError
