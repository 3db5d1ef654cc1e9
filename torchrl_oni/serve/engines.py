"""The model engines behind the embedded OpenAI-compatible server: prompts in, completions out.

An engine has ``complete(prompts, max_tokens, temperature, top_logprobs, stop, chat, alive)``,
returning one :class:`Completion` per prompt, and ``render_chat(messages)``; the HTTP layer
(:mod:`torchrl_oni.serve.http`) calls it from one worker thread.

* :class:`TransformersEngine` — a packaged model (see :mod:`torchrl_oni.serve.models`) on CPU.
  Scoring is the cheap path: a request with ``max_tokens=1`` and ``logprobs`` costs one forward
  pass, and every batch computes the prompts' shared token prefix (the template in front of the
  message) once, keeping it across requests in a small cache (measured ≈3× more captions/s).
  After that prefix, the prompts run as one token tree (:mod:`._token_tree`): no pad tokens, and
  captions that begin alike share their common beginning, within a batch and, through a bounded
  cache of the tokens computed before (:mod:`._node_cache`), across batches.
* :class:`ScriptedEngine` — no model: answers from NetHack keyword rules, in the answer format
  the prompt asks for. For tests and for measuring client overhead.

:func:`make_engine` builds either by backend name.
"""
from __future__ import annotations

import math
import re
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._completion import (PROMPT_BYTES_PER_TOKEN, AliveFn, Completion, common_prefix_len, cut_at_stop, eos_ids,
                          prompt_ids, render_chat, shared_prefix_len)
from ._node_cache import DEFAULT_NODE_CACHE_MB, NodeCache
from ._token_tree import ROW_TOKENS, token_tree

__all__ = [
    "Completion",
    "ScriptedEngine",
    "TransformersEngine",
    "make_engine",
    "SCRIPTED_MODEL_NAME",
    "PROMPT_BYTES_PER_TOKEN",
]

SCRIPTED_MODEL_NAME = "scripted"

# How a batch's prompts run after their shared prefix: ``"tree"`` computes each distinct run of
# leading tokens once (:mod:`._token_tree`); ``"padded"`` pads every prompt to the longest.
LAYOUTS = ("tree", "padded")
# Prompts that share a beginning and then diverge, whose next tokens are sure: scored both ways
# when an engine starts, to check that the model honours the tree's mask.
_TREE_CHECK = ("Count on: one, two, three, four, five,", "Count on: one, two, three, a, b, c, d, e, f,",
               "Count on: one, 1, 2, 3, 4,")
_TREE_TOLERANCE = 0.5


# --------------------------------------------------------------------------------------------
# Scripted engine
# --------------------------------------------------------------------------------------------
_FALLBACK_POSITIVE = re.compile(
    r"\bYou (?:kill|destroy)\b|\bexperience level\b|\bgold pieces?\b|\bstaircase down\b"
    r"|\bYou (?:climb|go) down\b|\bhidden (?:passage|door)\b|\bYou feel (?:much )?better\b",
    re.I,
)
_TAGGED = re.compile(r"<message(?:_\d)?>(.*?)</message(?:_\d)?>", re.S)


