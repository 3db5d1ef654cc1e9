"""Offline Motif's command-line tools: ``oni-collect-pairs``, ``oni-annotate-pairs`` and
``oni-train-reward``, over the library functions of :mod:`torchrl_oni.rewards.motif`.

Each tool reads its files, calls one library function and prints one line; a bad input is one
``prog: error: ...`` line and exit status 2 (:func:`~torchrl_oni.cli_errors.report`).
``python -m torchrl_oni.rewards.motif_cli {collect,annotate,train} ...`` runs them too.

Example:
    >>> from torchrl_oni.rewards.motif_cli import collect_pairs_main
    >>> collect_pairs_main(["missing.txt", "--out", "pairs.npz", "--num-pairs", "3"])
    2
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from torchrl_oni.atomic import UnreadableFileError
from torchrl_oni.captions import MESSAGE_LEN, encode_messages
from torchrl_oni.cli_errors import OneLineArgumentParser, overwritten_input, report
from torchrl_oni.rewards.motif import (
    FAILED,
    LABELLED,
    NOT_ASKED,
    TIED,
    _fingerprint,
    _load_arrays,
    _save_npz_atomic,
    annotate_pairs_async,
    collect_pairs,
    load_annotations,
    train_reward_model,
)

__all__ = ["collect_pairs_main", "annotate_pairs_main", "train_reward_main", "main"]

MAX_PAIRS = 100_000_000  # --num-pairs: 100 M pairs are 51 GB of captions already
MAX_SEED = 2 ** 32  # numpy's seeds


def _check_outputs(out: str, *inputs: str) -> None:
    if overwritten_input(out, inputs):
        raise _CliError(f"--out {out} is one of the input files; choose another file")
    if Path(out).is_dir():
        raise _CliError(f"--out {out} is a folder; give a file")


def _check_seed(seed: int) -> None:
    if not 0 <= seed < MAX_SEED:
        raise _CliError(f"--seed must be in [0, 2**32), got {seed}")


class _CliError(Exception):
    pass


def _run_cli(prog: str, build: Callable[[OneLineArgumentParser], None], body, argv) -> int:
    parser = OneLineArgumentParser(prog=prog, description=build.__doc__)
    build(parser)
    args = parser.parse_args(argv)
    try:
        body(args)
    except (_CliError, ValueError, OSError, KeyError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return report(prog, msg)
    return 0


def _load_messages(path: str) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise _CliError(f"no such file: {path}")
    if p.suffix == ".txt":
        return encode_messages(p.read_text(encoding="latin-1").splitlines())
    if p.suffix in (".npy", ".npz"):
        arrays = _load_arrays(p, "messages file")
        if not arrays:
            raise _CliError(f"{path}: no arrays in the file")
        arr = arrays["message"] if "message" in arrays else next(iter(arrays.values()))
    else:
        raise _CliError(f"{path}: expected .npy, .npz (key 'message') or .txt (one caption a line)")
    if arr.ndim < 2 or arr.shape[-1] != MESSAGE_LEN:
        raise _CliError(f"{path}: expected messages of shape [..., {MESSAGE_LEN}], got {arr.shape}")
    return arr.reshape(-1, MESSAGE_LEN).astype(np.uint8)


def _load_pairs(path: str) -> Tuple[np.ndarray, np.ndarray]:
    p = Path(path)
    if not p.is_file():
        raise _CliError(f"no such file: {path}")
    try:
        data = _load_arrays(p, "pairs file", ("first", "second"))
    except UnreadableFileError as exc:
        raise _CliError(f"{exc}; expected a pairs file with 'first' and 'second' arrays") from None
    return data["first"].astype(np.uint8), data["second"].astype(np.uint8)


def _make_annotator(spec: str, kwargs_json: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _CliError(f"--annotator must look like 'package.module:Factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise _CliError(f"cannot load annotator {spec!r}: {exc}") from exc
    try:
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except json.JSONDecodeError as exc:
        raise _CliError(f"--annotator-kwargs is not valid JSON: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise _CliError("--annotator-kwargs must be a JSON object")
    try:
        annotator = factory(**kwargs)
    except TypeError as exc:  # an argument the factory does not take
        raise _CliError(f"--annotator {spec} with --annotator-kwargs {kwargs_json}: {exc}") from None
    if not callable(getattr(annotator, "compare", None)):
        raise _CliError(f"{spec} did not build an annotator with a compare() method")
    return annotator


def _collect_args(parser):
    """Draw pairs of distinct captions from a file of messages (offline Motif, step 1)."""
    parser.add_argument("messages", help=".npy/.npz uint8[N,256] messages, or .txt one caption a line")
    parser.add_argument("--out", required=True, help="pairs .npz to write")
    parser.add_argument("--num-pairs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--include-empty", action="store_true", help="also pair the empty message")


def collect_pairs_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``oni-collect-pairs``."""

    def body(args):
        if not 1 <= args.num_pairs <= MAX_PAIRS:
            raise _CliError(f"--num-pairs must be in [1, {MAX_PAIRS:,}], got {args.num_pairs}")
        _check_seed(args.seed)
        _check_outputs(args.out, args.messages)
        first, second = collect_pairs(_load_messages(args.messages), args.num_pairs,
                                      include_empty=args.include_empty, seed=args.seed)
        _save_npz_atomic(Path(args.out), first=first, second=second)
        print(f"wrote {len(first)} pairs to {args.out}")

    return _run_cli("oni-collect-pairs", _collect_args, body, argv)


