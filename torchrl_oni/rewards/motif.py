"""Offline Motif: collect caption pairs, have them annotated, fit a reward model, serve it.

The three offline phases of Motif (peers §1), as library functions; their command-line tools
are in :mod:`torchrl_oni.train.motif_cli`:

1. :func:`collect_frequency_pairs` draws pairs as Motif does, each caption in proportion to how
   often the agent saw it (``times_seen`` of a caption store: :func:`store_captions`), the
   two captions of a pair independently (``oni-collect-pairs``); :func:`collect_pairs` draws
   pairs of two *different* captions, each distinct caption equally likely
   (``oni-collect-pairs --sampling uniform``). Both leave the empty message out unless told.
2. :func:`annotate_pairs` sends them, a chunk at a time, to any annotator with an async
   ``compare``; the results file is rewritten atomically after every chunk, so a run that is
   interrupted resumes where it stopped (``oni-annotate-pairs``). Pairs whose two captions are
   identical are tied without a call, as Motif does.
3. :func:`train_reward_model` fits a :class:`~torchrl_oni.rewards.models.MessageRewardModel`
   with the Bradley–Terry loss and writes a checkpoint holding the weights, the mean μ and
   standard deviation σ of the scores over all training messages, and the table of quantiles
   q = 0.05 … 0.95 of ``z = (g - μ)/σ`` over the *distinct* training messages
   (``oni-train-reward``).

:class:`MotifReward` then pays ``R(m) = z · 1[z > q(quantile)]``. Its default quantile is 0.5,
a valid column of the table (the original's default, -0.5, is not one and crashed, oni_spec
§7.10).

File formats (numpy ``.npz``, read with ``allow_pickle=False``; the reward checkpoint is a torch
file read with ``weights_only=True``: none of them can run code when loaded):

* pairs: ``first``, ``second``: ``uint8[N, 256]``.
* annotations: ``preference`` ``float32[N]`` (P(second better); NaN = not labelled),
  ``status`` ``int8[N]`` in the package's one numbering (:mod:`torchrl_oni.store.status`: 0
  not asked yet, 2 labelled, 3 failed, 5 tied without a call), ``status_version`` (2), and
  ``fingerprint``, a digest of the pairs, so results are never resumed against other pairs.
  Files without ``status_version`` hold Motif's former numbers (0 pending, 1 labelled, 2 failed,
  3 tied) and are read as such.

Example:
    >>> import numpy as np
    >>> from torchrl_oni.captions import encode_messages
    >>> from torchrl_oni.rewards.motif import collect_pairs
    >>> msgs = encode_messages(["You kill the newt!", "", "It's a wall.", "You kill the newt!"])
    >>> first, second = collect_pairs(msgs, num_pairs=4, seed=0)
    >>> first.shape, bool((first != second).any(axis=1).all())
    ((4, 256), True)
"""
from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from torchrl_oni.atomic import UnreadableFileError, atomic_write, safe_torch_load
from torchrl_oni.captions import MESSAGE_KEY, MESSAGE_LEN, decode_message, hash_messages
from torchrl_oni.rewards.models import MessageRewardModel, as_message_tensor
from torchrl_oni.rewards.ranking import UniqueCaptionPairSampler, bradley_terry_loss, pairwise_accuracy
from torchrl_oni.rewards.scaling import threshold as threshold_values
from torchrl_oni.store.status import FAILED, LABELLED, SKIPPED, UNSEEN

__all__ = [
    "QUANTILE_LEVELS",
    "collect_pairs",
    "collect_frequency_pairs",
    "store_captions",
    "annotate_pairs",
    "annotate_pairs_async",
    "load_annotations",
    "train_reward_model",
    "MotifReward",
]

QUANTILE_LEVELS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05, 0.10, ..., 0.95

