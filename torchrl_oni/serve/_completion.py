"""What an engine returns for one prompt, and the rules every engine follows (one contract for
:mod:`torchrl_oni.serve.engines` and :mod:`torchrl_oni.serve._int8`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["Completion", "AliveFn", "PROMPT_BYTES_PER_TOKEN", "common_prefix_len", "shared_prefix_len", "prompt_ids",
           "eos_ids", "render_chat", "cut_at_stop"]


@dataclass
class Completion:
    """One prompt's answer from an engine.

    ``top_logprobs[i]`` lists ``(token, logprob)`` candidates at generated position ``i`` (empty
    when logprobs were not asked for). ``finish_reason`` is ``"stop"`` or ``"length"`` as in the
    OpenAI API, ``"abort"`` when generation was skipped or cut because nobody waits for the
    answer any more (see ``alive`` in
    :meth:`~torchrl_oni.serve.engines.TransformersEngine.complete`), or ``"error"`` when
    the engine refused the prompt; ``error`` then says why (the server answers 400).
    """

    text: str
    tokens: List[str] = field(default_factory=list)
    token_logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[List[Tuple[str, float]]] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    error: Optional[str] = None


# Engines take ``alive``: None, or a callable returning one flag per prompt, False once that
# prompt's client has gone away (called from the engine thread between model steps).
AliveFn = Optional[Callable[[], Sequence[bool]]]

# A prompt longer than ``context × PROMPT_BYTES_PER_TOKEN`` UTF-8 bytes is refused before it is
# tokenised (tokenising megabytes takes seconds of the engine thread). Text averages about 4
# bytes per token; only long runs of one character ('#', spaces) pack more, so no prompt the
# server is meant for comes near this bound.
PROMPT_BYTES_PER_TOKEN = 16


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (the part of a batch run once)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i



def shared_prefix_len(ids_list: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt of a batch shares, leaving each row at least one
    token of its own (the part an engine runs, or caches, once)."""
    plen = min(len(ids) for ids in ids_list) - 1
    for ids in ids_list[1:]:
        plen = min(plen, common_prefix_len(ids_list[0], ids))
    return max(plen, 0)


def render_chat(tokenizer, messages: Sequence[Dict[str, str]]) -> str:
    """Chat messages as one prompt: the tokenizer's chat template, or plain ``role: content``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first of the ``stop`` strings it holds (each tried in turn)."""
    for s in stop or ():
        if s and s in text:
            text = text[: text.index(s)]
    return text


def prompt_ids(tokenizer, prompt: str, *, chat: bool, max_new: int, max_context: int,
               empty_id: int) -> Tuple[Optional[List[int]], Optional[Completion]]:
    """``(token ids, None)`` for a prompt that fits the context with ``max_new`` new tokens, else
    ``(None, the error Completion)``; an empty prompt is one ``empty_id`` token."""
    # Chat prompts already hold the template's special tokens.
    ids = tokenizer(prompt, add_special_tokens=not chat).input_ids or [empty_id]
    if len(ids) + max_new > max_context:
        return None, Completion(
            text="", finish_reason="error", prompt_tokens=len(ids),
            error=f"prompt of {len(ids)} tokens plus {max_new} new tokens exceeds the "
                  f"model's context of {max_context} tokens")
    return ids, None


def eos_ids(model, tokenizer) -> Set[int]:
    """The token ids that end a generation: the model's generation config's and the tokenizer's."""
    ids: Set[int] = set()
    for src in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(x) for x in src)
    return ids