class ScriptedEngine:
    """Answers prompts from keyword rules, in the format the prompt asks for (no model).

    It finds the judged message(s) in the prompt (the last ``<message>`` tag, or the last line),
    scores them with :class:`~torchrl_oni.annotators.scripted.ScriptedAnnotator` when that module
    is available (else a one-regex rule), and answers ``<best>1|2|tie</best>`` for ranking
    prompts, ``<label>FOO|BAR</label>`` for tagged ones and ``yes``/``no`` otherwise. Its label
    token carries logprobs ``log 0.9`` / ``log 0.1``.

    Example:
        >>> eng = ScriptedEngine()
        >>> [c.text for c in eng.complete(["Message: You kill the newt!\\nProgress:", "It's a wall."])]
        ['yes', 'no']
    """

    model_name = SCRIPTED_MODEL_NAME
    max_context: Optional[int] = None  # rules have no context limit
    max_prompt_bytes: Optional[int] = None

    def __init__(self) -> None:
        try:  # lazily: the rules live with the annotators when that module exists
            from torchrl_oni.annotators.scripted import ScriptedAnnotator

            self._score = ScriptedAnnotator().score
        except Exception:  # pragma: no cover - fallback when the annotators are absent
            self._score = lambda text: 1.0 if _FALLBACK_POSITIVE.search(text or "") else 0.0

    @staticmethod
    def _messages(prompt: str) -> List[str]:
        found = _TAGGED.findall(prompt)
        if "<message_1>" in prompt and len(found) >= 2:
            return found[-2:]
        if found:
            return found[-1:]
        lines = [ln for ln in prompt.strip().splitlines() if ln.strip()]
        labelled = [ln for ln in lines if re.match(r"\s*Message\s*:", ln)]
        last = (labelled or lines or [""])[-1]
        return [re.sub(r"^\s*Message\s*:\s*", "", last)]

    def _answer(self, prompt: str) -> Tuple[str, str, str]:
        msgs = self._messages(prompt)
        if "<best>" in prompt and len(msgs) == 2:
            a, b = (self._score(m) for m in msgs)
            best = "tie" if a == b else ("2" if b > a else "1")
            return f"<best>{best}</best>", best, "tie" if best != "tie" else "1"
        positive = self._score(msgs[0]) > 0
        if "<label>" in prompt:
            pos, neg = _label_tokens(prompt)
            word = pos if positive else neg
            return f"<analysis>rule-based</analysis>\n<label>{word}</label>", word, (neg if positive else pos)
        word = "yes" if positive else "no"
        return word, word, ("no" if positive else "yes")

    def complete(self, prompts: Sequence[str], max_tokens: int = 16, temperature: float = 0.0,
                 top_logprobs: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, alive: AliveFn = None) -> List[Completion]:
        live = list(alive()) if alive is not None else [True] * len(prompts)
        out = []
        for prompt, wanted in zip(prompts, live):
            if not wanted:
                out.append(Completion(text="", finish_reason="abort"))
                continue
            text, token, other = self._answer(prompt)
            if max_tokens <= 1:
                text = token  # the label token alone, as a one-token answer would be
            top = [[(token, math.log(0.9)), (other, math.log(0.1))][: max(1, top_logprobs or 0)]]
            out.append(Completion(
                text=text, tokens=[token], token_logprobs=[math.log(0.9)],
                top_logprobs=top if top_logprobs is not None else [],
                finish_reason="length" if max_tokens <= 1 else "stop",
                prompt_tokens=len(prompt.split()),
            ))
        return out

    def render_chat(self, messages: Sequence[Dict[str, str]]) -> str:
        return "\n\n".join(str(m.get("content", "")) for m in messages)


def _label_tokens(prompt: str) -> Tuple[str, str]:
    # "<label>FOO or BAR</label>" in the requested format names the two label words.
    m = re.search(r"<label>\s*(\w+)\s+or\s+(\w+)\s*</label>", prompt)
    return (m.group(1), m.group(2)) if m else ("FOO", "BAR")


# --------------------------------------------------------------------------------------------
# Transformers engine
# --------------------------------------------------------------------------------------------
def _select(alive: Callable[[], Sequence[bool]], rows: Sequence[int]) -> Callable[[], List[bool]]:
    """``alive`` restricted to ``rows`` (one call of ``alive`` per call)."""
    def selected() -> List[bool]:
        flags = alive()
        return [flags[i] for i in rows]

    return selected