# A pair's status, in the numbering every labelling queue of the package shares (store.status).
# Motif's own names for two of its values: a pair not asked yet is UNSEEN (not PENDING, which is
# "handed out, no answer yet", a state a pair file never holds); a tie of identical captions,
# decided without a call, is SKIPPED. LABELLED and FAILED are used as they are.
NOT_ASKED, TIED = UNSEEN, SKIPPED
STATUS_VERSION = 2
_FORMER_STATUS = np.array([NOT_ASKED, LABELLED, FAILED, TIED], dtype=np.int8)  # files without status_version
CHECKPOINT_FORMAT = "torchrl_oni.motif_reward.v1"


# --- 1. pairs ---------------------------------------------------------------------------------
def collect_pairs(
    messages, num_pairs: int, *, include_empty: bool = False, seed: int = 0
) -> Tuple[np.ndarray, np.ndarray]:
    """Draws ``num_pairs`` pairs of two different captions, uniform over distinct captions.

    Args:
        messages: ``uint8[M, 256]`` messages (duplicates allowed; each distinct caption counts
            once).
        num_pairs: how many pairs to draw (with replacement over pairs).
        include_empty: also use the empty message.
        seed: random seed.

    Returns:
        ``(first, second)``, two ``uint8[num_pairs, 256]`` arrays.

    Raises:
        ValueError: if fewer than two distinct usable captions are given.
    """
    messages = np.asarray(as_message_tensor(messages).reshape(-1, MESSAGE_LEN).numpy())
    sampler = UniqueCaptionPairSampler(
        capacity=max(len(messages), 2), include_empty=include_empty, seed=seed
    )
    sampler.observe(messages, hash_messages(messages))
    if len(sampler) < 2:
        raise ValueError(
            f"need at least 2 distinct{'' if include_empty else ' non-empty'} captions, "
            f"got {len(sampler)}"
        )
    first, second, _, _ = sampler.sample_pairs(int(num_pairs))
    return first, second


def collect_frequency_pairs(
    messages, num_pairs: int, *, times_seen=None, include_empty: bool = False, seed: int = 0
) -> Tuple[np.ndarray, np.ndarray]:
    """Draws ``num_pairs`` pairs as Motif samples them: each caption of a pair independently,
    with probability proportional to how often it was seen.

    Motif draws its pairs from a dataset of time steps, so a caption the agent saw on 40 % of
    its steps is 40 % of each side. A pair may then hold one caption twice:
    :func:`annotate_pairs` ties such a pair without asking anyone, as Motif does.

    Args:
        messages: ``uint8[M, 256]`` captions; a caption may appear on several rows (their counts
            add up).
        num_pairs: how many pairs to draw.
        times_seen: ``int[M]``, how many steps showed each row (a caption store's column,
            :func:`store_captions`); ``None``: one each, so a caption weighs as many rows as it
            has.
        include_empty: also draw the empty message (often the most frequent one).
        seed: random seed.

    Returns:
        ``(first, second)``, two ``uint8[num_pairs, 256]`` arrays.

    Raises:
        ValueError: fewer than two distinct usable captions, or counts that are negative, not
            whole or not one per message.

    Example:
        >>> import numpy as np
        >>> from torchrl_oni.captions import decode_messages, encode_messages
        >>> msgs = encode_messages(["You kill the newt!", "It's a wall.", ""])
        >>> first, second = collect_frequency_pairs(msgs, 2000, times_seen=[1, 3, 50], seed=0)
        >>> walls = sum(text == "It's a wall." for text in decode_messages(np.concatenate([first, second])))
        >>> round(walls / 4000, 2)  # 3 of every 4 steps with a (non-empty) caption
        0.75
    """
    messages = np.asarray(as_message_tensor(messages).reshape(-1, MESSAGE_LEN).numpy())
    if times_seen is None:
        counts = np.ones(len(messages), dtype=np.float64)
    else:
        raw = np.asarray(times_seen).reshape(-1)
        if raw.shape != (len(messages),):
            raise ValueError(f"times_seen holds {raw.size} counts for {len(messages)} messages")
        if raw.dtype.kind not in "iuf" or (raw.size and (not np.isfinite(raw).all() or (raw < 0).any()
                                                         or (raw != np.round(raw)).any())):
            raise ValueError("times_seen must hold whole, non-negative counts")
        counts = raw.astype(np.float64)
    usable = counts > 0
    if not include_empty:
        usable &= messages[:, 0] != 0
    rows = np.flatnonzero(usable)
    distinct = len(np.unique(hash_messages(messages[rows]))) if len(rows) else 0
    if distinct < 2:
        raise ValueError(f"need at least 2 distinct{'' if include_empty else ' non-empty'} captions, got {distinct}")
    weights = counts[rows]
    picks = np.random.default_rng(seed).choice(len(rows), size=(2, int(num_pairs)), p=weights / weights.sum())
    return messages[rows[picks[0]]], messages[rows[picks[1]]]


