"""ONI's TorchRL transforms: annotate captions with an LLM, turn them into an intrinsic reward.

* :class:`~torchrl_oni.annotation.LLMAnnotationTransform` (re-exported here) records the
  captions it sees in a :class:`~torchrl_oni.store.CaptionStore` and has them labelled in the
  background.
* :class:`IntrinsicRewardTransform` writes ``("next", "intrinsic_reward")`` from any reward
  source ``(messages uint8[N, 256], hashes int64[N]) -> float32[N]`` of
  :mod:`torchrl_oni.rewards`, with Motif's per-episode count decay.

Both work inside a :class:`~torchrl.envs.TransformedEnv` and on collected batches or
replay-buffer samples. The trainer (:mod:`torchrl_oni.train`) applies them to each collected
batch, which is where ONI computed its reward (at learn time, oni_spec §1.4).

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl_oni.captions import encode_messages, hash_messages
    >>> from torchrl_oni.transforms import IntrinsicRewardTransform
    >>> def kills_pay(messages, hashes):  # any (uint8[N,256], int64[N]) -> float32[N]
    ...     return torch.tensor([float(bytes(m[:8].tolist()) == b"You kill") for m in messages])
    >>> msgs = torch.from_numpy(encode_messages(["You kill the newt!", "You kill the newt!", "A wall."]))
    >>> batch = TensorDict({"message": msgs, "caption_hash": torch.from_numpy(hash_messages(msgs)),
    ...                     "msg_count": torch.tensor([1, 2, 1]),
    ...                     ("next", "reward"): torch.zeros(3, 1)}, batch_size=[3])
    >>> IntrinsicRewardTransform(kills_pay)(batch)["next", "intrinsic_reward"].squeeze(-1)
    tensor([1.0000, 0.1250, 0.0000])
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs.transforms import Transform

from torchrl_oni.annotation import LLMAnnotationTransform
from torchrl_oni.captions import (
    CAPTION_HASH_KEY,
    INTRINSIC_REWARD_KEY,
    MESSAGE_KEY,
    MESSAGE_LEN,
    MSG_COUNT_KEY,
    hash_messages,
)
from torchrl_oni.rewards.ensemble import RUNE_BONUS_KEY, RUNEBonus
from torchrl_oni.rewards.scaling import RunningMeanStd, count_scale, threshold as threshold_values
from torchrl_oni.transform_keys import KeyedTransform, KeyRole, alias_property

__all__ = ["IntrinsicRewardTransform", "LLMAnnotationTransform", "CombineRewards", "INTRINSIC_REWARD_KEY",
           "rune_transform"]

_MESSAGE_CHOICES = ("acted", "next")

RewardSource = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class IntrinsicRewardTransform(KeyedTransform, Transform):
    """Writes ``("next", "intrinsic_reward")`` = ``f(R(m)) · msg_count ** -beta``.

    ``R`` is a reward source of :mod:`torchrl_oni.rewards` (``RetrievalReward``,
    ``ClassificationReward``, ``RankingReward``, ``MotifReward``, ``BoWReward``) or any
    callable ``(messages uint8[N, 256], hashes int64[N]) -> float32[N]``. In order, the
    transform:

    1. reads the message, its hash and its per-episode count from the chosen observation;
    2. calls ``R`` once on all of them (one vectorised call per batch);
    3. optionally normalises with running statistics (``normalize=True``) and keeps only values
       above ``threshold`` (ONI-Ranking's recipe);
    4. multiplies by ``msg_count ** -beta`` (Motif's decay: 1, 1/8, 1/27... for ``beta=3``);
    5. writes a float32 tensor shaped like the env reward (``[..., 1]``), declared in the
       reward spec like TorchRL's ``RNDTransform``.

    The reward is not mixed with the env reward here: the trainer does
    ``extrinsic_coeff · clip(r) + intrinsic_coeff · intrinsic_reward``.

    **Which message pays** (``message=``):

    * ``"acted"`` (default, ONI's original): the message of the observation the action was
      taken on (the root ``message``) and its root ``msg_count``. Each episode's reset message
      is paid, a terminal message never is.
    * ``"next"``: the message the action produced (``("next", "message")`` and its count), the
      natural TorchRL reading; a death or success message is paid on the step that caused it.

    ``caption_hash`` and ``msg_count`` may be ``[*B]`` (:class:`~torchrl_oni.envs.NLEBatchEnv`)
    or ``[*B, 1]`` (``GymWrapper``-based envs). A missing hash is computed from the message; a
    missing count counts as 1 (no decay), and the transform says so once (a ``UserWarning``
    naming the fix: :class:`~torchrl_oni.envs.caption_keys.MessageCounter` before it, or
    ``beta=0`` to pay undecayed on purpose).

    Where it runs: in a ``TransformedEnv`` (single, ``SerialEnv`` or ``ParallelEnv``) the reward
    is computed at step time; called on a batch or a replay-buffer sample it is (re)computed
    from the stored observations, so labels that arrived since collection are used. A reward
    source that holds a live store (retrieval, online reward models) belongs in the trainer
    process, not in env worker processes.

    **Training and eval mode** (``normalize=True``): the running statistics are updated only in
    training mode, as TorchRL's ``RNDTransform`` does; in eval mode they normalise without
    moving. A new transform is in training mode, but TorchRL puts a transform in **eval mode**
    when it joins a ``TransformedEnv`` (or ``Compose.append``): call ``env.train()`` (or
    ``transform.train()``) for the statistics of a transform inside an env to move. On collected
    batches (``oni-train``) the transform stays in training mode.

    **Copies and processes.** The transform deep-copies and pickles with its reward source (a
    ``ParallelEnv`` factory, a collector worker, ``torch.save``); a copy computes the same
    rewards from the same batch. A :class:`~torchrl_oni.store.CaptionStore` the source reads is
    shared by a deep copy made in this process and arrives as a snapshot in another process
    (:class:`~torchrl_oni.rewards.RetrievalReward` warns there once): see "Copies and
    processes" in ``docs/design.md``. ``state_dict()`` holds the running statistics only; the
    store's labels travel in the ``state_dict()`` of the
    :class:`~torchrl_oni.annotation.LLMAnnotationTransform` that fills it.

    Args:
        reward: the reward source ``R``.

    Keyword Args:
        in_keys (list of NestedKey): the message, its caption hash and its per-episode count
            (exactly 3 keys; default ``["message", "caption_hash", "msg_count"]``), read from the
            root (``message="acted"``) or from ``"next"`` (``message="next"``).
        out_keys (list of NestedKey): the one reward entry written under ``"next"`` (default
            ``["intrinsic_reward"]``).
        message (str): ``"acted"`` or ``"next"``, see above. Default ``"acted"``.
        beta (float): count-decay exponent (3 in ONI/Motif; 0 disables the decay).
        normalize (bool): normalise ``R`` with running mean/std (updated in training mode only).
        threshold (float, optional): values at or below it become 0 (after normalisation).
        message_key, hash_key, count_key: aliases of ``in_keys[0]``, ``in_keys[1]``,
            ``in_keys[2]`` (a value that contradicts ``in_keys`` is a ``ValueError``).
        out_key (str): alias of ``out_keys[0]``.
        dedupe (bool): call ``R`` once per distinct caption hash of the batch (a rollout repeats
            a few dozen messages hundreds of times; every source here is a function of the
            message). Default True.

    Keys can be changed later with :meth:`set_keys` (roles ``message``, ``caption_hash``,
    ``msg_count``, ``intrinsic_reward``), as on TorchRL's losses.

    Example:
        >>> import torch
        >>> from torchrl.envs import TransformedEnv
        >>> from torchrl_oni.envs import NLEBatchEnv
        >>> from torchrl_oni.rewards import BoWReward, HashedWordVectors
        >>> bow = BoWReward("kill monsters, collect gold", vectors=HashedWordVectors(), threshold=0.0)
        >>> env = TransformedEnv(NLEBatchEnv("score", num_envs=2, seed=0), IntrinsicRewardTransform(bow))
        >>> td = env.rollout(4, break_when_any_done=False)
        >>> td["next", "intrinsic_reward"].shape, td["next", "intrinsic_reward"].dtype
        (torch.Size([2, 4, 1]), torch.float32)
        >>> env.close()
    """

    _IN_ROLES = (KeyRole("message", MESSAGE_KEY, "message_key"),
                 KeyRole("caption_hash", CAPTION_HASH_KEY, "hash_key"),
                 KeyRole("msg_count", MSG_COUNT_KEY, "count_key"))
    _OUT_ROLES = (KeyRole("intrinsic_reward", INTRINSIC_REWARD_KEY, "out_key"),)

    message_key = alias_property("message", "in_keys", 0, "``in_keys[0]``: the message read.")
    hash_key = alias_property("caption_hash", "in_keys", 1, "``in_keys[1]``: its caption hash.")
    count_key = alias_property("msg_count", "in_keys", 2, "``in_keys[2]``: its per-episode count.")
    out_key = alias_property("intrinsic_reward", "out_keys", 0, "``out_keys[0]``: the reward written under ``\"next\"``.")

    def __init__(
        self,
        reward: RewardSource,
        *,
        in_keys: Optional[Sequence] = None,
        out_keys: Optional[Sequence] = None,
        message: str = "acted",
        beta: float = 3.0,
        normalize: bool = False,
        threshold: Optional[float] = None,
        message_key: Optional[str] = None,
        hash_key: Optional[str] = None,
        count_key: Optional[str] = None,
        out_key: Optional[str] = None,
        dedupe: bool = True,
    ):
        if message not in _MESSAGE_CHOICES:
            raise ValueError(f"message must be 'acted' or 'next', got {message!r}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if not callable(reward):
            raise TypeError(f"reward must be callable (messages, hashes) -> rewards, got {type(reward).__name__}")
        in_keys, out_keys = self._resolve_keys(in_keys, out_keys, {
            "message_key": message_key, "hash_key": hash_key, "count_key": count_key, "out_key": out_key})
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self.reward = reward
        self.message = message
        self.beta = float(beta)
        self.normalize = bool(normalize)
        self.threshold = None if threshold is None else float(threshold)
        self.dedupe = bool(dedupe)
        self.stats = RunningMeanStd() if self.normalize else None
        self.last_raw: Optional[torch.Tensor] = None  # R(m) of the last call, before decay
        self._warned_no_count = False

    # ------------------------------------------------------------------ the computation
    def compute(
        self,
        messages: torch.Tensor,
        hashes: Optional[torch.Tensor] = None,
        msg_count: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The intrinsic reward of each message, ``float32[N]`` (flat).

        Args:
            messages: ``uint8[..., 256]``.
            hashes: ``int64[...]`` or ``[..., 1]`` (computed from the messages if ``None``).
            msg_count: per-episode counts, same layout (no decay if ``None``).
        """
        flat = messages.reshape(-1, MESSAGE_LEN)
        n = flat.shape[0]
        if hashes is None:
            hashes = torch.from_numpy(hash_messages(flat.cpu().numpy()))
        hashes = hashes.reshape(-1)
        if hashes.numel() != n:
            raise ValueError(f"{self.hash_key} has {hashes.numel()} entries for {n} messages")
        raw = self._raw_rewards(flat, hashes)
        self.last_raw = raw
        value = raw
        if self.stats is not None:
            if self.training:
                self.stats.update(value)
            value = self.stats.normalize(value).float()
        if self.threshold is not None:
            value = threshold_values(value, self.threshold)
        if msg_count is not None and self.beta != 0.0:
            counts = msg_count.reshape(-1)
            if counts.numel() != n:
                raise ValueError(f"{self.count_key} has {counts.numel()} entries for {n} messages")
            value = count_scale(value, counts.cpu(), self.beta)
        return value.float()

    def _raw_rewards(self, flat: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        n = flat.shape[0]
        if self.dedupe and n > 1:
            unique, inverse = torch.unique(hashes, return_inverse=True)
            first = torch.full((len(unique),), n, dtype=torch.int64, device=hashes.device)
            first.scatter_reduce_(0, inverse, torch.arange(n, device=hashes.device), reduce="amin")
            values = torch.as_tensor(self.reward(flat[first], unique), dtype=torch.float32).reshape(-1).cpu()
            if values.numel() != len(unique):
                raise ValueError(f"the reward source returned {values.numel()} values for {len(unique)} messages")
            return values[inverse.cpu()]
        raw = torch.as_tensor(self.reward(flat, hashes), dtype=torch.float32).reshape(-1).cpu()
        if raw.numel() != n:
            raise ValueError(f"the reward source returned {raw.numel()} values for {n} messages")
        return raw

    def _warn_no_count(self) -> None:
        # Without a count every sighting pays in full: an agent that repeats one approved caption
        # earns it at every step, which is the reward hacking the decay exists to stop. The data
        # still pass (a count of 1 is a valid reading), but silently paying is not.
        if getattr(self, "_warned_no_count", False):
            return
        self._warned_no_count = True
        warnings.warn(
            f"{type(self).__name__}: the data have no {self.count_key!r}, so every sighting of a caption "
            f"is paid in full (no msg_count ** -{self.beta:g} decay: 3 identical steps pay 3 times). "
            "Add MessageCounter before it (`from torchrl_oni import MessageCounter`; oni_transforms() "
            "includes it), or pass beta=0 to pay undecayed on purpose.",
            UserWarning, stacklevel=2)

    def _source(self, root: TensorDictBase, nxt: TensorDictBase) -> TensorDictBase:
        return root if self.message == "acted" else nxt

    def _write(self, source: TensorDictBase, target: TensorDictBase, shape_hint: Optional[torch.Size]) -> None:
        messages = source.get(self.message_key, None)
        if messages is None:
            where = "the root" if self.message == "acted" else "'next'"
            raise KeyError(f"{type(self).__name__}: no '{self.message_key}' in {where} of the tensordict "
                           f"(message={self.message!r})")
        counts = source.get(self.count_key, None)
        if counts is None and self.beta != 0.0:
            self._warn_no_count()
        value = self.compute(messages, source.get(self.hash_key, None), counts)
        device = messages.device
        if shape_hint is not None and int(torch.Size(shape_hint).numel()) == value.numel():
            shape = shape_hint
        else:
            shape = messages.shape[:-1] + (1,)
        target.set(self.out_key, value.reshape(shape).to(device))

    # ------------------------------------------------------------------ TorchRL hooks
    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        reward = next_tensordict.get("reward", None)
        self._write(self._source(tensordict, next_tensordict), next_tensordict,
                    None if reward is None else reward.shape)
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """On a collected batch or replay-buffer sample (root + ``"next"``)."""
        nxt = tensordict.get("next", None)
        if nxt is None:
            raise KeyError(f"{type(self).__name__} needs a transition with a 'next' entry")
        reward = nxt.get("reward", None)
        self._write(self._source(tensordict, nxt), nxt, None if reward is None else reward.shape)
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict  # writing to a replay buffer stores the data unchanged

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        shape, device = reward_spec.shape + (1,), reward_spec.device
        for key in reward_spec.keys(True, True):
            if key != self.out_key:
                shape, device = reward_spec[key].shape, reward_spec[key].device
                break
        reward_spec[self.out_key] = Unbounded(shape=shape, dtype=torch.float32, device=device)
        return reward_spec

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self) -> dict:
        """The running statistics travel in ``state_dict()`` (nn.Module's extra-state hook)."""
        return {"stats": self.stats.state_dict() if self.stats is not None else None}

    def set_extra_state(self, state: dict) -> None:
        if state and state.get("stats") is not None and self.stats is not None:
            self.stats.load_state_dict(state["stats"])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(reward={type(self.reward).__name__}, message={self.message!r}, "
                f"beta={self.beta:g}, normalize={self.normalize}, threshold={self.threshold})")


class CombineRewards(KeyedTransform, Transform):
    """Mixes the env reward and the intrinsic reward into the reward PPO optimises.

    ``("next", "reward") = extrinsic_coeff · clip(r_env, ±extrinsic_clip) + intrinsic_coeff · r_int``;
    the env's own reward is kept in ``("next", "extrinsic_reward")``. ONI clips the env reward to
    ±10 before the coefficient and never clips or scales the intrinsic term (``extrinsic_clip=None``
    turns clipping off). Put it after :class:`IntrinsicRewardTransform`, on collected batches or in
    a ``TransformedEnv``; ``oni-train`` applies the same mix to each batch. With
    ``streams=True`` the two weighted terms are also kept, in ``("next", "reward_ext")`` and
    ``("next", "reward_int")``, for a critic with one value head per reward stream. Applied twice
    (a ``Compose`` and a batch transform, say) it gives the same reward: the second application
    mixes from the env reward the first one kept.

    The transform has no state (``state_dict()`` is empty) and deep-copies and pickles freely.

    Args:
        extrinsic_coeff (float): the env reward's coefficient. Default 1.
        intrinsic_coeff (float): the intrinsic reward's coefficient. Default 0.
        extrinsic_clip (float, optional): the env reward is clipped to ``±extrinsic_clip`` first
            (``None``: no clipping). Default 10.
        intrinsic_key: alias of ``in_keys[1]``.
        streams (bool): also write the two weighted terms (``out_keys[2:]``).

    Keyword Args:
        in_keys (list of NestedKey): the env reward and the intrinsic reward, read under
            ``"next"`` (2 keys; default ``["reward", "intrinsic_reward"]``).
        out_keys (list of NestedKey): the mixed reward and the kept env reward, then, with
            ``streams=True``, the two weighted terms (2 keys, or 4 with ``streams``; default
            ``["reward", "extrinsic_reward"]`` + ``["reward_ext", "reward_int"]``).

    Keys can be changed later with :meth:`set_keys` (roles ``reward``, ``intrinsic_reward``,
    ``combined_reward``, ``extrinsic_reward``, and with ``streams`` ``reward_ext``, ``reward_int``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_oni.transforms import CombineRewards
        >>> batch = TensorDict({("next", "reward"): torch.tensor([[50.0], [-1.0]]),
        ...                     ("next", "intrinsic_reward"): torch.tensor([[1.0], [0.0]])}, batch_size=[2])
        >>> CombineRewards(extrinsic_coeff=0.1, intrinsic_coeff=0.4)(batch)["next", "reward"].squeeze(-1)
        tensor([ 1.4000, -0.1000])
    """

    _IN_ROLES = (KeyRole("reward", "reward", None),
                 KeyRole("intrinsic_reward", INTRINSIC_REWARD_KEY, "intrinsic_key"))
    _OUT_ROLES = (KeyRole("combined_reward", "reward", None),
                  KeyRole("extrinsic_reward", "extrinsic_reward", None))
    _STREAM_ROLES = (KeyRole("reward_ext", "reward_ext", None),
                     KeyRole("reward_int", "reward_int", None))

    intrinsic_key = alias_property("intrinsic_reward", "in_keys", 1, "``in_keys[1]``: the intrinsic reward read.")

    def __init__(self, extrinsic_coeff: float = 1.0, intrinsic_coeff: float = 0.0,
                 extrinsic_clip: Optional[float] = 10.0, intrinsic_key=None,
                 streams: bool = False, *, in_keys: Optional[Sequence] = None,
                 out_keys: Optional[Sequence] = None):
        roles = self._roles_for(bool(streams))
        in_keys, out_keys = self._resolve_keys(in_keys, out_keys, {"intrinsic_key": intrinsic_key}, roles)
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self.extrinsic_coeff = float(extrinsic_coeff)
        self.intrinsic_coeff = float(intrinsic_coeff)
        self.extrinsic_clip = extrinsic_clip
        self.streams = bool(streams)

    @classmethod
    def _roles_for(cls, streams: bool):
        return cls._IN_ROLES, cls._OUT_ROLES + (cls._STREAM_ROLES if streams else ())

    def _key_roles(self):
        return self._roles_for(self.streams)

    def mix(self, next_td: TensorDictBase) -> TensorDictBase:
        from torchrl_oni.rewards.scaling import reward_streams

        reward_key, intrinsic_key = self.in_keys
        out_key, kept_key = self.out_keys[:2]
        # a second application mixes from the env's reward it kept, not from its own mix: applying
        # CombineRewards twice (a Compose and a batch transform, say) gives the same reward
        ext = next_td.get(kept_key, None)
        if ext is None:
            ext = next_td.get(reward_key)
        intrinsic = next_td.get(intrinsic_key, None)
        if intrinsic is None or self.intrinsic_coeff == 0.0:
            intrinsic = torch.zeros_like(ext)
        ext_part, int_part = reward_streams(ext, intrinsic, self.extrinsic_coeff, self.intrinsic_coeff,
                                            self.extrinsic_clip)
        next_td.set(kept_key, ext)
        next_td.set(out_key, ext_part + int_part)
        if self.streams:
            next_td.set(self.out_keys[2], ext_part)
            next_td.set(self.out_keys[3], int_part)
        return next_td

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self.mix(next_tensordict)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        nxt = tensordict.get("next", None)
        if nxt is None:
            return self.mix(tensordict)
        self.mix(nxt)
        return tensordict

    def _reset(self, tensordict, tensordict_reset):
        return tensordict_reset

    def transform_reward_spec(self, reward_spec):
        reward_key = self.in_keys[0]
        ref = reward_spec[reward_key] if reward_key in reward_spec.keys(True, True) else None
        if ref is not None:
            for key in self.out_keys:
                if key != reward_key:
                    reward_spec[key] = ref.clone()
        return reward_spec


def rune_transform(
    ensemble,
    beta0: float = 0.05,
    decay: float = 1e-4,
    *,
    message: str = "acted",
    count_beta: float = 3.0,
    out_key: Optional[str] = None,
    in_keys: Optional[Sequence] = None,
    out_keys: Optional[Sequence] = None,
):
    """An :class:`~torchrl_oni.transforms.IntrinsicRewardTransform` writing ``("next", "rune_bonus")``.

    The bonus gets the same per-episode count decay as ONI's intrinsic reward
    (``msg_count ** -count_beta``; 0 disables it): without it, a caption the ensemble is unsure
    of would pay on every step the agent repeats it. Its :class:`RUNEBonus` is the transform's
    ``reward`` attribute (call ``transform.reward.step()`` once per iteration). ``in_keys``,
    ``out_keys`` and ``out_key`` are :class:`IntrinsicRewardTransform`'s (default output
    ``"rune_bonus"``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> msgs = torch.from_numpy(encode_messages(["You kill the newt!", "A wall."]))
        >>> td = TensorDict({"message": msgs, "caption_hash": torch.from_numpy(hash_messages(msgs)),
        ...                  "msg_count": torch.tensor([1, 2]), ("next", "reward"): torch.zeros(2, 1)}, [2])
        >>> from torchrl_oni.rewards.ensemble import ClassifierEnsemble
        >>> t = rune_transform(ClassifierEnsemble(size=3), beta0=0.05)
        >>> t(td)["next", "rune_bonus"].shape
        torch.Size([2, 1])
    """
    if out_key is None and out_keys is None:
        out_key = RUNE_BONUS_KEY
    return IntrinsicRewardTransform(RUNEBonus(ensemble, beta0, decay), message=message, beta=count_beta,
                                    in_keys=in_keys, out_keys=out_keys, out_key=out_key)