def _annotate_args(parser):
    """Annotate caption pairs with an LLM annotator, chunk by chunk; re-run to resume (step 2)."""
    parser.add_argument("pairs", help="pairs .npz from oni-collect-pairs")
    parser.add_argument("--out", required=True, help="annotations .npz (resumed if it exists)")
    parser.add_argument("--annotator", required=True,
                        help="'package.module:Factory' building an object with async compare()")
    parser.add_argument("--annotator-kwargs", default="{}", help="JSON object passed to the factory")
    parser.add_argument("--chunk-size", type=int, default=100)
    parser.add_argument("--max-chunks", type=int, default=None)
    parser.add_argument("--retry-failed", action="store_true")


def annotate_pairs_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``oni-annotate-pairs``."""

    def body(args):
        if args.chunk_size < 1:
            raise _CliError("--chunk-size must be at least 1")
        if args.max_chunks is not None and args.max_chunks < 1:
            raise _CliError(f"--max-chunks must be at least 1, got {args.max_chunks}")
        _check_outputs(args.out, args.pairs)
        first, second = _load_pairs(args.pairs)
        annotator = _make_annotator(args.annotator, args.annotator_kwargs)

        async def go():
            try:
                return await annotate_pairs_async(
                    first, second, annotator, args.out, chunk_size=args.chunk_size,
                    max_chunks=args.max_chunks, retry_failed=args.retry_failed,
                    on_chunk=lambda done, total: print(f"{done}/{total} pairs done", flush=True),
                )
            finally:
                closer = getattr(annotator, "aclose", None)
                if closer is not None:
                    result = closer()
                    if inspect.isawaitable(result):
                        await result

        try:
            state = asyncio.run(go())
        except (OSError, asyncio.TimeoutError) as exc:
            raise _CliError(f"{exc or type(exc).__name__}; progress is saved in {args.out}, "
                            "run again to resume") from exc
        status = state["status"]
        print(f"labelled {int((status == LABELLED).sum())}, tied without a call "
              f"{int((status == TIED).sum())}, failed {int((status == FAILED).sum())}, "
              f"pending {int((status == NOT_ASKED).sum())} -> {args.out}")

    return _run_cli("oni-annotate-pairs", _annotate_args, body, argv)


def _train_args(parser):
    """Fit a reward model to annotated pairs and write a Motif checkpoint (step 3)."""
    parser.add_argument("pairs", help="pairs .npz from oni-collect-pairs")
    parser.add_argument("annotations", help="annotations .npz from oni-annotate-pairs")
    parser.add_argument("--out", required=True, help="checkpoint .pt to write")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=777)
    parser.add_argument("--device", default="cpu")


MAX_EPOCHS, MAX_BATCH = 100_000, 2 ** 24


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _CliError(f"--device {name}: {first}") from None


def train_reward_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``oni-train-reward``."""

    def body(args):
        if args.epochs < 1 or args.batch_size < 1 or not args.lr > 0:
            raise _CliError("--epochs and --batch-size must be at least 1 and --lr positive")
        if args.epochs > MAX_EPOCHS or args.batch_size > MAX_BATCH or not args.lr <= 1.0:
            raise _CliError(f"--epochs must be at most {MAX_EPOCHS:,}, --batch-size at most {MAX_BATCH:,} and "
                            f"--lr at most 1, got {args.epochs}, {args.batch_size} and {args.lr}")
        _check_seed(args.seed)
        _check_outputs(args.out, args.pairs, args.annotations)
        _check_device(args.device)
        if not 0 <= args.val_fraction < 1:
            raise _CliError("--val-fraction must be in [0, 1)")
        first, second = _load_pairs(args.pairs)
        state = load_annotations(args.annotations)
        if state["fingerprint"] != _fingerprint(first, second):
            raise _CliError(f"{args.annotations} was made for other pairs than {args.pairs}")
        ckpt = train_reward_model(first, second, state["preference"], args.out,
                                  epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                                  val_fraction=args.val_fraction, seed=args.seed,
                                  device=args.device)
        m = ckpt["metrics"]
        print(f"train pairs {m['train_pairs']}, val pairs {m['val_pairs']}, "
              f"val loss {m['val_loss']:.4f}, val accuracy {m['val_accuracy']:.3f} -> {args.out}")

    return _run_cli("oni-train-reward", _train_args, body, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m torchrl_oni.rewards.motif_cli {collect,annotate,train} ...`` (or ``...rewards.motif``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"collect": collect_pairs_main, "annotate": annotate_pairs_main,
                "train": train_reward_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m torchrl_oni.rewards.motif {collect,annotate,train} ...",
              file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
