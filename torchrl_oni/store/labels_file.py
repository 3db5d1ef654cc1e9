"""Caption labels as a small text file that travels: what ``--labels-from`` reads besides a store.

A caption store (``captions.pt``) holds every caption a run saw, labelled or not, as 256-byte
rows: 4.6 MB for the 16k captions of a 3M-frame run, a binary file only this package reads. The
labels alone, as JSON lines compressed with gzip, are small (6,876 labels: 107 KiB, against
1.9 MiB as a store), can be read with ``zcat | head``, kept in a repository, and run nothing
when read. The sparse-task
experiment keeps the embedded LLM's labels of its captions in one (``benchmarks/labels/``), so
that a GPU node, which reaches no LLM, trains on them from any checkout.

Layout (a name ending in ``.jsonl`` or ``.jsonl.gz`` is what tells a labels file from a store;
whether it is compressed is read from its first bytes):

==========  ==========================================================================
line        content
==========  ==========================================================================
1           ``{"format": "torchrl_oni.labels", "version": 1, "captions": N, "approved": P}``
2 … N + 1   one labelled caption each, most seen first:
            ``{"caption": str, "label": float, "score": float | null, "seen": int,
            "annotator": str, "model": str, "prompt": str}``
==========  ==========================================================================

``caption`` is the message text (latin-1 characters only: the bytes NetHack shows; the caption's
hash is computed again from them, so it matches the store it came from), ``label`` the label
(1.0 progress, 0.0 not; soft labels allowed), ``score`` the annotator's probability when it gave
one, ``seen`` how many steps of the source run(s) showed the caption (information for a reader:
a run importing the labels counts its own sightings), and the last three the label's provenance
(:class:`~torchrl_oni.annotators.base.Provenance`: an LLM's label stays that LLM's).

Example:
    >>> import os, tempfile
    >>> from torchrl_oni.annotators.base import Provenance
    >>> from torchrl_oni.captions import encode_messages, hash_messages
    >>> from torchrl_oni.store import CaptionStore
    >>> from torchrl_oni.store.labels_file import load_labels, write_labels
    >>> messages = encode_messages(["You kill the newt!", "It's a wall.", "You kill the newt!"])
    >>> store = CaptionStore()
    >>> _ = store.add(messages, hash_messages(messages))
    >>> _ = store.set_labels(hash_messages(messages[:2]), [1.0, 0.0], Provenance("openai", "qwen", "short-v1"))
    >>> path = os.path.join(tempfile.mkdtemp(), "labels.jsonl.gz")
    >>> write_labels(store, path)["captions"]
    2
    >>> again = load_labels(path)        # a CaptionStore holding the labelled captions
    >>> again.lookup(hash_messages(messages))[0].tolist(), again.provenances[0].model
    ([1.0, 0.0, 1.0], 'qwen')
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
from pathlib import Path
from typing import Dict, Union

import numpy as np
import torch

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.atomic import UnreadableFileError, atomic_write
from torchrl_oni.captions import (CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN, encode_messages, hash_messages,
                                  message_bytes)
from torchrl_oni.store.status import LABELLED

__all__ = ["LABELS_FORMAT", "LABELS_FILE_SUFFIXES", "is_labels_file", "write_labels", "read_labels", "load_labels"]

LABELS_FORMAT = "torchrl_oni.labels"
_VERSION = 1
LABELS_FILE_SUFFIXES = (".jsonl", ".jsonl.gz")
_GZIP_MAGIC = b"\x1f\x8b"

PathLike = Union[str, os.PathLike]


def is_labels_file(path: PathLike) -> bool:
    """Whether ``path`` is named as a labels file (``.jsonl`` or ``.jsonl.gz``), not a caption store."""
    return str(path).endswith(LABELS_FILE_SUFFIXES)


def write_labels(store, path: PathLike) -> Dict[str, int]:
    """Writes the labelled captions of ``store`` to ``path``, atomically; gzip-compressed when
    the name ends in ``.gz`` (written reproducibly: the same labels give the same bytes).

    Returns:
        ``captions`` (lines written), ``approved`` (labels ≥ 0.5), ``bytes`` (the file's size).
    """
    with store.lock:
        rows = store.caption_rows(store.caption_slots(status=LABELLED),
                                  fields=(MESSAGE_KEY, "label", "score", "times_seen", "provenance"))
        provenances = list(store.provenances)
    seen = rows["times_seen"].numpy()
    order = np.argsort(-seen, kind="stable")  # most seen first, then oldest
    messages, labels = rows[MESSAGE_KEY].numpy(), rows["label"].numpy()
    scores, pids = rows["score"].numpy(), rows["provenance"].numpy()
    unknown = Provenance("unknown")
    lines = [json.dumps({"format": LABELS_FORMAT, "version": _VERSION, "captions": int(len(order)),
                         "approved": int((labels >= 0.5).sum())})]
    for i in order.tolist():
        p = provenances[pids[i]] if 0 <= pids[i] < len(provenances) else unknown
        score = float(scores[i])
        lines.append(json.dumps({
            "caption": message_bytes(messages[i]).decode("latin-1"), "label": float(labels[i]),
            "score": None if math.isnan(score) else round(score, 6), "seen": int(seen[i]),
            "annotator": p.annotator, "model": p.model, "prompt": p.prompt_version}))
    data = ("\n".join(lines) + "\n").encode("utf-8")

    def write(f) -> None:
        if str(path).endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
                gz.write(data)
        else:
            f.write(data)

    written = atomic_write(path, write)
    return {"captions": int(len(order)), "approved": int((labels >= 0.5).sum()),
            "bytes": os.path.getsize(written)}


def read_labels(path: PathLike):
    """Reads a labels file into a new :class:`~torchrl_oni.store.CaptionStore` holding its
    captions as labelled (``times_seen`` from ``seen``). A caption listed twice keeps its first line.

    Raises:
        FileNotFoundError: no such file.
        UnreadableFileError: (a ``ValueError``) not a labels file, a newer version, or a line that
            is not a caption's label; one sentence naming the file and the line.
    """
    from torchrl_oni.store import CaptionStore

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no labels file at {path}")
    raw = path.read_bytes()
    try:
        text = (gzip.decompress(raw) if raw[:2] == _GZIP_MAGIC else raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise UnreadableFileError(f"{path} is not a readable labels file ({err})") from None
    lines = io.StringIO(text)
    header = _json_line(path, 1, lines.readline())
    if not isinstance(header, dict) or header.get("format") != LABELS_FORMAT:
        raise UnreadableFileError(f"{path} is not a labels file (its first line has no "
                                  f"\"format\": \"{LABELS_FORMAT}\")")
    if header.get("version") != _VERSION:
        raise UnreadableFileError(f"{path}: unsupported labels file version {header.get('version')}")
    texts, labels, scores, seen, pids = [], [], [], [], []
    provenance_ids: Dict[tuple, int] = {}
    for n, line in enumerate(lines, start=2):
        if not line.strip():
            continue
        row = _row(path, n, _json_line(path, n, line))
        key = (row["annotator"], row["model"], row["prompt"])
        pids.append(provenance_ids.setdefault(key, len(provenance_ids)))
        texts.append(row["caption"])
        labels.append(row["label"])
        scores.append(math.nan if row["score"] is None else row["score"])
        seen.append(row["seen"])
    count = len(texts)
    if isinstance(header.get("captions"), int) and header["captions"] != count:
        raise UnreadableFileError(f"{path} holds {count} captions where its first line says {header['captions']} "
                                  f"(a truncated or edited file)")
    messages = encode_messages(texts)  # exact: every caption was checked to be latin-1 and to fit
    hashes = hash_messages(messages)
    _, first = np.unique(hashes, return_index=True)
    keep = np.sort(first)  # a repeated caption keeps its first line
    store = CaptionStore(capacity=max(len(keep), 1))
    state = store.state_dict()
    template = state["captions"]
    columns = {
        MESSAGE_KEY: torch.from_numpy(messages[keep]),
        CAPTION_HASH_KEY: torch.from_numpy(hashes[keep]),
        "label": torch.tensor(labels, dtype=torch.float32)[keep],
        "score": torch.tensor(scores, dtype=torch.float32)[keep],
        "status": torch.full((len(keep),), LABELLED, dtype=template["status"].dtype),
        "times_seen": torch.tensor(seen, dtype=torch.int64)[keep],
        "attempts": torch.zeros(len(keep), dtype=template["attempts"].dtype),
        "provenance": torch.tensor(pids, dtype=template["provenance"].dtype)[keep],
    }
    missing = set(template) - set(columns)
    if missing:  # the caption table gained a column this reader does not fill
        raise RuntimeError(f"read_labels: no value for the store's columns {sorted(missing)}")
    state["captions"] = columns
    state["provenances"] = [list(k) for k in provenance_ids]
    store.load_state_dict(state)
    return store


def load_labels(path: PathLike):
    """The labels ``--labels-from`` means by ``path``: a labels file (:func:`read_labels`) or a
    caption store written by :meth:`~torchrl_oni.store.CaptionStore.save`, as a ``CaptionStore``.

    Raises:
        FileNotFoundError, UnreadableFileError: as the reader of that kind of file raises them.
    """
    from torchrl_oni.store import CaptionStore

    return read_labels(path) if is_labels_file(path) else CaptionStore.load(path)


def _json_line(path: Path, n: int, line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise UnreadableFileError(f"{path}, line {n}: not JSON ({err.msg})") from None


def _row(path: Path, n: int, row) -> dict:
    """One caption's line, checked; an UnreadableFileError naming the line otherwise."""
    where = f"{path}, line {n}"
    if not isinstance(row, dict):
        raise UnreadableFileError(f"{where}: a caption's line is a JSON object")
    missing = [k for k in ("caption", "label") if k not in row]
    if missing:
        raise UnreadableFileError(f"{where}: no \"{missing[0]}\"")
    out = {"score": row.get("score"), "seen": row.get("seen", 0), "caption": row["caption"], "label": row["label"],
           "annotator": row.get("annotator", "unknown"), "model": row.get("model", ""),
           "prompt": row.get("prompt", "")}
    if not isinstance(out["caption"], str):
        raise UnreadableFileError(f"{where}: \"caption\" is not a string")
    try:
        size = len(out["caption"].encode("latin-1"))
    except UnicodeEncodeError:
        raise UnreadableFileError(f"{where}: the caption has characters NetHack cannot show (latin-1 only)") from None
    if size > MESSAGE_LEN or "\0" in out["caption"]:
        raise UnreadableFileError(f"{where}: the caption is over {MESSAGE_LEN} bytes or holds a NUL")
    for key in ("label", "score"):
        value = out[key]
        if value is None and key == "score":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UnreadableFileError(f"{where}: \"{key}\" is not a finite number")
    if isinstance(out["seen"], bool) or not isinstance(out["seen"], int) or out["seen"] < 0:
        raise UnreadableFileError(f"{where}: \"seen\" is not a count")
    for key in ("annotator", "model", "prompt"):
        if not isinstance(out[key], str):
            raise UnreadableFileError(f"{where}: \"{key}\" is not a string")
    return out
