"""Offline Motif's commands: ``oni-collect-pairs``, ``oni-annotate-pairs`` and ``oni-train-reward``,
over the library functions of :mod:`torchrl_oni.rewards.motif`. They take what an ``oni-train``
run leaves and the annotator flags ``oni-train`` takes::

    oni-collect-pairs RUN --out pairs.npz --num-pairs 20000            # a run folder (its captions.pt)
    oni-annotate-pairs pairs.npz --out annotations.npz --annotator llm --llm-url http://gpu:8000/v1
    oni-train-reward pairs.npz annotations.npz --out reward.pt
    oni-train --intrinsic-reward motif --reward-model reward.pt

1. ``oni-collect-pairs`` reads a run folder (its caption store, ``captions.pt``, or the
   ``--caption-store`` its ``config.yaml`` names), a caption store file, or messages
   (``.npy``/``.npz`` ``uint8[N, 256]``, ``.txt`` one caption a line), and draws pairs as Motif
   does: each caption in proportion to how often it was seen (the store's ``times_seen``; a
   message file counts its rows) (:func:`~torchrl_oni.rewards.motif.collect_frequency_pairs`).
2. ``oni-annotate-pairs`` has them compared chunk by chunk, saving after each chunk; re-run the
   same command to resume. Its annotator flags (``--annotator {llm,scripted,teacher}``,
   ``--llm-url URL [URL ...]``, ``--llm-model``, ``--llm-api-key``, ``--goal``...) are generated
   from ``oni-train``'s ``annotation`` section (:func:`annotator_settings`) and the annotator is
   built by its ``--annotator`` entry (:mod:`torchrl_oni.train.annotator_types`): without
   ``--llm-url`` the embedded CPU LLM is started in a process of its own and stopped at the end,
   as ``oni-train`` does. ``--annotator package.module:Factory`` with ``--annotator-kwargs JSON``
   (the former form) still works for this release, with a warning.
3. ``oni-train-reward`` fits the reward model and writes the checkpoint
   ``oni-train --intrinsic-reward motif --reward-model`` reads.

Each tool reads its files, calls the library and prints one line; a bad input is one
``prog: error: ...`` line and exit status 2 (:func:`~torchrl_oni.cli_errors.report`).
``python -m torchrl_oni.train.motif_cli {collect,annotate,train} ...`` runs them too.

Example:
    >>> from torchrl_oni.train.motif_cli import collect_pairs_main
    >>> collect_pairs_main(["missing.txt", "--out", "pairs.npz", "--num-pairs", "3"])
    2
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..atomic import UnreadableFileError
from ..captions import MESSAGE_LEN, encode_messages, hash_messages
from ..cli_errors import OneLineArgumentParser, overwritten_input, report
from ..config_tree import add_arguments, apply_arguments, leaves
from ..rewards.motif import (
    FAILED,
    LABELLED,
    NOT_ASKED,
    TIED,
    _fingerprint,
    _load_arrays,
    _save_npz_atomic,
    annotate_pairs_async,
    collect_frequency_pairs,
    collect_pairs,
    load_annotations,
    store_captions,
    train_reward_model,
)
from ..run_folder import CAPTION_STORE_NAME, CONFIG_NAME

__all__ = ["collect_pairs_main", "annotate_pairs_main", "train_reward_main", "main", "annotator_settings"]

MAX_PAIRS = 100_000_000  # --num-pairs: 100 M pairs are 51 GB of captions already
MAX_SEED = 2 ** 32  # numpy's seeds

ONLINE_ONLY = ("caption_store", "label_budget", "label_schedule", "query_selection")
"""Settings of the ``annotation`` section that only mean something while training (which
captions to ask, and when): ``oni-annotate-pairs`` takes every other one."""


def annotator_settings() -> Tuple[str, ...]:
    """The flat names of the ``annotation`` settings ``oni-annotate-pairs`` takes as flags: all
    but :data:`ONLINE_ONLY` (a setting added to the section is a flag of both commands).

    Example:
        >>> settings = annotator_settings()
        >>> "llm_url" in settings and "llm_api_key" in settings and "label_budget" not in settings
        True
    """
    from .config import AnnotationConfig

    return tuple(leaf.flat for leaf in leaves(AnnotationConfig) if leaf.flat not in ONLINE_ONLY)


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


class _Interrupted(Exception):
    """Ctrl-C, with what the user should know (one line)."""


def _run_cli(prog: str, build: Callable[[OneLineArgumentParser], None], body, argv) -> int:
    parser = OneLineArgumentParser(prog=prog, description=build.__doc__)
    build(parser)
    args = parser.parse_args(argv)
    try:
        body(args)
    except (_CliError, ValueError, OSError, KeyError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return report(prog, msg)
    except (_Interrupted, KeyboardInterrupt) as exc:
        print(f"\n{prog}: {exc or 'interrupted'}", file=sys.stderr, flush=True)
        return 130
    return 0


# ---------------------------------------------------------------------------- 1. oni-collect-pairs
def _load_messages(path: Path) -> np.ndarray:
    """The messages of a ``.npy``/``.npz``/``.txt`` file, ``uint8[N, 256]``."""
    if path.suffix == ".txt":
        return encode_messages(path.read_text(encoding="latin-1").splitlines())
    arrays = _load_arrays(path, "messages file")
    if not arrays:
        raise _CliError(f"{path}: no arrays in the file")
    arr = arrays["message"] if "message" in arrays else next(iter(arrays.values()))
    if arr.ndim < 2 or arr.shape[-1] != MESSAGE_LEN:
        raise _CliError(f"{path}: expected messages of shape [..., {MESSAGE_LEN}], got {arr.shape}")
    return arr.reshape(-1, MESSAGE_LEN).astype(np.uint8)


def _store_in_run(run_dir: Path) -> Path:
    """The caption store of an ``oni-train`` run folder: its ``captions.pt``, or the
    ``--caption-store`` its ``config.yaml`` names."""
    candidate = run_dir / CAPTION_STORE_NAME
    if candidate.is_file():
        return candidate
    from .config import TrainConfig
    from .reward_types import reward_types

    named = None
    try:
        named = TrainConfig.from_yaml((run_dir / CONFIG_NAME).read_text(encoding="utf-8")).annotation.caption_store
    except Exception:  # noqa: BLE001 - no config, or one that cannot be read: only captions.pt counts then
        pass
    if named and Path(named).is_file():
        return Path(named)
    labelled = ", ".join(sorted(name for name, t in reward_types().items() if t.needs_annotator))
    raise _CliError(f"{run_dir} holds no caption store ({CAPTION_STORE_NAME}); oni-train writes one for an "
                    f"--intrinsic-reward an annotator labels ({labelled}): give such a run, a store file or messages")


def _load_store(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    from ..store import CaptionStore

    try:
        store = CaptionStore.load(path)
        return store_captions(store)
    except (FileNotFoundError, UnreadableFileError):
        raise
    except Exception as err:  # noqa: BLE001 - a file of the right format with wrong contents
        raise UnreadableFileError(f"{path} is a damaged CaptionStore file ({type(err).__name__})") from None


def _load_captions(source: str) -> Tuple[np.ndarray, Optional[np.ndarray], Path]:
    """``(messages, times_seen or None, the file read)`` of a run folder, a store or a messages file."""
    path = Path(source)
    if path.is_dir():
        path = _store_in_run(path)
        return (*_load_store(path), path)
    if not path.is_file():
        raise _CliError(f"no such file or folder: {source}")
    if path.suffix == ".pt":
        return (*_load_store(path), path)
    if path.suffix in (".npy", ".npz", ".txt"):
        return _load_messages(path), None, path
    raise _CliError(f"{source}: expected an oni-train run folder, a caption store (.pt), .npy/.npz messages "
                    "(key 'message') or .txt (one caption a line)")


def _collect_args(parser):
    """Draw pairs of captions from an oni-train run, a caption store or a file of messages
    (offline Motif, step 1)."""
    parser.add_argument("source", metavar="RUN_OR_CAPTIONS",
                        help=f"an oni-train run folder (its {CAPTION_STORE_NAME}), a caption store (.pt), .npy/.npz "
                        "uint8[N,256] messages, or .txt one caption a line")
    parser.add_argument("--out", required=True, help="pairs .npz to write")
    parser.add_argument("--num-pairs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--include-empty", action="store_true", help="also pair the empty message")
    parser.add_argument("--sampling", choices=("frequency", "uniform"), default="frequency",
                        help="frequency: each caption as often as it was seen, the two of a pair drawn independently "
                        "(Motif; a pair of one caption twice is a tie, never sent to the annotator); uniform: every "
                        "distinct caption alike, two different ones per pair (default: frequency)")


def collect_pairs_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``oni-collect-pairs``."""

    def body(args):
        if not 1 <= args.num_pairs <= MAX_PAIRS:
            raise _CliError(f"--num-pairs must be in [1, {MAX_PAIRS:,}], got {args.num_pairs}")
        _check_seed(args.seed)
        _check_outputs(args.out, args.source)
        messages, times_seen, path = _load_captions(args.source)
        _check_outputs(args.out, str(path))
        if args.sampling == "frequency":
            first, second = collect_frequency_pairs(messages, args.num_pairs, times_seen=times_seen,
                                                    include_empty=args.include_empty, seed=args.seed)
        else:
            first, second = collect_pairs(messages, args.num_pairs, include_empty=args.include_empty, seed=args.seed)
        _save_npz_atomic(Path(args.out), first=first, second=second)
        distinct = len(np.unique(hash_messages(np.concatenate([first, second]))))
        ties = int((first == second).all(axis=1).sum())
        tied = f"; {ties} pairs of one caption twice (ties, never sent)" if ties else ""
        print(f"wrote {len(first)} pairs of {distinct} distinct captions from {path} ({args.sampling}){tied} "
              f"-> {args.out}")

    return _run_cli("oni-collect-pairs", _collect_args, body, argv)


