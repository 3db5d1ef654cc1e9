"""Labels made elsewhere: how much of a new run do earlier runs' labels cover?

Before a run trains on labels it cannot add to (``oni-train --annotator store --labels-from ...``,
e.g. on a GPU node no LLM server reaches), this says what it would get, from the caption stores
of earlier runs of the same task. Each store in turn is held out and stands for the new run; the
others' labels, merged as ``--labels-from`` merges them (first store first), are the labels it
would start from. Per held-out store:

- ``steps covered``: the share of the held-out run's steps whose caption the others label (the
  steps ``--annotator store`` can pay for), beside ``own``: the share its own labeller covered;
- ``captions covered``: the same over distinct captions (rare captions are most of them);
- ``agree``: on captions both label, how often the others' label equals the run's own (a
  sampling LLM, or a different prompt, answers differently from run to run).

``--write FILE`` saves the merge of all the given stores: as a labels file when FILE ends in
``.jsonl.gz`` (the labels alone, ~18x smaller than the same merge as a store, readable, small enough to keep in the
repository: :mod:`torchrl_oni.store.labels_file`), else as one caption store; its size is
printed. Labels files are accepted as inputs too: as the others' labels they count as a store would; held
out, they know the sightings of their labelled captions only (their ``own`` is 1).
Last line: JSON.

Usage::

    python benchmarks/label_transfer.py runs/sparse/staircase/retrieval-llm/seed*/captions.pt \\
        --write runs/labels_staircase.jsonl.gz
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torchrl_oni.cli_errors import OneLineArgumentParser, report  # noqa: E402
from torchrl_oni.store import LABELLED, CaptionStore  # noqa: E402
from torchrl_oni.store.labels_file import is_labels_file, load_labels, write_labels  # noqa: E402

PROG = "label_transfer.py"


def merged(stores: List[CaptionStore]) -> CaptionStore:
    """One store holding the labels of ``stores``, merged as ``--labels-from`` merges them."""
    out = CaptionStore()
    for store in stores:
        out.import_labels(store)
    return out


def with_sightings(union: CaptionStore, stores: List[CaptionStore]) -> CaptionStore:
    """``union`` with each caption's ``times_seen`` summed over ``stores`` (an import counts none),
    so that the written file lists the captions the runs saw most first, with their counts."""
    state = union.state_dict()
    hashes = state["captions"]["caption_hash"].numpy()
    total = np.zeros(len(hashes), dtype=np.int64)
    for store in stores:
        slots = store.slots(hashes).numpy()
        found = slots >= 0
        total[found] += store.caption_rows(slots[found], fields=("times_seen",))["times_seen"].numpy()
    state["captions"]["times_seen"] = torch.from_numpy(total)
    union.load_state_dict(state)
    return union


def held_out(store: CaptionStore, others: CaptionStore) -> dict:
    """What ``others``' labels cover of the run whose store is ``store``."""
    rows = store.caption_rows(store.caption_slots(), fields=("caption_hash", "label", "status", "times_seen"))
    hashes, seen = rows["caption_hash"], rows["times_seen"].double()
    own = (rows["status"] == LABELLED).numpy()
    labels, found = others.lookup(hashes)
    found = found.numpy()
    steps = float(seen.sum())
    both = own & found
    return {
        "captions": int(len(hashes)),
        "steps": int(steps),
        "own_steps_covered": store.stats()["seen_coverage"],
        "steps_covered": float(seen.numpy()[found].sum() / steps) if steps else 0.0,
        "captions_covered": float(found.mean()) if len(found) else 0.0,
        "agree": float((labels.numpy()[both] == rows["label"].numpy()[both]).mean()) if both.any() else None,
        "shared": int(both.sum()),
    }


def main(argv=None) -> int:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stores", nargs="+", help="caption stores (captions.pt) of runs of one task, or labels files "
                                             "(.jsonl[.gz]), two or more")
    p.add_argument("--write", metavar="FILE", help="save the merge of every store: a labels file if FILE ends in "
                                                   ".jsonl or .jsonl.gz, else one caption store")
    args = p.parse_args(argv)
    if len(args.stores) < 2:
        p.error("give two or more caption stores: each is held out in turn against the others")
    stores = []
    for path in args.stores:
        try:
            stores.append(load_labels(path))
        except (OSError, ValueError) as err:
            report(PROG, str(err))  # the loader names the file
            return 2
    rows = []
    for i, (path, store) in enumerate(zip(args.stores, stores)):
        row = held_out(store, merged(stores[:i] + stores[i + 1:]))
        row["store"] = path
        rows.append(row)
    print(f"Held out in turn: each store against the labels of the {len(stores) - 1} others\n")
    print(f"{'held-out store':<60}{'captions':>10}{'own':>8}{'steps covered':>15}{'captions covered':>18}"
          f"{'agree':>8}")
    for r in rows:
        agree = "-" if r["agree"] is None else f"{r['agree']:.3f}"
        print(f"{r['store'][-59:]:<60}{r['captions']:>10,}{r['own_steps_covered']:>8.3f}{r['steps_covered']:>15.3f}"
              f"{r['captions_covered']:>18.3f}{agree:>8}")
    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("own_steps_covered", "steps_covered", "captions_covered")}
    print(f"{'mean':<60}{'':>10}{mean['own_steps_covered']:>8.3f}{mean['steps_covered']:>15.3f}"
          f"{mean['captions_covered']:>18.3f}")
    result = {"benchmark": "label_transfer", "stores": len(stores), "rows": rows, **{f"mean_{k}": v for k, v in mean.items()}}
    if args.write:
        union = with_sightings(merged(stores), stores)
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        if is_labels_file(args.write):
            write_labels(union, args.write)
        else:
            union.save(args.write)
        size = os.path.getsize(args.write)
        stats = union.stats()
        print(f"\nwrote {args.write}: {stats['labelled']:,} labelled captions ({stats['positives']:,} approved), "
              + (f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"))
        result.update(written=args.write, written_labelled=int(stats["labelled"]), written_bytes=size)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