def store_captions(store) -> Tuple[np.ndarray, np.ndarray]:
    """``(messages uint8[M, 256], times_seen int64[M])`` of every caption a
    :class:`~torchrl_oni.store.CaptionStore` holds, labelled or not (the input of
    :func:`collect_frequency_pairs`).

    Example:
        >>> from torchrl_oni.captions import encode_messages
        >>> from torchrl_oni.store import CaptionStore
        >>> store = CaptionStore(capacity=4)
        >>> _ = store.add(encode_messages(["a", "b", "a", "a"]))
        >>> messages, seen = store_captions(store)
        >>> messages.shape, seen.tolist()
        ((2, 256), [3, 1])
    """
    rows = store.caption_rows(store.caption_slots(), fields=(MESSAGE_KEY, "times_seen"))
    return rows[MESSAGE_KEY].numpy().astype(np.uint8), rows["times_seen"].numpy().astype(np.int64)


def _fingerprint(first: np.ndarray, second: np.ndarray) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(first, dtype=np.uint8).tobytes())
    digest.update(np.ascontiguousarray(second, dtype=np.uint8).tobytes())
    return digest.hexdigest()


def _save_npz_atomic(path: Path, **arrays) -> None:
    atomic_write(path, lambda f: np.savez(f, **arrays))