class _PrefixCache:
    """A few cached key/value tensors of prompt prefixes (batch 1), reused across batches.

    Policy: a batch's shared prefix replaces the entry it extends; a single prompt shortens the
    entry it overlaps by at least half to the overlap (so a stream of one-prompt requests
    converges on the template), otherwise it becomes a new entry (LRU).
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.entries: "OrderedDict[Tuple[int, ...], List[Tuple[Any, Any]]]" = OrderedDict()
        self.hits = 0
        self.tokens_reused = 0

    def best(self, prefix: Sequence[int]) -> Tuple[Optional[Tuple[int, ...]], int]:
        best_key, best_len = None, 0
        for key in self.entries:
            n = common_prefix_len(key, prefix)
            if n > best_len:
                best_key, best_len = key, n
        return best_key, best_len

    def store(self, prefix: Tuple[int, ...], kv, matched_key, matched: int, shared: bool) -> None:
        if matched_key is not None and matched >= len(matched_key) / 2:
            del self.entries[matched_key]
            if shared and matched == len(matched_key):
                new_key, new_kv = prefix, kv
            else:
                new_key = prefix[:matched]
                new_kv = [(k[:, :, :matched], v[:, :, :matched]) for k, v in kv]
        else:
            new_key, new_kv = prefix, kv
        self.entries[new_key] = new_kv
        self.entries.move_to_end(new_key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


class TransformersEngine:
    """Runs a causal LM from :func:`~torchrl_oni.serve.models.load_model` on CPU.

    Args:
        loaded: a :class:`~torchrl_oni.serve.models.LoadedModel`.
        max_tokens_cap: the most tokens generated per prompt, whatever a request asks (ONI asks
            for 4096; a CPU model would take minutes). ``finish_reason`` is ``"length"`` when hit.
        max_batch: the most prompts run in one forward pass.
        layout: how a batch runs after its shared prefix (:data:`LAYOUTS`): ``"tree"`` computes
            each distinct run of leading tokens once and no pad tokens; ``"padded"`` pads every
            prompt to the longest. A model that does not honour the tree's attention mask (checked
            at start) runs padded, with one warning.
        node_cache_mb: memory for the keys and values of tokens computed in earlier batches
            (the tree layout only; 0 turns it off): a caption whose beginning was computed
            before computes only the rest.

    Attributes:
        max_context: the model's context in tokens (prompt plus generated tokens).
        tokens_run: tokens the model has computed after the prompts' cached prefixes (pads and
            generated tokens included): what a batch's layout and the node cache save.
        max_prompt_bytes: prompts longer than this (UTF-8 bytes) cannot fit the context in
            practice (:data:`PROMPT_BYTES_PER_TOKEN`); the server refuses them untokenised.
    """

    def __init__(self, loaded, max_tokens_cap: int = 128, max_batch: int = 32, layout: str = "tree",
                 node_cache_mb: float = DEFAULT_NODE_CACHE_MB) -> None:
        import torch

        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose {' or '.join(LAYOUTS)}")

        self.torch = torch
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.spec.name
        self.max_tokens_cap = max_tokens_cap
        self.max_batch = max_batch
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)
        self.max_prompt_bytes = self.max_context * PROMPT_BYTES_PER_TOKEN
        self.eos_ids = eos = eos_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = next(iter(eos)) if eos else 0
        self.prefix_cache = _PrefixCache()
        self.tokens_run = 0
        self.row_tokens = ROW_TOKENS
        self.layout = "padded"
        self.node_cache: Optional[NodeCache] = None
        if node_cache_mb < 0:
            raise ValueError(f"node_cache_mb must be >= 0, got {node_cache_mb}")
        if layout == "tree":
            problem = self._tree_problem()
            if problem is None:
                self.layout = "tree"
                capacity = int(node_cache_mb * 2 ** 20) // self._bytes_per_token()
                self.node_cache = NodeCache(capacity) if capacity > 0 else None
            else:
                warnings.warn(f"{self.model_name} does not honour a token tree's attention mask "
                              f"({problem}); its batches run padded, which costs more compute",
                              RuntimeWarning, stacklevel=3)

    def _bytes_per_token(self) -> int:
        """The keys and values one token leaves in the cache, all layers."""
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        itemsize = self.torch.empty(0, dtype=self.model.dtype).element_size()
        return 2 * cfg.num_hidden_layers * heads * head_dim * itemsize

    def _tree_problem(self) -> Optional[str]:
        """None if a token tree scores :data:`_TREE_CHECK` as padded batches do, else how not
        (a model that ignores custom 4D masks lets a prompt see its neighbours' tokens)."""
        torch = self.torch
        # Whole prompts, no cached prefix: their common beginning is shared inside the tree.
        ids = [self.tokenizer(p).input_ids for p in _TREE_CHECK]
        with torch.inference_mode():
            try:
                tree = self._first_tree(None, 0, ids, keep_cache=False)[0]
            except Exception as err:  # noqa: BLE001 - any failure means: do not use it
                return f"{type(err).__name__}: {err}"
            padded = self._first_padded(None, 0, ids, keep_cache=False)[0]
        want = torch.log_softmax(padded.float(), -1)
        got = torch.log_softmax(tree.float(), -1)
        top = want.topk(5, dim=-1).indices
        gap = float((want.gather(1, top) - got.gather(1, top)).abs().max())
        # Rounding moves these log-probabilities by hundredths even in bfloat16; a prompt that
        # sees another's tokens moves them by whole units.
        return None if gap < _TREE_TOLERANCE else f"log-probabilities differ by {gap:.2f}"

    # -- prompt handling ---------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Dict[str, str]]) -> str:
        return render_chat(self.tokenizer, messages)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- model calls -------------------------------------------------------------------------
    def _new_cache(self, kv, batch: int):
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), layer)
        return cache

    @staticmethod
    def _cache_tensors(cache) -> List[Tuple[Any, Any]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _prefix_kv(self, prefix: Tuple[int, ...], shared: bool):
        """Key/values of ``prefix`` (batch 1), from the cache where possible."""
        torch = self.torch
        key, matched = self.prefix_cache.best(prefix)
        if key is not None and matched > 0:
            kv = [(k[:, :, :matched], v[:, :, :matched]) for k, v in self.prefix_cache.entries[key]]
            self.prefix_cache.hits += 1
            self.prefix_cache.tokens_reused += matched
        else:
            kv, matched = None, 0
        rest = prefix[matched:]
        if rest:
            cache = self._new_cache(kv, 1) if kv else None
            ids = torch.tensor([rest], dtype=torch.long)
            pos = torch.arange(matched, len(prefix), dtype=torch.long)[None]
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            kv = self._cache_tensors(out.past_key_values)
        self.prefix_cache.store(prefix, kv, key, matched, shared)
        return kv

    def complete(self, prompts: Sequence[str], max_tokens: int = 16, temperature: float = 0.0,
                 top_logprobs: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, alive: AliveFn = None) -> List[Completion]:
        """Generates for each prompt; batches of at most ``max_batch`` prompts.

        Args:
            prompts: the prompt texts (chat prompts already rendered, ``chat=True``).
            max_tokens: new tokens per prompt (at most ``max_tokens_cap``).
            temperature: 0 (or below 1e-5) is greedy; otherwise sampling.
            top_logprobs: how many candidates to report per generated token (None: none).
            stop: strings that end a prompt's generation (cut from its text).
            chat: whether the prompts hold a chat template (no special tokens are added).
            alive: None, or a callable giving one flag per prompt, False once nobody waits for
                that prompt's answer. Dead prompts are not tokenised or run, and are dropped
                from a running batch at its next step; their completions have
                ``finish_reason="abort"``.

        Returns:
            One :class:`Completion` per prompt, in order. A prompt whose tokens plus
            ``max_tokens`` exceed the context gets ``finish_reason="error"`` and ``error`` set,
            without failing the others.
        """
        out: List[Completion] = []
        for start in range(0, len(prompts), self.max_batch):
            end = start + self.max_batch
            part_alive = None if alive is None else (lambda s=start, e=end: alive()[s:e])
            out.extend(self._complete_batch(prompts[start:end], max_tokens, temperature,
                                            top_logprobs, stop, chat, part_alive))
        return out

    def _complete_batch(self, prompts, max_tokens, temperature, top_logprobs, stop, chat,
                        alive: AliveFn = None) -> List[Completion]:
        max_new = max(1, min(int(max_tokens), self.max_tokens_cap))
        live = list(alive()) if alive is not None else [True] * len(prompts)
        results: List[Optional[Completion]] = [None] * len(prompts)
        rows, ids_list = [], []
        for i, prompt in enumerate(prompts):
            if not live[i]:
                results[i] = Completion(text="", finish_reason="abort")
                continue
            ids, refused = prompt_ids(self.tokenizer, prompt, chat=chat, max_new=max_new,
                                      max_context=self.max_context, empty_id=self.pad_id)
            if refused is not None:
                results[i] = refused
                continue
            rows.append(i)
            ids_list.append(ids)
        if rows:
            rows_alive = None if alive is None else _select(alive, rows)
            generated = self._generate(ids_list, max_new, temperature, top_logprobs, stop,
                                       rows_alive)
            for i, res in zip(rows, generated):
                results[i] = res
        return results

    def _first_padded(self, kv, plen: int, suffixes, keep_cache: bool):
        """The first forward with suffixes left-padded to one width: ``(logits [batch, vocab],
        cache, 2D attention mask, each row's last position)`` for the decoding steps."""
        torch = self.torch
        batch = len(suffixes)
        width = max(len(s) for s in suffixes)
        # Pads sit between the prefix and each suffix, masked out; positions skip them.
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.ones((batch, plen + width), dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        for row, suffix in enumerate(suffixes):
            pad = width - len(suffix)
            input_ids[row, pad:] = torch.tensor(suffix, dtype=torch.long)
            mask[row, plen:plen + pad] = 0
            positions[row, pad:] = torch.arange(plen, plen + len(suffix))
            positions[row, :pad] = plen  # ignored (masked), kept in range
        cache = self._new_cache(kv, batch) if kv else None
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=keep_cache, logits_to_keep=1)
        self.tokens_run += input_ids.numel()
        return out.logits[:, -1], out.past_key_values, mask, positions[:, -1]

    def _first_tree(self, kv, plen: int, suffixes, keep_cache: bool, node: Optional[NodeCache] = None):
        """The first forward over the suffixes' token tree (:mod:`._token_tree`), with
        :meth:`_first_padded`'s return; for decoding, each prompt's keys and values are gathered
        from its tree row into a right-padded cache. With ``node`` (the suffixes continue its
        root, the prefix), tokens computed in earlier batches come from it and the new ones go
        into it."""
        torch = self.torch
        held = [node.walk(s, len(s) - 1) for s in suffixes] if node is not None else [[] for _ in suffixes]
        used = sorted(set().union(*held))
        past = len(used)
        cached = None
        if used:
            col_of = {slot: i for i, slot in enumerate(used)}
            cached = [[col_of[slot] for slot in slots] for slots in held]
            kv = [(torch.cat([k, pk], dim=2), torch.cat([v, pv], dim=2))
                  for (k, v), (pk, pv) in zip(kv, node.gather(used))]
        tree = token_tree(suffixes, plen, self.pad_id, self.row_tokens, cached=cached, past_width=past)
        rows = tree.input_ids.shape[0]
        cache = self._new_cache(kv, rows) if kv else None
        # Only the columns where a prompt ends are projected onto the vocabulary.
        ends, end_of = torch.unique(tree.last[:, 1], return_inverse=True)
        out = self.model(input_ids=tree.input_ids, attention_mask=tree.mask,
                         position_ids=tree.position_ids, past_key_values=cache,
                         use_cache=keep_cache or node is not None, logits_to_keep=ends)
        self.tokens_run += tree.input_ids.numel()
        logits = out.logits[tree.last[:, 0], end_of]
        if node is not None:
            self._keep_nodes(node, tree, suffixes, held, out.past_key_values, plen + past)
        if not keep_cache:
            return logits, None, None, None
        width = max(len(s) for s in suffixes)
        index = torch.zeros((len(suffixes), plen + width), dtype=torch.long)
        mask = torch.zeros((len(suffixes), plen + width), dtype=torch.long)
        index[:, :plen] = torch.arange(plen)
        mask[:, :plen] = 1
        for b, (cols, slots) in enumerate(zip(tree.columns, held)):
            k = len(slots)
            if k:
                index[b, plen:plen + k] = plen + torch.tensor(cached[b], dtype=torch.long)
            index[b, plen + k:plen + k + len(cols)] = plen + past + torch.tensor(cols, dtype=torch.long)
            mask[b, plen:plen + k + len(cols)] = 1
        row_of = tree.last[:, 0, None]
        kv_rows = [(k[row_of, :, index].transpose(1, 2), v[row_of, :, index].transpose(1, 2))
                   for k, v in self._cache_tensors(out.past_key_values)]
        last_pos = plen + torch.tensor([len(s) for s in suffixes], dtype=torch.long) - 1
        return logits, self._new_cache(kv_rows, len(suffixes)), mask, last_pos

    def _keep_nodes(self, node: NodeCache, tree, suffixes, held, model_cache, first_col: int) -> None:
        """Stores the tree's new nodes in ``node``, but not the batch's common ending (the
        template after the caption): those tokens follow each caption once. A prompt alone has
        no batch to show its ending: the one the last batch showed is left out where it ends so."""
        torch = self.torch
        tail = 0
        if len(suffixes) > 1:
            shortest = min(len(s) for s in suffixes)
            while tail < shortest - 1 and len({s[-1 - tail] for s in suffixes}) == 1:
                tail += 1
            node.ending = tuple(suffixes[0][len(suffixes[0]) - tail:])
        elif node.ending and len(suffixes[0]) > len(node.ending) \
                and tuple(suffixes[0][-len(node.ending):]) == node.ending:
            tail = len(node.ending)
        found = {}  # (row, column) -> (depth, parent: ("slot", s) | ("node", (row, column)), token)
        for suffix, cols, slots, row in zip(suffixes, tree.columns, held, tree.rows):
            k = len(slots)
            parent = ("slot", slots[-1] if slots else -1)
            for j, col in enumerate(cols):
                depth = k + j
                if depth >= len(suffix) - tail:
                    break
                found.setdefault((row, col), (depth, parent, suffix[depth]))
                parent = ("node", (row, col))
        if not found:
            node.store([], [])
            return
        order = sorted(found, key=lambda rc: found[rc][0])
        number = {rc: j for j, rc in enumerate(order)}
        nodes = []
        for rc in order:
            _, (kind, parent), token = found[rc]
            nodes.append((parent if kind == "slot" else -2 - number[parent], int(token)))
        rows_i = torch.tensor([rc[0] for rc in order], dtype=torch.long)
        cols_i = first_col + torch.tensor([rc[1] for rc in order], dtype=torch.long)
        kv = [(k[rows_i, :, cols_i].transpose(0, 1), v[rows_i, :, cols_i].transpose(0, 1))
              for k, v in self._cache_tensors(model_cache)]
        node.store(nodes, kv)

    def _node_cache_for(self, ids_list, plen: int) -> Optional[NodeCache]:
        """The node cache when every prompt continues its root (a batch of several prompts whose
        shared prefix does not continue the root re-roots it there), else None."""
        node = self.node_cache
        if node is None:
            return None
        root = node.root
        if len(ids_list) > 1 and plen > 0 and (root is None or plen < len(root)
                                               or tuple(ids_list[0][:len(root)]) != root):
            node.reset(ids_list[0][:plen])
            root = node.root
        if not root or any(len(ids) <= len(root) or tuple(ids[:len(root)]) != root for ids in ids_list):
            return None
        return node

    def _generate(self, ids_list, max_new, temperature, top_logprobs, stop,
                  alive: AliveFn) -> List[Completion]:
        torch = self.torch
        batch = len(ids_list)
        # The shared prefix runs once; every row keeps at least one token of its own.
        plen = shared_prefix_len(ids_list)
        node = self._node_cache_for(ids_list, plen)
        if node is not None:
            plen = len(node.root)  # the rest runs as the cache's nodes
        prefix = tuple(ids_list[0][:plen])
        with torch.inference_mode():
            kv = self._prefix_kv(prefix, shared=batch > 1) if plen > 0 else None
            suffixes = [ids[plen:] for ids in ids_list]
            if self.layout == "tree":
                logits, cache, mask, last_pos = self._first_tree(kv, plen, suffixes, keep_cache=max_new > 1,
                                                                 node=node)
            else:
                logits, cache, mask, last_pos = self._first_padded(kv, plen, suffixes, keep_cache=max_new > 1)
            gen: List[List[int]] = [[] for _ in range(batch)]
            gen_lp: List[List[float]] = [[] for _ in range(batch)]
            gen_top: List[List[List[Tuple[str, float]]]] = [[] for _ in range(batch)]
            finish = ["length"] * batch
            done = [False] * batch
            texts = [""] * batch
            for step in range(max_new):
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                if temperature and temperature > 1e-5:
                    probs = torch.softmax(logits.float() / temperature, dim=-1)
                    chosen = torch.multinomial(probs, 1)[:, 0]
                else:
                    chosen = logprobs.argmax(dim=-1)
                chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0]
                if top_logprobs:
                    top_v, top_i = logprobs.topk(int(top_logprobs), dim=-1)
                for row in range(batch):
                    if done[row]:
                        continue
                    tok = int(chosen[row])
                    if tok in self.eos_ids:
                        done[row], finish[row] = True, "stop"
                        continue
                    gen[row].append(tok)
                    gen_lp[row].append(float(chosen_lp[row]))
                    if top_logprobs:
                        gen_top[row].append([(self._token_text(int(i)), float(v))
                                             for i, v in zip(top_i[row], top_v[row])])
                    if stop:
                        texts[row] = self.tokenizer.decode(gen[row])
                        if any(s in texts[row] for s in stop):
                            done[row], finish[row] = True, "stop"
                if all(done) or step == max_new - 1:
                    break
                if alive is not None:  # rows nobody waits for any more stop here
                    for row, wanted in enumerate(alive()):
                        if not wanted and not done[row]:
                            done[row], finish[row] = True, "abort"
                    if all(done):
                        break
                last_pos = last_pos + 1
                mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
                out = self.model(input_ids=chosen[:, None], attention_mask=mask,
                                 position_ids=last_pos[:, None], past_key_values=cache,
                                 use_cache=True, logits_to_keep=1)
                self.tokens_run += batch
                cache, logits = out.past_key_values, out.logits[:, -1]
        results = []
        for row in range(batch):
            text = cut_at_stop(self.tokenizer.decode(gen[row], skip_special_tokens=True), stop)
            results.append(Completion(
                text=text,
                tokens=[self._token_text(t) for t in gen[row]],
                token_logprobs=gen_lp[row],
                top_logprobs=gen_top[row],
                finish_reason=finish[row],
                prompt_tokens=len(ids_list[row]),
            ))
        return results



