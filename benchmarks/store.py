"""CaptionStore memory and speed at a million unique captions.

Measures, on one store filled with N unique captions (default 1,000,000):

- ``mb_per_million``: bytes of the storage tensors (allocated for N rows) plus the hash index,
  scaled to 10^6 captions (goal < 400 MB);
- ``lookup_ms``: ``lookup`` of a 4,096-hash batch (half known, half unknown; goal < 2 ms), and
  of a collector-like batch (4,096 steps over 300 distinct captions);
- ``add_ms``: ``add`` of a 4,096-caption batch, all new (while filling the last 10 %), and
  collector-like (1 % new);
- the baseline, in the same run: a Python dict ``hash -> label`` answering the same lookups
  (``tolist`` + ``dict.get`` + back to a tensor), and its memory.

If ``--seconds`` is too short to fill N captions, a smaller store is measured and the memory
is extrapolated linearly (lookups scale with log N, so a smaller store under-states them); the
table says so.

Usage::

    python benchmarks/store.py --seconds 30
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torchrl_oni.annotators.base import Provenance  # noqa: E402
from torchrl_oni.captions import MESSAGE_LEN  # noqa: E402
from torchrl_oni.store import CaptionStore  # noqa: E402

BATCH = 4096


def _messages(rng: np.random.Generator, n: int) -> np.ndarray:
    msgs = np.zeros((n, MESSAGE_LEN), dtype=np.uint8)
    msgs[:, :40] = rng.integers(32, 127, (n, 40))
    return msgs


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def _dict_lookup(table: dict, hashes: torch.Tensor):
    keys = hashes.reshape(-1).tolist()
    labels = torch.tensor([table.get(k, 0.0) for k in keys], dtype=torch.float32)
    found = torch.tensor([k in table for k in keys])
    return labels, found


def _dict_nbytes(table: dict) -> int:
    # the dict's own table plus one int key and one float value object per entry
    return sys.getsizeof(table) + len(table) * (sys.getsizeof(2**62) + sys.getsizeof(0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="time budget (approximate)")
    parser.add_argument("--n", type=int, default=1_000_000, help="unique captions to store")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    rng = np.random.default_rng(args.seed)
    t_begin = time.perf_counter()

    # Filling 1M takes ~1-3 s on a 2-core machine; the dict baseline about as long. Keep a
    # third of the budget for filling, and shrink N if even that is too little.
    probe = CaptionStore(capacity=BATCH * 4)
    probe_msgs = _messages(rng, BATCH)
    start = time.perf_counter()
    for _ in range(4):
        probe.add(probe_msgs, rng.integers(-(2**63), 2**63 - 1, BATCH, dtype=np.int64))
    per_caption_s = (time.perf_counter() - start) / (4 * BATCH) * 1.5  # + index growth, dict
    del probe
    n = args.n
    extrapolated = False
    if per_caption_s * n > args.seconds / 3:
        n = max(BATCH * 4, int(args.seconds / 3 / per_caption_s) // BATCH * BATCH)
        extrapolated = n < args.n

    hashes = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    hashes = np.unique(hashes)
    while len(hashes) < n:  # astronomically unlikely collisions
        hashes = np.unique(np.concatenate([hashes, rng.integers(-(2**63), 2**63 - 1, n - len(hashes))]))
    rng.shuffle(hashes)
    msg_pool = _messages(rng, BATCH)

    store = CaptionStore(capacity=n)
    add_new_ms = []
    for i in range(0, n, BATCH):
        h = hashes[i : i + BATCH]
        start = time.perf_counter()
        store.add(msg_pool[: len(h)], h)
        if (i >= 0.9 * n or i + BATCH >= n) and len(h) == BATCH:  # the last 10 %, or the last batch of a small N
            add_new_ms.append((time.perf_counter() - start) * 1e3)
    fill_s = time.perf_counter() - t_begin
    assert len(store) == n
    # label half the captions, as a long run would
    labelled = hashes[: n // 2]
    for i in range(0, len(labelled), 65536):
        store.set_labels(labelled[i : i + 65536], 1.0, Provenance("bench"))

    nbytes = store.nbytes()
    index_bytes = store._index.nbytes
    mb_per_million = nbytes / 1e6 * (1_000_000 / n)

    # lookups: random batch (half known), collector-like batch (few distinct captions)
    repeats = 50
    known = rng.choice(hashes, BATCH // 2)
    unknown = rng.integers(-(2**63), 2**63 - 1, BATCH // 2, dtype=np.int64)
    random_batch = torch.from_numpy(np.concatenate([known, unknown])[rng.permutation(BATCH)])
    distinct = rng.choice(hashes, 300)
    collector_batch = torch.from_numpy(distinct[rng.integers(0, 300, BATCH)].reshape(64, 64))
    lookup_ms = _median_ms(lambda: store.lookup(random_batch), repeats)
    lookup_collector_ms = _median_ms(lambda: store.lookup(collector_batch), repeats)

    # add: collector-like batch with ~1% new captions (fresh hashes each repeat)
    add_batches = []
    for _ in range(repeats):
        b = distinct[rng.integers(0, 300, BATCH)].copy()
        b[rng.random(BATCH) < 0.01] = rng.integers(-(2**63), 2**63 - 1, dtype=np.int64)
        add_batches.append(torch.from_numpy(b))
    batches = iter(add_batches)
    add_collector_ms = _median_ms(lambda: store.add(msg_pool, next(batches)), repeats)

    # baseline: a Python dict of the labels
    table = dict.fromkeys(labelled.tolist(), 1.0)
    dict_ms = _median_ms(lambda: _dict_lookup(table, random_batch), repeats // 5)
    ref_labels, ref_found = _dict_lookup(table, random_batch)
    labels, found = store.lookup(random_batch)
    assert torch.equal(found, ref_found) and torch.equal(labels, ref_labels)
    dict_mb_per_million = _dict_nbytes(table) / 1e6 * (1_000_000 / len(table))
    table = None  # free it before the save/load measurement

    # save / load, if the budget allows (one write of the whole store)
    save_s = load_s = None
    elapsed = time.perf_counter() - t_begin
    if elapsed + 3 * fill_s < args.seconds:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "captions.pt")
            start = time.perf_counter()
            store.save(path)
            save_s = time.perf_counter() - start
            start = time.perf_counter()
            loaded = CaptionStore.load(path)
            load_s = time.perf_counter() - start
            assert len(loaded) == len(store)
            del loaded

    note = f"N={n:,}" + (f" (extrapolated to 1M: --seconds too small for {args.n:,})" if extrapolated else "")
    rows = [
        ("captions stored", note, ""),
        ("memory, MB per 1M captions", f"{mb_per_million:.1f}", "goal < 400"),
        ("  of which hash index, MB per 1M", f"{index_bytes / 1e6 * 1e6 / n:.1f}", ""),
        ("  baseline: Python dict hash->label, MB per 1M", f"{dict_mb_per_million:.1f}", "labels only, no bytes"),
        ("lookup 4,096 hashes (half unknown), ms", f"{lookup_ms:.3f}", "goal < 2"),
        ("lookup 4,096 steps / 300 captions, ms", f"{lookup_collector_ms:.3f}", ""),
        ("  baseline: dict lookup 4,096, ms", f"{dict_ms:.3f}", f"store is {dict_ms / lookup_ms:.1f}x faster"),
        ("add 4,096 new captions (store ~full), ms", f"{np.median(add_new_ms):.3f}", ""),
        ("add 4,096 steps, 1% new, ms", f"{add_collector_ms:.3f}", ""),
        ("fill time, s", f"{fill_s:.2f}", ""),
        ("save, s", "skipped (budget)" if save_s is None else f"{save_s:.2f}", ""),
        ("load, s", "skipped (budget)" if load_s is None else f"{load_s:.2f}", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'CaptionStore benchmark':<{width}}  {'value':>14}  note")
    print("-" * (width + 40))
    for name, value, extra in rows:
        print(f"{name:<{width}}  {value:>14}  {extra}")
    result = {
        "n": n,
        "extrapolated": extrapolated,
        "mb_per_million": round(mb_per_million, 2),
        "index_mb_per_million": round(index_bytes / n, 2),
        "dict_mb_per_million": round(dict_mb_per_million, 2),
        "lookup_ms": round(lookup_ms, 4),
        "lookup_collector_ms": round(lookup_collector_ms, 4),
        "dict_lookup_ms": round(dict_ms, 4),
        "lookup_speedup_vs_dict": round(dict_ms / lookup_ms, 2),
        "add_ms": round(float(np.median(add_new_ms)), 4),
        "add_collector_ms": round(add_collector_ms, 4),
        "save_s": None if save_s is None else round(save_s, 3),
        "load_s": None if load_s is None else round(load_s, 3),
        "seconds": round(time.perf_counter() - t_begin, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
