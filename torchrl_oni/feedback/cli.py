"""``oni-label``: serve a saved caption store's labelling page until Ctrl-C.

Usage::

    oni-label --store runs/score-0/captions.pt                    # http://127.0.0.1:8765/
    oni-label --store captions.pt --host 0.0.0.0 --port 9000       # prints a URL with an access token

People's answers are written into the store as they come (saved atomically at most every
``--save-every`` seconds) and once more at exit. The captions that the reward-hacking diagnostics
flagged (paid captions that come before deaths far above chance: :mod:`torchrl_oni.reward_hacking`)
are shown first, with why: from ``--first FILE`` (an ``eval.json`` of ``oni-eval``, a
``reward_hacking.json`` of ``oni-train``, or a JSON list of captions), by default from the
``eval.json``, else the ``reward_hacking.json``, beside the store (``--first none``: neither). Game screens are shown when a
:class:`~torchrl_oni.feedback.screens.ScreenSnapshots` file is found (``--screens``, by default
``<store>.screens.pt`` next to the store). Bad flags, a missing or unreadable store, a taken port:
one ``oni-label: error: ...`` line and exit status 2.

Example:
    >>> import contextlib, io
    >>> from torchrl_oni.feedback.cli import main
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     try:
    ...         main(["--store", "/nonexistent/captions.pt"])
    ...     except SystemExit as stop:
    ...         code = stop.code
    >>> code, err.getvalue().startswith("oni-label: error: no CaptionStore file at")
    (2, True)
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

from torchrl_oni.cli_errors import OneLineArgumentParser, fail

PROG = "oni-label"


def default_screens_path(store_path: Path) -> Path:
    """``captions.pt`` -> ``captions.screens.pt`` (where a trainer would keep the screens)."""
    return store_path.with_name(store_path.stem + ".screens.pt")


def build_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description="Label a saved caption store in the browser.")
    p.add_argument("--store", required=True, type=Path, help="the CaptionStore file (captions.pt of a run)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other address requires an access token)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--token", default=None,
                   help="access token (default: a random one when not on 127.0.0.1; or set ONI_LABEL_TOKEN)")
    p.add_argument("--screens", type=Path, default=None,
                   help="a ScreenSnapshots file (default: <store>.screens.pt when it exists)")
    p.add_argument("--labeller", default="web", help="your name, recorded with every label (default 'web')")
    p.add_argument("--save-every", type=float, default=2.0, metavar="SECONDS",
                   help="longest delay before an answer is saved (default 2)")
    p.add_argument("--first", default=None, metavar="FILE",
                   help="captions to show first: the flagged captions of an oni-eval eval.json or an oni-train "
                        "reward_hacking.json, or a JSON list of captions (default: the eval.json, else the "
                        "reward_hacking.json, next to the store; 'none': neither)")
    return p


def _first_captions(args) -> tuple:
    """``([(hash, why)], where from or None)``; a bad ``--first`` ends the command (one line), a bad
    file found next to the store only says so (it was not asked for)."""
    from torchrl_oni.reward_hacking.flagged import read_flagged
    from torchrl_oni.reward_hacking.tally import REPORT_NAME
    from torchrl_oni.run_folder import EVAL_NAME

    if args.first == "none":
        return [], None
    if args.first is not None:
        try:
            return read_flagged(args.first), args.first
        except ValueError as err:
            fail(PROG, f"--first: {err}")
        except OSError as err:
            fail(PROG, f"--first: cannot read {args.first} ({err.strerror or err})")
    for name in (EVAL_NAME, REPORT_NAME):
        path = args.store.with_name(name)
        if not path.is_file():
            continue
        try:
            return read_flagged(path), str(path)
        except (OSError, ValueError) as err:
            print(f"{PROG}: not putting flagged captions first: {err}", flush=True)
            return [], None
    return [], None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        fail(PROG, f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.save_every <= 86400:  # also refuses nan
        fail(PROG, f"--save-every must be in [0, 86400] seconds, got {args.save_every}")
    from torchrl_oni.feedback.screens import ScreenSnapshots
    from torchrl_oni.store import CaptionStore

    try:
        store = CaptionStore.load(args.store)
    except (OSError, ValueError) as err:
        fail(PROG, str(err))
    snapshots = None
    screens = args.screens if args.screens is not None else default_screens_path(args.store)
    if args.screens is not None or screens.is_file():
        try:
            snapshots = ScreenSnapshots.load(screens)
        except (OSError, ValueError) as err:
            fail(PROG, str(err))
    first, first_from = _first_captions(args)
    token = args.token if args.token is not None else os.environ.get("ONI_LABEL_TOKEN")
    from torchrl_oni.feedback.server import FeedbackServer

    # The handlers go in before the page starts: a Ctrl-C that lands while it starts still stops cleanly.
    with _stop_requested() as stop:
        try:
            server = FeedbackServer(store, args.host, args.port, token, snapshots=snapshots, save_path=args.store,
                                    save_interval_s=args.save_every, labeller=args.labeller, announce=False,
                                    first=first)
            server.start()
        except ValueError as err:
            fail(PROG, str(err))
        except OSError as err:
            fail(PROG, f"cannot listen on {args.host}:{args.port} ({err.strerror or err})")
        state = server.state()
        if first_from is not None:
            print(f"{PROG}: {state['first']} of the {len(first)} captions flagged in {first_from} wait for a "
                  "person and come first", flush=True)
        print(f"{PROG}: {state['store']['size']} captions, {state['waiting']['captions']} waiting for a person, "
              f"{state['waiting']['pairs']} pairs; open {server.url_with_token} (Ctrl-C to stop)", flush=True)
        try:
            while not stop.wait(0.5):
                if not server.running:
                    fail(PROG, "the labelling page stopped unexpectedly (see the log above)")
        finally:
            server.stop()
    if server.save_error:
        fail(PROG, f"could not save {args.store}: {server.save_error}")
    given = server.metrics()["human_labels"]
    print(f"{PROG}: saved {args.store} ({int(given)} answers this session)", flush=True)
    return 0


@contextlib.contextmanager
def _stop_requested() -> Iterator[threading.Event]:
    """An event that Ctrl-C or SIGTERM sets while the block runs; the caller's handlers come back after."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