def make_engine(backend: str = "embedded", model: Optional[str] = None, *, dtype: str = "auto",
                threads: Optional[int] = None, max_tokens_cap: int = 128, layout: str = "tree",
                node_cache_mb: float = DEFAULT_NODE_CACHE_MB):
    """Builds the engine for ``backend`` (``"embedded"`` or ``"scripted"``).

    ``dtype`` is ``"auto"``, ``"bfloat16"`` or ``"float32"`` (transformers), or ``"int8"``
    (CTranslate2, :mod:`torchrl_oni.serve._int8`; the float path with one warning where it
    cannot run). ``layout`` and ``node_cache_mb`` are the float path's (:class:`TransformersEngine`).
    """
    if backend == "scripted":
        return ScriptedEngine()
    if backend != "embedded":
        raise ValueError(f"unknown backend {backend!r} for the embedded server; "
                         "choose embedded or scripted")
    from torchrl_oni.serve.models import DEFAULT_MODEL, load_model

    loaded = load_model(model or DEFAULT_MODEL, dtype="auto" if dtype == "int8" else dtype, threads=threads)
    if dtype == "int8":
        from torchrl_oni.serve._int8 import int8_engine

        engine, reason = int8_engine(loaded, threads=threads, max_tokens_cap=max_tokens_cap)
        if engine is not None:
            return engine
        warnings.warn(f"the int8 judge cannot run here: {reason}; serving {loaded.spec.name} in "
                      f"{loaded.dtype} instead", RuntimeWarning, stacklevel=2)
    return TransformersEngine(loaded, max_tokens_cap=max_tokens_cap, layout=layout, node_cache_mb=node_cache_mb)