# --------------------------------------------------------------------------- 2. oni-annotate-pairs
def _load_pairs(path: str) -> Tuple[np.ndarray, np.ndarray]:
    p = Path(path)
    if not p.is_file():
        raise _CliError(f"no such file: {path}")
    try:
        data = _load_arrays(p, "pairs file", ("first", "second"))
    except UnreadableFileError as exc:
        raise _CliError(f"{exc}; expected a pairs file with 'first' and 'second' arrays") from None
    return data["first"].astype(np.uint8), data["second"].astype(np.uint8)


LEGACY_HINT = "--annotator package.module:Factory"


def _make_annotator(spec: str, kwargs_json: str):
    """The annotator of the former ``--annotator package.module:Factory --annotator-kwargs JSON``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _CliError(f"--annotator must be a name (see --help) or 'package.module:Factory', got {spec!r}")
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


def _split_legacy_annotator(argv: List[str]) -> Tuple[Optional[str], List[str]]:
    """``(spec, the other arguments)``: the former ``--annotator package.module:Factory`` (a
    value with a colon, which no registered name has) is taken out before the generated flags
    are parsed."""
    rest: List[str] = []
    spec = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg == "--annotator" and i + 1 < len(argv) and ":" in argv[i + 1]:
            spec, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--annotator=") and ":" in arg.partition("=")[2]:
            spec, i = arg.partition("=")[2], i + 1
            continue
        rest.append(arg)
        i += 1
    return spec, rest


def _check_resumable(out: str, pairs: str, first: np.ndarray, second: np.ndarray) -> None:
    """An existing ``--out`` must hold annotations of these pairs (checked before any annotator
    or LLM server starts)."""
    if not Path(out).exists():
        return
    state = load_annotations(out)
    if state["fingerprint"] != _fingerprint(first, second) or len(state["status"]) != len(first):
        raise _CliError(f"{out} holds annotations of other pairs than {pairs}; use another --out")


def _annotate_args(parser):
    """Annotate caption pairs, chunk by chunk, with oni-train's annotators; re-run the same
    command to resume (offline Motif, step 2)."""
    from .config import AnnotationConfig

    parser.add_argument("pairs", help="pairs .npz from oni-collect-pairs")
    parser.add_argument("--out", required=True, help="annotations .npz (resumed if it exists)")
    parser.add_argument("--chunk-size", type=int, default=100, help="pairs per annotator call and per save")
    parser.add_argument("--max-chunks", type=int, default=None, help="stop after this many chunks")
    parser.add_argument("--retry-failed", action="store_true", help="ask again the pairs whose answer failed")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the annotator (the teacher's noise)")
    parser.add_argument("--annotator-kwargs", default=None, metavar="JSON",
                        help=f"deprecated, with the deprecated {LEGACY_HINT}: keyword arguments of the factory")
    group = parser.add_argument_group("annotator (as oni-train)")
    add_arguments(group, AnnotationConfig, only=annotator_settings())


def _build_annotator(args):
    """``(annotator, server handle or None)`` from the generated flags, by the ``--annotator``
    entry of the registry (an embedded LLM is started there)."""
    import logging

    from .annotator_types import get_annotator
    from .cli import guard_api_key
    from .config import AnnotationConfig

    if args.annotator_kwargs is not None:
        raise _CliError(f"--annotator-kwargs goes with the deprecated {LEGACY_HINT}; give the settings of "
                        "--annotator NAME as flags (see --help)")
    ann = apply_arguments(AnnotationConfig(), args)
    ann.validate()
    for line in guard_api_key(ann, from_command_line=True):
        print(f"oni-annotate-pairs: warning: {line}", file=sys.stderr, flush=True)
    entry = get_annotator(ann.annotator)
    if entry.llm:  # say what takes a minute: the embedded LLM starting
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("torchrl_oni").setLevel(logging.INFO)
    try:
        return entry.build(ann, seed=args.seed)
    except RuntimeError as err:  # a server that cannot be reached, a model that is not served
        raise _CliError(str(err)) from None


def annotate_pairs_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``oni-annotate-pairs``."""
    from .config import AnnotationConfig

    legacy, argv = _split_legacy_annotator(list(sys.argv[1:] if argv is None else argv))

    def body(args):
        if args.chunk_size < 1:
            raise _CliError("--chunk-size must be at least 1")
        if args.max_chunks is not None and args.max_chunks < 1:
            raise _CliError(f"--max-chunks must be at least 1, got {args.max_chunks}")
        _check_seed(args.seed)
        _check_outputs(args.out, args.pairs)
        first, second = _load_pairs(args.pairs)
        _check_resumable(args.out, args.pairs, first, second)
        if legacy is not None:
            given = [leaf.flag for leaf in leaves(AnnotationConfig) if hasattr(args, leaf.flat)]
            if given:
                raise _CliError(f"{given[0]} goes with --annotator NAME, not the deprecated {LEGACY_HINT}")
            annotator, server = _make_annotator(legacy, args.annotator_kwargs or "{}"), None
        else:
            annotator, server = _build_annotator(args)

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
        except KeyboardInterrupt:
            raise _Interrupted(f"interrupted; progress is saved in {args.out}, run the same command again to "
                               "resume") from None
        finally:
            if server is not None:
                server.stop()
        status = state["status"]
        print(f"labelled {int((status == LABELLED).sum())}, tied without a call "
              f"{int((status == TIED).sum())}, failed {int((status == FAILED).sum())}, "
              f"pending {int((status == NOT_ASKED).sum())} -> {args.out}")
        if legacy is not None:  # after the work, so that an error stays the only line
            print(f"oni-annotate-pairs: warning: {LEGACY_HINT} is deprecated and goes in the next release: "
                  f"register the annotator (torchrl_oni.train.annotator_types.register_annotator) and give its "
                  f"name", file=sys.stderr, flush=True)

    return _run_cli("oni-annotate-pairs", _annotate_args, body, argv)


# ----------------------------------------------------------------------------- 3. oni-train-reward
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
              f"val loss {m['val_loss']:.4f}, val accuracy {m['val_accuracy']:.3f} -> {args.out} "
              f"(use it: oni-train --intrinsic-reward motif --reward-model {args.out})")
        if m["val_pairs"] and abs(m["val_loss"] - math.log(2)) < 1e-3:
            # a constant reward scores ln 2 on every pair: the model has not moved from its start
            print(f"oni-train-reward: warning: the reward model barely moved from its start (val loss "
                  f"{m['val_loss']:.4f} ≈ ln 2, what a constant reward scores): {m['train_pairs']} pairs are too few for --lr {args.lr:g} over --epochs "
                  f"{args.epochs}; raise --lr (1e-3 learns on a few hundred pairs) or collect more pairs",
                  file=sys.stderr, flush=True)

    return _run_cli("oni-train-reward", _train_args, body, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m torchrl_oni.train.motif_cli {collect,annotate,train} ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"collect": collect_pairs_main, "annotate": annotate_pairs_main,
                "train": train_reward_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m torchrl_oni.train.motif_cli {collect,annotate,train} ...",
              file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
