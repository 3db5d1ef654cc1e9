"""ONI in one call: the transform stack a TorchRL user appends to a NetHack env.

:func:`oni_transforms` returns an :class:`ONITransforms` (a TorchRL ``Compose``) of, in order:

=====================================================  ============================================
transform                                              what it adds
=====================================================  ============================================
:class:`~torchrl_oni.envs.caption_keys.CopyAliasedObservations`  copies of observations the env
                                                       hands out in reused buffers (NLE's gym env)
:class:`~torchrl_oni.envs.caption_keys.CaptionHash`    ``caption_hash`` (int64), unless the env has it
:class:`~torchrl_oni.envs.caption_keys.MessageCounter`  ``msg_count`` (int64), unless the env has it
:class:`~torchrl_oni.annotation.LLMAnnotationTransform`  nothing: new captions go to the annotator in
                                                       a background thread, labels to ``store``
:class:`~torchrl_oni.transforms.IntrinsicRewardTransform`  ``("next", "intrinsic_reward")`` float32
:class:`~torchrl_oni.transforms.CombineRewards`        (with ``intrinsic_coeff``) ``("next", "reward")``
                                                       = mix, the env's reward kept in
                                                       ``("next", "extrinsic_reward")``
=====================================================  ============================================

It works on ``GymEnv("NetHackScore-v0")``, ``GymWrapper(gymnasium.make(<a torchrl_oni id>))``,
``SerialEnv``/``ParallelEnv`` of those, and :class:`~torchrl_oni.envs.NLEBatchEnv`.

**Where it runs.** Append it to the env in the process that owns the store: a single env, or
the outer ``TransformedEnv`` around a ``SerialEnv``/``ParallelEnv`` (the workers step the
games; counting, annotation and the reward run in the main process), or the env of a
single-process collector. The annotation transform owns a background thread and refuses to be
copied into another process, so a stack put inside a ``ParallelEnv`` factory or a
multi-process collector's env factory fails at once with an error naming this fix.

**Lifecycle.** ``env.close()`` closes the stack (and stops the annotation thread);
:meth:`ONITransforms.wait_idle` waits for pending labels. The store, the annotation transform
and the reward transform are attributes (``stack.store``, ``stack.annotate``,
``stack.intrinsic``).

Example:
    >>> from torchrl.envs import GymEnv, TransformedEnv
    >>> from torchrl_oni.annotators import ScriptedAnnotator
    >>> from torchrl_oni.stack import oni_transforms
    >>> oni = oni_transforms(annotator=ScriptedAnnotator(), intrinsic_coeff=0.1)
    >>> env = TransformedEnv(GymEnv("NetHackScore-v0"), oni)
    >>> _ = env.set_seed(0)
    >>> td = env.rollout(50)
    >>> sorted(k for k in td["next"].keys() if "reward" in k)
    ['extrinsic_reward', 'intrinsic_reward', 'reward']
    >>> oni.wait_idle(timeout=30)
    True
    >>> len(oni.store) > 0
    True
    >>> env.close()
"""
from __future__ import annotations

from typing import Optional

from torchrl.envs.transforms import Compose

from .annotation import LLMAnnotationTransform
from .annotators.base import Annotator
from .envs.caption_keys import CaptionHash, CopyAliasedObservations, MessageCounter
from .rewards.retrieval import RetrievalReward
from .store import CaptionStore
from .transforms import CombineRewards, IntrinsicRewardTransform, RewardSource

__all__ = ["ONITransforms", "oni_transforms"]

DEFAULT_CAPACITY = 100_000  # distinct captions; a 50M-frame NetHack run sees a few tens of thousands


class ONITransforms(Compose):
    """The ``Compose`` returned by :func:`oni_transforms`, with its parts named."""

    def __init__(self, *transforms, store: CaptionStore, annotate: LLMAnnotationTransform,
                 intrinsic: IntrinsicRewardTransform):
        super().__init__(*transforms)
        # plain attributes, not submodules: they are already in the Compose's list
        object.__setattr__(self, "store", store)
        object.__setattr__(self, "annotate", annotate)
        object.__setattr__(self, "intrinsic", intrinsic)

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every caption seen so far has its label (or ``timeout`` seconds pass)."""
        return self.annotate.wait_idle(timeout)

    def metrics(self) -> dict:
        """The annotation metrics: store size, labelled, coverage, queue depth, faults..."""
        return self.annotate.metrics()

    def __enter__(self) -> "ONITransforms":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def oni_transforms(
    store: Optional[CaptionStore] = None,
    *,
    annotator: Annotator,
    reward: Optional[RewardSource] = None,
    beta: float = 3.0,
    message: str = "acted",
    intrinsic_coeff: Optional[float] = None,
    extrinsic_coeff: float = 1.0,
    extrinsic_clip: Optional[float] = 10.0,
    labelled_key: Optional[str] = None,
    copy_observations: bool = True,
) -> ONITransforms:
    """ONI's transforms for any TorchRL NetHack env, in the order they must run.

    Args:
        store: the caption store the labels go to (default: a new
            ``CaptionStore(capacity=100_000)``, then ``stack.store``).

    Keyword Args:
        annotator: who labels captions (:mod:`torchrl_oni.annotators`: ``ScriptedAnnotator()``
            for NetHack rules, ``OpenAIAnnotator(url)`` for a vLLM or OpenAI-compatible server).
        reward: the reward source, ``(uint8[N, 256], int64[N]) -> float32[N]`` (default
            ``RetrievalReward(store)``: ONI-Retrieval, the label itself).
        beta: count decay ``msg_count ** -beta`` (3, as ONI; 0 turns it off).
        message: ``"acted"`` (ONI's: the caption the action was taken on) or ``"next"``.
        intrinsic_coeff: when given, a :class:`~torchrl_oni.transforms.CombineRewards` is
            appended and ``("next", "reward")`` becomes
            ``extrinsic_coeff · clip(r, ±extrinsic_clip) + intrinsic_coeff · intrinsic_reward``;
            otherwise the reward is left alone and the intrinsic one is only written.
        extrinsic_coeff, extrinsic_clip: see above (ONI: 0.1 and 10 with 0.4 intrinsic on score).
        labelled_key: also write a bool "caption already labelled" entry under this key.
        copy_observations: put :class:`CopyAliasedObservations` first (default; it costs a
            pointer comparison on envs that do not alias).

    Returns:
        ONITransforms: a ``Compose``; ``.store``, ``.annotate`` and ``.intrinsic`` are its parts.
    """
    store = CaptionStore(capacity=DEFAULT_CAPACITY) if store is None else store
    annotate = LLMAnnotationTransform(store, annotator, labelled_key=labelled_key)
    intrinsic = IntrinsicRewardTransform(RetrievalReward(store) if reward is None else reward,
                                         beta=beta, message=message)
    parts = ([CopyAliasedObservations()] if copy_observations else []) + [
        CaptionHash(), MessageCounter(), annotate, intrinsic]
    if intrinsic_coeff is not None:
        parts.append(CombineRewards(extrinsic_coeff=extrinsic_coeff, intrinsic_coeff=intrinsic_coeff,
                                    extrinsic_clip=extrinsic_clip))
    return ONITransforms(*parts, store=store, annotate=annotate, intrinsic=intrinsic)