def _load_arrays(path, what: str, keys: Sequence[str] = ()) -> dict:
    """The arrays of a ``.npy``/``.npz`` file (a ``.npy`` gives ``{"": array}``), never unpickled.

    Raises:
        FileNotFoundError: there is no such file.
        UnreadableFileError: truncated, garbage, pickled or object data, or a missing key
            (one-line message).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.ndarray):
            arrays = {"": data}
        else:
            with data:
                arrays = {k: data[k] for k in data.files}
    except Exception as err:
        text = str(err)
        if "allow_pickle" in text:  # numpy refuses pickled files and object arrays
            reason = "refused: pickled data" if "pickled data" in text else "refused: object arrays"
        elif isinstance(err, EOFError) or not text:
            reason = "empty or truncated"
        else:
            reason = "truncated or damaged" if "zip" in text.lower() or "truncat" in text.lower() else "not numpy data"
        raise UnreadableFileError(f"{path} is not a readable {what} ({reason})") from None
    missing = [k for k in keys if k not in arrays]
    if missing:
        raise UnreadableFileError(f"{path} is not a {what} (no {', '.join(map(repr, missing))} array)")
    return arrays


def load_annotations(path) -> dict:
    """Reads an annotations file: ``{"preference", "status", "fingerprint"}``.

    Raises:
        FileNotFoundError, UnreadableFileError: see :func:`_load_arrays`.
    """
    data = _load_arrays(path, "annotations file", ("preference", "status", "fingerprint"))
    status = data["status"].astype(np.int8)
    if "status_version" not in data:  # written before the shared numbering
        if status.size and (status.min() < 0 or status.max() >= len(_FORMER_STATUS)):
            raise UnreadableFileError(f"{path} is not an annotations file (status values out of range)")
        status = _FORMER_STATUS[status]
    return {
        "preference": data["preference"].astype(np.float32),
        "status": status,
        "fingerprint": str(data["fingerprint"]),
    }


# --- 2. annotation ----------------------------------------------------------------------------
async def annotate_pairs_async(
    first,
    second,
    annotator,
    out_path,
    *,
    chunk_size: int = 100,
    max_chunks: Optional[int] = None,
    retry_failed: bool = False,
    on_chunk: Optional[Callable[[int, int], None]] = None,
) -> dict:
    """Annotates the pairs chunk by chunk, saving after every chunk; resumes from ``out_path``.

    Args:
        first, second: ``uint8[N, 256]`` pairs (see :func:`collect_pairs`).
        annotator: anything with ``async compare(list[tuple[str, str]]) -> list[Preference]``.
        out_path: the annotations ``.npz``; if it exists (and was made for the same pairs),
            only the pairs still pending (and the failed ones, with ``retry_failed``) are sent.
        chunk_size: pairs per ``compare`` call, and per save.
        max_chunks: stop after this many chunks (``None``: until done).
        retry_failed: send pairs whose annotation failed before again.
        on_chunk: called as ``on_chunk(done, total)`` after each saved chunk.

    Returns:
        The annotations, as :func:`load_annotations` returns them.

    Raises:
        ValueError: if ``out_path`` holds annotations of different pairs.
    """
    first = np.asarray(as_message_tensor(first).reshape(-1, MESSAGE_LEN).numpy())
    second = np.asarray(as_message_tensor(second).reshape(-1, MESSAGE_LEN).numpy())
    if first.shape != second.shape:
        raise ValueError(f"first and second differ in shape: {first.shape} vs {second.shape}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    n = len(first)
    fingerprint = _fingerprint(first, second)
    out_path = Path(out_path)
    if out_path.exists():
        state = load_annotations(out_path)
        if state["fingerprint"] != fingerprint or len(state["status"]) != n:
            raise ValueError(f"{out_path} holds annotations of different pairs; use another --out")
        preference, status = state["preference"], state["status"]
    else:
        preference = np.full(n, np.nan, dtype=np.float32)
        status = np.full(n, NOT_ASKED, dtype=np.int8)
        # Identical captions are a tie by definition: no call needed.
        identical = (first == second).all(axis=1)
        preference[identical] = 0.5
        status[identical] = TIED

    def save():
        _save_npz_atomic(out_path, preference=preference, status=status, status_version=np.array(STATUS_VERSION),
                         fingerprint=np.array(fingerprint))

    save()
    todo_mask = status == NOT_ASKED
    if retry_failed:
        todo_mask |= status == FAILED
    todo = np.flatnonzero(todo_mask)
    chunks = 0
    for start in range(0, len(todo), chunk_size):
        if max_chunks is not None and chunks >= max_chunks:
            break
        rows = todo[start : start + chunk_size]
        pairs = [(decode_message(first[r]), decode_message(second[r])) for r in rows]
        results = await annotator.compare(pairs)
        if len(results) != len(rows):
            raise RuntimeError(
                f"annotator returned {len(results)} preferences for {len(rows)} pairs"
            )
        for r, result in zip(rows, results):
            if getattr(result, "ok", False):
                preference[r] = float(result.value)
                status[r] = LABELLED
            else:
                preference[r] = np.nan
                status[r] = FAILED
        save()
        chunks += 1
        if on_chunk is not None:
            on_chunk(int((status != NOT_ASKED).sum()), n)
    return {"preference": preference, "status": status, "fingerprint": fingerprint}


def annotate_pairs(first, second, annotator, out_path, **kwargs) -> dict:
    """Synchronous :func:`annotate_pairs_async` (runs its own event loop)."""
    return asyncio.run(annotate_pairs_async(first, second, annotator, out_path, **kwargs))


# --- 3. reward-model training -----------------------------------------------------------------
@torch.no_grad()
def _scores(model, messages: torch.Tensor, device, chunk: int = 4096) -> torch.Tensor:
    model.eval()
    out = [model(c.to(device)).float().cpu() for c in messages.split(chunk)]
    return torch.cat(out) if out else torch.zeros(0)


def train_reward_model(
    first,
    second,
    preference,
    out_path=None,
    *,
    epochs: int = 10,
    batch_size: int = 1024,
    lr: float = 1e-5,
    val_fraction: float = 0.2,
    max_grad_norm: Optional[float] = 10.0,
    seed: int = 777,
    device: Union[str, torch.device] = "cpu",
    model: Optional[MessageRewardModel] = None,
) -> dict:
    """Fits a reward model to labelled pairs and writes a Motif checkpoint.

    Defaults follow Motif's README (lr 1e-5, batch 1024, 10 epochs, 80/20 split, seed 777).
    Pairs whose preference is NaN (unlabelled / failed) are dropped.

    Args:
        first, second: ``uint8[N, 256]`` pairs.
        preference: ``float[N]`` P(second better): 0, 1, 0.5 (tie) or NaN.
        out_path: where to ``torch.save`` the checkpoint (``None``: do not write).
        epochs, batch_size, lr, val_fraction, max_grad_norm, seed, device: training settings.
        model: start from this network (a fresh :class:`MessageRewardModel` if ``None``).

    Returns:
        The checkpoint dict: ``model`` (state dict), ``mean``, ``std``, ``quantile_levels``,
        ``quantile_values``, ``metrics`` (train/val loss and non-tie accuracy) and ``config``.
    """
    first = as_message_tensor(first).reshape(-1, MESSAGE_LEN).cpu()
    second = as_message_tensor(second).reshape(-1, MESSAGE_LEN).cpu()
    preference = torch.as_tensor(np.asarray(preference, dtype=np.float32)).reshape(-1)
    keep = ~torch.isnan(preference)
    first, second, preference = first[keep], second[keep], preference[keep]
    n = len(preference)
    if n < 2:
        raise ValueError(f"need at least 2 labelled pairs to train, got {n}")
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    if model is None:
        with torch.random.fork_rng(devices=[]):  # seeded init, global RNG left untouched
            torch.manual_seed(seed)
            model = MessageRewardModel()
    order = torch.randperm(n, generator=generator)
    n_val = int(round(n * val_fraction)) if val_fraction > 0 else 0
    n_val = min(n_val, n - 1)
    val_idx, train_idx = order[:n_val], order[n_val:]

    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train_losses = []
    for _ in range(int(epochs)):
        model.train()
        perm = train_idx[torch.randperm(len(train_idx), generator=generator)]
        for batch in perm.split(batch_size):
            a, b = first[batch].to(device), second[batch].to(device)
            y = preference[batch].to(device)
            scores = model(torch.cat([a, b]))
            loss = bradley_terry_loss(scores[: len(y)], scores[len(y):], y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            train_losses.append(loss.item())

    def evaluate(idx):
        if len(idx) == 0:
            return float("nan"), float("nan")
        s1 = _scores(model, first[idx], device)
        s2 = _scores(model, second[idx], device)
        y = preference[idx]
        return float(bradley_terry_loss(s1, s2, y)), pairwise_accuracy(s1, s2, y)

    train_loss, train_acc = evaluate(train_idx)
    val_loss, val_acc = evaluate(val_idx)

    # Normalisation over every training message (frequency-weighted, as Motif's running stats).
    train_messages = torch.cat([first[train_idx], second[train_idx]])
    train_scores = _scores(model, train_messages, device).double()
    mean = float(train_scores.mean())
    std = float(train_scores.std(unbiased=False)) if len(train_scores) > 1 else 1.0
    std = max(std, 1e-8)
    # Quantiles over distinct messages.
    _, distinct_rows = np.unique(hash_messages(train_messages.numpy()), return_index=True)
    z_distinct = (train_scores[torch.as_tensor(distinct_rows)] - mean) / std
    levels = torch.tensor(QUANTILE_LEVELS, dtype=torch.float64)
    values = torch.quantile(z_distinct, levels)

    checkpoint = {
        "format": CHECKPOINT_FORMAT,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "mean": mean,
        "std": std,
        "quantile_levels": levels.float(),
        "quantile_values": values.float(),
        "metrics": {
            "train_pairs": len(train_idx),
            "val_pairs": len(val_idx),
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "last_batch_loss": train_losses[-1] if train_losses else float("nan"),
        },
        "config": {"epochs": int(epochs), "batch_size": int(batch_size), "lr": float(lr),
                   "val_fraction": float(val_fraction), "seed": int(seed)},
    }
    if out_path is not None:
        atomic_write(out_path, lambda f: torch.save(checkpoint, f))
    return checkpoint


# --- 4. the reward ----------------------------------------------------------------------------
class MotifReward:
    """Offline Motif reward from a :func:`train_reward_model` checkpoint.

    ``z = (g(m) - μ)/σ`` and ``R(m) = z · 1[z > q]`` where ``q`` is the checkpoint's quantile
    of ``z`` at level ``quantile`` (over distinct training messages).

    The network is frozen, so the reward is stateless (no ``state_dict``) and safe to call
    from several threads.

    Args:
        checkpoint: a path to a checkpoint, or the dict :func:`train_reward_model` returned.
        quantile: one of :data:`QUANTILE_LEVELS` (0.05 … 0.95), or ``None`` for no threshold.
        device: where inference runs.
        chunk_size: messages per forward pass.

    Raises:
        ValueError: for a quantile that is not in the table, or a file that is not a
            checkpoint of this format (:class:`~torchrl_oni.atomic.UnreadableFileError` for a
            file that cannot be read: truncated, garbage, or holding more than tensors and
            plain data; such a file is refused before any of it runs).

    Example:
        >>> import numpy as np
        >>> from torchrl_oni.captions import encode_messages
        >>> a = encode_messages(["You kill the newt!", "You find gold."] * 4)
        >>> b = encode_messages(["It's a wall.", "Nothing happens."] * 4)
        >>> ckpt = train_reward_model(a, b, np.zeros(8), epochs=1, batch_size=8, lr=1e-3)
        >>> reward = MotifReward(ckpt, quantile=0.5)
        >>> reward(a[:2], np.zeros(2, dtype=np.int64)).shape
        torch.Size([2])
    """

    def __init__(self, checkpoint, quantile: Optional[float] = 0.5, device="cpu",
                 chunk_size: int = 8192):
        source = "the checkpoint"
        if not isinstance(checkpoint, dict):
            path = Path(checkpoint)
            if not path.is_file():
                raise ValueError(f"no reward checkpoint at {path}")
            checkpoint = safe_torch_load(path, what="Motif reward checkpoint")
            source = str(path)
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
            raise UnreadableFileError(f"{source} is not a torchrl_oni Motif reward checkpoint")
        self.device = torch.device(device)
        self.chunk_size = int(chunk_size)
        self.model = MessageRewardModel()
        try:
            self.model.load_state_dict(checkpoint["model"])
            self.mean = float(checkpoint["mean"])
            self.std = float(checkpoint["std"])
            levels = [round(float(q), 2) for q in checkpoint["quantile_levels"]]
            self.quantile_table = dict(zip(levels, [float(v) for v in checkpoint["quantile_values"]]))
        except (KeyError, RuntimeError, TypeError, ValueError) as err:
            # load_state_dict's size-mismatch report spans many lines: name the problem only
            detail = f"no {err}" if isinstance(err, KeyError) else type(err).__name__
            raise UnreadableFileError(f"{source} is a damaged Motif reward checkpoint ({detail})") from None
        self.model.to(self.device).eval()
        self.quantile = quantile
        if quantile is None:
            self.cut = None
        else:
            key = round(float(quantile), 2)
            if key not in self.quantile_table or abs(key - float(quantile)) > 1e-9:
                valid = ", ".join(f"{q:g}" for q in sorted(self.quantile_table))
                raise ValueError(f"quantile must be one of {valid} (or None), got {quantile}")
            self.cut = self.quantile_table[key]

    @torch.no_grad()
    def normalized_scores(self, messages) -> torch.Tensor:
        """``z = (g(m) - μ)/σ`` for each message, ``float32[N]``."""
        messages = as_message_tensor(messages).reshape(-1, MESSAGE_LEN)
        raw = _scores(self.model, messages, self.device, self.chunk_size)
        return ((raw.double() - self.mean) / self.std).float()

    def __call__(self, messages, hashes) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]``, before count scaling."""
        z = self.normalized_scores(messages)
        return z if self.cut is None else threshold_values(z, self.cut)

