"""One-line command-line errors for the ``oni-*`` tools.

Every ``oni-*`` command reports a bad input, a missing package or a dead server the same way:
one line ``prog: error: message`` on stderr and exit status 2 (:data:`EXIT_USAGE`), never a
usage dump or a traceback. :func:`fail` does it for errors found after parsing;
:class:`OneLineArgumentParser` makes argparse's own errors look the same (with a ``(see
--help)`` hint, since they are about the flags).

Example:
    >>> import contextlib, io
    >>> from torchrl_oni.cli_errors import OneLineArgumentParser, fail
    >>> parser = OneLineArgumentParser(prog="oni-demo")
    >>> _ = parser.add_argument("--n", type=int)
    >>> def stderr_and_code(call):
    ...     err = io.StringIO()
    ...     with contextlib.redirect_stderr(err):
    ...         try:
    ...             call()
    ...         except SystemExit as stop:
    ...             return err.getvalue(), stop.code
    >>> stderr_and_code(lambda: parser.parse_args(["--n", "x"]))
    ("oni-demo: error: argument --n: invalid int value: 'x' (see --help)\\n", 2)
    >>> stderr_and_code(lambda: fail("oni-demo", "server died:\\n  connection refused"))
    ('oni-demo: error: server died: | connection refused\\n', 2)
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, TextIO

__all__ = ["EXIT_USAGE", "MAX_MESSAGE", "OneLineArgumentParser", "fail", "report", "one_line", "overwritten_input"]

EXIT_USAGE = 2

MAX_MESSAGE = 440
"""Longest error message printed (characters): a value quoted in a message (a huge YAML string, a
nested list built from YAML aliases) is cut, not poured onto the terminal."""


def one_line(message: str, limit: Optional[int] = None) -> str:
    """``message`` with its lines joined by ``" | "`` (blank lines and edge spaces dropped); with
    ``limit``, cut to at most that many characters (the cut marked with ``...``).

    >>> one_line("a\\n\\n  b  ")
    'a | b'
    >>> one_line("x" * 50, limit=20)
    'xxxxxxxxxxxxxxxxx...'
    """
    text = str(message)
    if limit is not None and len(text) > 8 * limit:  # a huge message: only its head is looked at
        text = text[: 8 * limit]
    joined = " | ".join(part.strip() for part in text.splitlines() if part.strip())
    if limit is not None and len(joined) > limit:
        joined = joined[: max(limit - 3, 0)] + "..."
    return joined


def report(prog: str, message: str, file: Optional[TextIO] = None) -> int:
    """Prints ``prog: error: message`` as one line (stderr by default; at most
    :data:`MAX_MESSAGE` characters of message); returns :data:`EXIT_USAGE` for a ``main()`` that
    returns its exit status."""
    print(f"{prog}: error: {one_line(message, MAX_MESSAGE)}", file=file or sys.stderr, flush=True)
    return EXIT_USAGE


def fail(prog: str, message: str, code: int = EXIT_USAGE,
         file: Optional[TextIO] = None) -> NoReturn:
    """Prints ``prog: error: message`` as one line (stderr by default) and exits with ``code``.

    Raises:
        SystemExit: always, with ``code`` (2 unless told otherwise).
    """
    report(prog, message, file)
    raise SystemExit(code)


class OneLineArgumentParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one :func:`fail` line, exit code 2."""

    def error(self, message: str) -> NoReturn:  # argparse's hook for every parsing error
        fail(self.prog, f"{message} (see --help)")


def overwritten_input(output, inputs) -> Optional[str]:
    """The first of ``inputs`` (paths) that writing ``output`` would replace, or None.

    Paths are compared after resolving links and ``..``, and as files where both exist (a hard
    link, another spelling of the same folder).

    >>> overwritten_input("runs/a/../a/metrics.csv", ["runs/a/metrics.csv"])
    'runs/a/metrics.csv'
    >>> overwritten_input("out.png", ["runs/a/metrics.csv"]) is None
    True
    """
    import os

    if output is None:
        return None
    out = os.path.realpath(os.fspath(output))
    for path in inputs:
        if path is None:
            continue
        if os.path.realpath(os.fspath(path)) == out:
            return os.fspath(path)
        try:
            if os.path.samefile(output, path):
                return os.fspath(path)
        except OSError:
            pass
    return None
