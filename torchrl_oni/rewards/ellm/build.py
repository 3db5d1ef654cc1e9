"""Builds ELLM's reward from plain settings (:func:`build_ellm_reward`, what ``oni-train`` passes):
the encoder, the goal suggester (scripted, or an OpenAI-compatible server checked first), the goal
table (loaded from its file when there is one) and the :class:`~torchrl_oni.rewards.ellm.reward.ELLMReward`.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Optional, Sequence, Union

import torch

from torchrl_oni.rewards.ellm.conditioning import SharedGoalEmbeddings
from torchrl_oni.rewards.ellm.reward import ELLMReward
from torchrl_oni.rewards.ellm.table import GoalTable

__all__ = ["build_ellm_reward"]

log = logging.getLogger(__name__)


def build_ellm_reward(
    *,
    annotator_kind: str = "llm",
    url: Union[None, str, Sequence[str]] = None,
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    encoder: str = "auto",
    threshold: Optional[float] = None,
    goals_per_state: int = 5,
    message: str = "next",
    once_per_episode: bool = True,
    beta: float = 0.0,
    goal_conditioned: bool = False,
    shared: Optional[SharedGoalEmbeddings] = None,
    include_message: bool = False,
    goal_table: Optional[Union[str, os.PathLike]] = None,
    api: str = "chat",
    batch_size: int = 32,
    max_concurrency: int = 4,
    timeout_s: Optional[float] = None,
    device: Union[str, torch.device] = "cpu",
    check_server: bool = True,
) -> ELLMReward:
    """Builds an :class:`ELLMReward` from plain settings (what ``oni-train`` would pass).

    Args:
        annotator_kind: ``"scripted"`` (goals from rules) or ``"llm"`` (``url`` + ``model``).
        url, model: the OpenAI-compatible server, or a list of them (a pool: each request goes
            to the least loaded usable one), and the served model (``None``: the only one the
            servers list) for ``"llm"``.
        api_key: bearer token for the servers (``None``: ``OPENAI_API_KEY``, or none).
        encoder: ``"auto"``, ``"minilm"`` or ``"hashed"`` (:func:`~torchrl_oni.rewards.text.make_encoder`).
        threshold: ``None``: the encoder's calibrated default.
        goals_per_state: goals asked for and kept per state.
        message, once_per_episode, beta, goal_conditioned, shared: see :class:`ELLMReward`.
        include_message: put NLE's message in state captions (more distinct states, more requests).
        goal_table: a file: loaded when it exists, saved at checkpoints and at close.
        api: ``"chat"`` or ``"completions"`` for the server.
        batch_size, max_concurrency: goal requests (most prompts per ``completions`` request,
            requests in flight per server).
        timeout_s: a fixed time limit per goal request (``None``: adapted to each server's
            latency, as for labels).
        device: where the MiniLM encoder runs (the learner's device).
        check_server: ask the server for its models first; a dead server raises one line.

    Raises:
        ValueError: bad settings, a missing ``url``/``model``, an unusable encoder, or a server
            that does not answer (:class:`~torchrl_oni.annotators.endpoints.AnnotatorUnavailable`
            is a ``RuntimeError``; it is re-raised as ``ValueError`` with its one line).
    """
    from torchrl_oni.annotators.goals import OpenAIGoalSuggester, ScriptedGoalSuggester
    from torchrl_oni.envs.state_captions import StateCaptioner
    from torchrl_oni.rewards.text import make_encoder

    if annotator_kind not in ("scripted", "llm"):
        raise ValueError(f"unknown goal annotator {annotator_kind!r}; choose scripted or llm")
    if goals_per_state < 1:
        raise ValueError("goals per state must be at least 1")
    if threshold is not None and not -1.0 <= threshold <= 1.0:
        raise ValueError(f"the ELLM threshold is a cosine in [-1, 1], got {threshold}")
    enc = make_encoder(encoder, device=device)
    if annotator_kind == "scripted":
        suggester = ScriptedGoalSuggester(max_goals=goals_per_state)
    else:
        urls = [url] if isinstance(url, str) else list(url or [])
        if not any(urls):
            raise ValueError("ELLM goals from an LLM need a server URL (or the scripted goal suggester)")
        suggester = OpenAIGoalSuggester(urls, model, api=api, max_goals=goals_per_state,
                                        batch_size=batch_size, max_concurrency=max_concurrency,
                                        timeout_s=timeout_s, api_key=api_key)
        if check_server or model is None:
            async def check():
                try:
                    await suggester.check()
                finally:
                    await suggester.aclose()

            try:
                asyncio.run(check())
            except RuntimeError as err:  # AnnotatorUnavailable
                raise ValueError(str(err)) from None
    table = None
    if goal_table is not None and os.path.exists(goal_table):
        table = GoalTable.load(goal_table)
        if table.max_goals != goals_per_state:
            raise ValueError(f"{goal_table} keeps {table.max_goals} goals per state, not {goals_per_state}")
        log.info("ELLM goal table: %d states (%d with goals) from %s", len(table),
                 table.stats()["done"], goal_table)
    if table is None:
        table = GoalTable(max_goals=goals_per_state)
    return ELLMReward(table, suggester, enc, threshold=threshold, message=message,
                      once_per_episode=once_per_episode, beta=beta,
                      captioner=StateCaptioner(include_message=include_message),
                      goal_conditioned=goal_conditioned, shared=shared, table_path=goal_table,
                      batch_size=batch_size, max_concurrency=max_concurrency)
