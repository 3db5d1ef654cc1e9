"""Recorded NetHack episodes and ``oni-replay``: watch what a trained agent did, message by message.

``oni-eval RUN --record K`` keeps K of its episodes as ``RUN/replays/episode_000.npz``...; this
module owns that file format and turns one file into a self-contained HTML player (no network:
the data, the script and the style are inline) and/or an animated GIF.

Episode file: one compressed ``.npz`` of plain arrays, read with ``allow_pickle=False``. Frame
``t`` is the observation after ``t`` steps (frame 0 is the reset screen, the last one the
terminal screen), so an episode of ``T`` steps has ``F = T + 1`` frames:

======================  =================  ===================================================
key                     shape / dtype      meaning
======================  =================  ===================================================
``tty_chars``           uint8[F, 24, 80]   NetHack's terminal characters (NLE ``tty_chars``)
``tty_colors``          uint8[F, 24, 80]   their colours, NetHack's 16 (NLE ``tty_colors``)
``tty_cursor``          uint8[F, 2]        cursor (row, column)
``message``             uint8[F, 256]      the observation's message (the caption), NUL-padded
``msg_count``           int32[F]           sightings of that message this episode, this one included
``action``              int16[F]           the action taken from frame t; -1 on the last frame
``reward``              float32[F]         extrinsic reward received arriving at frame t (0 at 0)
``label``               float32[F]         the run's annotator label of frame t's message, NaN
                                           where it has none
``intrinsic_reward``    float32[F]         what the run's reward pays for that message,
                                           ``label · msg_count ** -beta`` for retrieval; NaN
                                           where it is not known (other reward types)
``meta_json``           uint8[n]           UTF-8 JSON: ``format``, ``version``, ``task``,
                                           ``action_names``, ``stats`` (episode statistics)...
======================  =================  ===================================================

Usage::

    oni-eval RUN --record 3                          # also writes RUN/replays/episode_00*.npz
    oni-replay RUN/replays/episode_000.npz           # → RUN/replays/episode_000.html
    oni-replay episode_000.npz -o ep0.html --gif ep0.gif --fps 20

The player shows the 24×80 screen in NetHack's colours, the message line, the annotator's label
and the intrinsic reward of each message, the recent messages, a frame counter, and has
play/pause, step back/forward, seek and speed (keys: space, ←/→, shift+←/→, Home/End, +/−).
Every text is HTML-escaped (captions may hold ``<`` or ``&``). A bad file or flag ends with one
``oni-replay: error: ...`` line and exit status 2.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> from torchrl_oni.replay import Episode, load_episode, save_episode, write_gif, write_html
    >>> ep = Episode.blank(3, meta={"task": "demo"})
    >>> ep.tty_chars[:, 0, :5] = np.frombuffer(b"Hello", np.uint8)
    >>> ep.tty_chars[2, 5, 10] = ord("@")
    >>> ep.message[1, :9] = np.frombuffer(b"You see <", np.uint8)
    >>> folder = tempfile.mkdtemp()
    >>> path = save_episode(os.path.join(folder, "episode_000.npz"), ep)
    >>> back = load_episode(path)
    >>> back.num_frames, back.screen_lines(2)[5][8:13], back.messages()[1]
    (3, '  @  ', 'You see <')
    >>> html = open(write_html(back, os.path.join(folder, "ep.html")), encoding="utf-8").read()
    >>> "You see <" in html, "You see \\\\u003c" in html
    (False, True)
    >>> from PIL import Image
    >>> gif = Image.open(write_gif(back, os.path.join(folder, "ep.gif"), fps=5))
    >>> gif.n_frames, gif.size[0] > 80 * 5
    (3, True)
"""
from __future__ import annotations

import argparse
import base64
import html
import json
import math
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from .atomic import atomic_write
from .captions import MESSAGE_LEN, decode_message
from .cli_errors import OneLineArgumentParser, overwritten_input, report

__all__ = [
    "Episode",
    "ReplayError",
    "FORMAT",
    "VERSION",
    "ROWS",
    "COLS",
    "NETHACK_COLORS",
    "save_episode",
    "load_episode",
    "render_html",
    "write_html",
    "write_gif",
    "main",
]

PROG = "oni-replay"
FORMAT = "torchrl_oni.Episode"
VERSION = 1
ROWS, COLS = 24, 80
MAX_GIF_FPS = 50  # GIF delays are in 1/100 s and viewers slow anything under 2/100 s down
MAX_HTML_FPS = 1000  # the player's own speed control goes from there
MIN_FONT_SIZE, MAX_FONT_SIZE = 4, 96  # GIF glyphs: 96 px already makes a 4600-pixel-wide screen
DEFAULT_MAX_MB = 200.0  # --max-mb: largest HTML player or GIF written

# NetHack's 16 colours (CLR_BLACK .. CLR_WHITE); black is drawn dark grey, as NetHack's own tty
# does with use_darkgray, or dark things would vanish on the black background.
NETHACK_COLORS = (
    "#555753", "#cc0000", "#4e9a06", "#c4a000", "#3465a4", "#75507b", "#06989a", "#d3d7cf",
    "#d3d7cf", "#f57900", "#8ae234", "#fce94f", "#729fcf", "#ad7fa8", "#34e2e2", "#ffffff",
)

# name -> (dtype, shape after the frame axis)
ARRAY_FIELDS = {
    "tty_chars": (np.uint8, (ROWS, COLS)),
    "tty_colors": (np.uint8, (ROWS, COLS)),
    "tty_cursor": (np.uint8, (2,)),
    "message": (np.uint8, (MESSAGE_LEN,)),
    "msg_count": (np.int32, ()),
    "action": (np.int16, ()),
    "reward": (np.float32, ()),
    "label": (np.float32, ()),
    "intrinsic_reward": (np.float32, ()),
}


class ReplayError(ValueError):
    """A file that is not a readable episode, or bad ``oni-replay`` input (one line, exit 2)."""


@dataclass
class Episode:
    """One recorded episode: the arrays of the file format (see the module docstring) + ``meta``."""

    tty_chars: np.ndarray
    tty_colors: np.ndarray
    tty_cursor: np.ndarray
    message: np.ndarray
    msg_count: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    label: np.ndarray
    intrinsic_reward: np.ndarray
    meta: dict = field(default_factory=dict)

    @classmethod
    def blank(cls, frames: int, meta: Optional[dict] = None) -> "Episode":
        """An episode of ``frames`` blank screens (spaces), no messages, labels or rewards."""
        arrays = {}
        for name, (dtype, shape) in ARRAY_FIELDS.items():
            fill = {"tty_chars": ord(" "), "msg_count": 1, "action": -1}.get(name, 0)
            if name in ("label", "intrinsic_reward"):
                fill = np.nan
            arrays[name] = np.full((frames, *shape), fill, dtype=dtype)
        return cls(**arrays, meta=dict(meta or {}))

    @property
    def num_frames(self) -> int:
        return int(self.tty_chars.shape[0])

    def screen_lines(self, t: int) -> List[str]:
        """Frame ``t``'s 24 screen rows as text (control characters as spaces)."""
        rows = self.tty_chars[t].copy()
        rows[(rows < 32) | (rows == 127)] = ord(" ")
        return [bytes(r).decode("latin-1") for r in rows]

    def messages(self) -> List[str]:
        """Each frame's message as text (``""`` where there is none)."""
        return [decode_message(m) for m in self.message]

    def validate(self) -> None:
        """Raises :class:`ReplayError` unless every array has the format's dtype and shape."""
        frames = self.num_frames if self.tty_chars.ndim == 3 else -1
        if frames < 1:
            raise ReplayError(f"an episode needs at least one frame of 24x80 tty_chars, got shape {self.tty_chars.shape}")
        for name, (dtype, shape) in ARRAY_FIELDS.items():
            value = getattr(self, name)
            if value.dtype != np.dtype(dtype) or value.shape != (frames, *shape):
                raise ReplayError(
                    f"{name}: expected {np.dtype(dtype)}{(frames, *shape)}, got {value.dtype}{tuple(value.shape)}"
                )


# ---------------------------------------------------------------------- the file
def save_episode(path: Union[str, os.PathLike], episode: Episode) -> Path:
    """Writes ``episode`` as one compressed ``.npz`` (atomically); returns the path."""
    episode.validate()
    meta = {**episode.meta, "format": FORMAT, "version": VERSION}
    arrays = {name: getattr(episode, name) for name in ARRAY_FIELDS}
    arrays["meta_json"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    return atomic_write(path, lambda f: np.savez_compressed(f, **arrays))


def load_episode(path: Union[str, os.PathLike]) -> Episode:
    """Reads a file written by :func:`save_episode` (no pickles); :class:`ReplayError` otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ReplayError(f"no episode file at {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = {k: data[k] for k in data.files}
    except Exception as err:  # truncated, not a zip, or holds pickled objects
        raise ReplayError(f"{path} is not a readable episode file ({type(err).__name__}: {err})") from None
    missing = [k for k in (*ARRAY_FIELDS, "meta_json") if k not in stored]
    if missing:
        raise ReplayError(f"{path} is not an episode file (missing {', '.join(missing)})")
    try:
        meta = json.loads(stored.pop("meta_json").tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ReplayError(f"{path}: unreadable metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ReplayError(f"{path} is not an episode file")
    if meta.get("version") != VERSION:
        raise ReplayError(f"{path}: unsupported episode format version {meta.get('version')}")
    for key, kind, what in (("stats", dict, "a mapping"), ("action_names", list, "a list")):
        if key in meta and not isinstance(meta[key], kind):
            raise ReplayError(f"{path}: damaged metadata ({key!r} is not {what})")
    episode = Episode(**{k: stored[k] for k in ARRAY_FIELDS}, meta=meta)
    try:
        episode.validate()
    except ReplayError as err:
        raise ReplayError(f"{path}: {err}") from None
    return episode


# ---------------------------------------------------------------------- HTML player
@lru_cache(maxsize=1)
def _player_template() -> str:
    return resources.files("torchrl_oni").joinpath("replay_assets").joinpath("player.html").read_text(encoding="utf-8")


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _screen_deltas(chars: np.ndarray, colors: np.ndarray) -> Dict[str, str]:
    """The first screen, then only the cells each frame changes (a step redraws a few dozen).

    ``offsets`` (uint32[F + 1]): frame t's changes are entries ``offsets[t]:offsets[t + 1]`` of
    ``pos`` (uint16 cell index), ``ch`` and ``co`` (uint8); frame 0 has none.
    """
    frames = len(chars)
    flat_ch = chars.reshape(frames, -1)
    flat_co = colors.reshape(frames, -1)
    changed = (flat_ch[1:] != flat_ch[:-1]) | (flat_co[1:] != flat_co[:-1])
    frame_idx, pos = np.nonzero(changed)  # row-major: by frame, then by cell
    offsets = np.zeros(frames + 1, dtype="<u4")
    offsets[2:] = np.cumsum(changed.sum(1))
    return {
        "chars0": _b64(flat_ch[0]),
        "colors0": _b64(flat_co[0]),
        "offsets": _b64(offsets),
        "pos": _b64(pos.astype("<u2")),
        "ch": _b64(flat_ch[1:][frame_idx, pos]),
        "co": _b64(flat_co[1:][frame_idx, pos]),
    }


def _finite(values: np.ndarray, digits: int) -> list:
    """Floats for JSON: NaN becomes null (JSON has no NaN)."""
    return [None if not math.isfinite(v) else round(v, digits) for v in values.astype(np.float64).tolist()]


def _json_for_script(data) -> str:
    """JSON safe inside ``<script>``: no ``<``, ``>`` or ``&`` can end the element or open a tag."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def default_title(episode: Episode) -> str:
    meta = episode.meta
    parts = [str(meta.get("task", "NetHack"))]
    if "episode" in meta:
        parts.append(f"episode {meta['episode']}")
    stats = meta.get("stats")
    end = stats.get("end") if isinstance(stats, dict) else None
    if end:
        parts.append(str(end))
    return " · ".join(parts)


def _summary(episode: Episode) -> dict:
    meta = episode.meta
    out = {k: meta[k] for k in ("task", "episode", "checkpoint", "policy", "intrinsic_reward") if k in meta}
    stats = meta.get("stats")
    for k, v in (stats if isinstance(stats, dict) else {}).items():
        if isinstance(v, (int, float, str, bool)):
            out[k] = v
    out["frames"] = episode.num_frames
    return out


def html_size_estimate(episode: Episode) -> int:
    """Bytes of :func:`render_html`'s page, within a few percent, without building it: the
    base64 screen changes plus ~60 bytes of per-frame numbers and the distinct messages."""
    frames = episode.num_frames
    flat_ch = episode.tty_chars.reshape(frames, -1)
    flat_co = episode.tty_colors.reshape(frames, -1)
    changes = int(((flat_ch[1:] != flat_ch[:-1]) | (flat_co[1:] != flat_co[:-1])).sum())
    raw = 2 * ROWS * COLS + 4 * (frames + 1) + 4 * changes + 2 * frames  # chars0, colors0, offsets, pos+ch+co, cursor
    messages = sum(len(m) for m in set(bytes(r).split(b"\0", 1)[0] for r in episode.message))
    return raw * 4 // 3 + 60 * frames + messages + len(_player_template())


def render_html(episode: Episode, title: Optional[str] = None, fps: int = 10,
                max_bytes: Optional[int] = None) -> str:
    """The self-contained HTML player of ``episode`` as a string.

    Raises:
        ReplayError: the page would be larger than ``max_bytes`` (checked before it is built).
    """
    episode.validate()
    if max_bytes is not None:
        size = html_size_estimate(episode)
        if size > max_bytes:
            raise ReplayError(f"the HTML player of these {episode.num_frames} frames would be about "
                              f"{size / 2 ** 20:.0f} MB, more than --max-mb {max_bytes / 2 ** 20:g}; raise "
                              f"--max-mb, or write a --gif of a part (--start/--stop)")
    texts = episode.messages()
    table: Dict[str, int] = {}
    msg_ids = [table.setdefault(t, len(table)) for t in texts]
    labels: List[Optional[float]] = [None] * len(table)
    for t, m in enumerate(msg_ids):
        value = float(episode.label[t])
        if labels[m] is None and math.isfinite(value):
            labels[m] = round(value, 4)
    names = episode.meta.get("action_names")
    names = [str(n) for n in names] if isinstance(names, (list, tuple)) else []
    data = {
        "rows": ROWS,
        "cols": COLS,
        "frames": episode.num_frames,
        "fps": int(fps),
        "screen": _screen_deltas(episode.tty_chars, episode.tty_colors),
        "cursor": _b64(episode.tty_cursor.astype(np.uint8)),
        "messages": list(table),
        "labels": labels,
        "msg": msg_ids,
        "count": episode.msg_count.astype(np.int64).tolist(),
        "action": episode.action.astype(np.int64).tolist(),
        "reward": [0.0 if v is None else v for v in _finite(episode.reward, 4)],
        "intrinsic": _finite(episode.intrinsic_reward, 5),
        "action_names": names,
        "summary": _summary(episode),
    }
    title = title or default_title(episode)
    subtitle = f"{episode.num_frames - 1} steps"
    if episode.meta.get("checkpoint"):
        subtitle += f" · {episode.meta['checkpoint']}"
    page = _player_template()
    # the data goes in last: nothing inside it can be taken for a placeholder
    for key, value in (("__TITLE__", html.escape(title)), ("__SUBTITLE__", html.escape(subtitle))):
        page = page.replace(key, value)
    return page.replace("__DATA__", _json_for_script(data))


def write_html(episode: Episode, path: Union[str, os.PathLike], title: Optional[str] = None, fps: int = 10,
               max_bytes: Optional[int] = None) -> Path:
    """Writes the HTML player of ``episode`` to ``path`` (atomically); returns the path.
    ``max_bytes``: see :func:`render_html`."""
    page = render_html(episode, title=title, fps=fps, max_bytes=max_bytes).encode("utf-8")
    return atomic_write(path, lambda f: f.write(page))


# ---------------------------------------------------------------------- GIF
@lru_cache(maxsize=4)
def _glyphs(font_size: int):
    """bool[256, h, w] masks of each latin-1 character in a monospace font, and the cell size.

    DejaVu Sans Mono ships with matplotlib (a dependency), so no system font is needed.
    """
    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSansMono.ttf"), font_size)
    ascent, descent = font.getmetrics()
    height, width = ascent + descent, int(math.ceil(font.getlength("M")))
    masks = np.zeros((256, height, width), dtype=bool)
    for code in range(33, 256):
        if 127 <= code < 160:  # control characters
            continue
        cell = Image.new("L", (width, height), 0)
        ImageDraw.Draw(cell).text((0, 0), chr(code), font=font, fill=255)
        masks[code] = np.asarray(cell) > 100
    return masks, height, width


def _gif_palette() -> bytes:
    """Index 0 the black background, 1 + c NetHack colour c."""
    rgb = [(0, 0, 0)] + [tuple(int(h[i : i + 2], 16) for i in (1, 3, 5)) for h in NETHACK_COLORS]
    return bytes(v for c in rgb for v in c)


def _status_row(episode: Episode, t: int) -> np.ndarray:
    """One extra text row under the screen: frame counter, label and intrinsic reward."""
    label, r_int = float(episode.label[t]), float(episode.intrinsic_reward[t])
    text = f" frame {t}/{episode.num_frames - 1}"
    if episode.message[t, 0]:
        text += "  label " + ("-" if not math.isfinite(label) else f"{label:.2f}")
        if math.isfinite(r_int):
            text += f"  r_int {r_int:.3f}"
    return np.frombuffer(text[:COLS].ljust(COLS).encode("latin-1", "replace"), dtype=np.uint8)


def _gif_frame(chars: np.ndarray, colors: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Palette indices of a ``[R, C]`` block of characters: R*h x C*w pixels."""
    rows, cols = chars.shape
    _, h, w = masks.shape
    ink = masks[chars]  # [R, C, h, w]
    index = (colors.astype(np.uint8) & 15) + 1
    pixels = np.where(ink, index[:, :, None, None], 0).astype(np.uint8)
    return pixels.transpose(0, 2, 1, 3).reshape(rows * h, cols * w)


def _check_font_size(font_size) -> None:
    if not MIN_FONT_SIZE <= font_size <= MAX_FONT_SIZE:
        raise ReplayError(f"--font-size must be in [{MIN_FONT_SIZE}, {MAX_FONT_SIZE}], got {font_size}")


def write_gif(
    episode: Episode,
    path: Union[str, os.PathLike],
    fps: float = 10,
    font_size: int = 14,
    start: int = 0,
    stop: Optional[int] = None,
    max_bytes: Optional[int] = None,
) -> Path:
    """Writes frames ``start:stop`` of ``episode`` as an animated GIF; returns the path.

    Frames are streamed to the file one at a time, each cropped to what changed since the
    previous one, so a long episode never sits in memory as images. Below the screen a status
    row shows the frame number, the message's label and its intrinsic reward.

    Raises:
        ReplayError: bad ``fps``/``font_size``/frame range, or the file grew past ``max_bytes``
            (nothing is left behind then).
    """
    from PIL import GifImagePlugin, Image

    episode.validate()
    if not 0 < fps <= MAX_GIF_FPS:
        raise ReplayError(f"--fps must be in (0, {MAX_GIF_FPS}] for a GIF, got {fps}")
    _check_font_size(font_size)
    frames = range(episode.num_frames)[start:stop]
    if len(frames) == 0:
        raise ReplayError(f"--start/--stop: no frames in {start}:{stop} (the episode has {episode.num_frames})")
    masks, _, _ = _glyphs(int(font_size))
    palette = _gif_palette()
    delay = max(20, int(round(1000 / fps / 10)) * 10)  # GIF stores 1/100 s
    status_colors = np.full((1, COLS), 7, dtype=np.uint8)

    def pixels(t: int) -> np.ndarray:
        chars = np.concatenate([episode.tty_chars[t], _status_row(episode, t)[None]])
        colors = np.concatenate([episode.tty_colors[t], status_colors])
        return _gif_frame(chars, colors, masks)

    def image(block: np.ndarray) -> "Image.Image":
        im = Image.frombytes("P", (block.shape[1], block.shape[0]), block.tobytes())
        im.putpalette(palette)
        return im

    written = [0]

    def put(f, chunk: bytes) -> None:
        written[0] += len(chunk)
        if max_bytes is not None and written[0] > max_bytes:
            raise ReplayError(f"the GIF of frames {start}:{stop} grew past --max-mb {max_bytes / 2 ** 20:g} "
                              f"after {t - frames[0]} of {len(frames)} frames; raise --max-mb, or give "
                              f"--start/--stop")
        f.write(chunk)

    t = frames[0]

    def write(f):
        nonlocal t
        previous = pixels(frames[0])
        header, _ = GifImagePlugin.getheader(image(previous), info={"loop": 0, "duration": delay, "optimize": False})
        for chunk in header + GifImagePlugin.getdata(image(previous), offset=(0, 0), duration=delay):
            put(f, chunk)
        for t in frames[1:]:
            current = pixels(t)  # never equal to the previous one: the status row counts frames
            diff = current != previous
            ys, xs = np.flatnonzero(diff.any(1)), np.flatnonzero(diff.any(0))
            block = current[ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1]
            for chunk in GifImagePlugin.getdata(image(block), offset=(int(xs[0]), int(ys[0])), duration=delay):
                put(f, chunk)
            previous = current
        f.write(b";")  # GIF trailer

    return atomic_write(path, write)


# ---------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description="Turn an episode recorded by `oni-eval --record` into an HTML player and/or a GIF.")
    p.add_argument("episode", help="an episode file, e.g. RUN/replays/episode_000.npz")
    p.add_argument("-o", "--output", default=None,
                   help="HTML player to write (default: beside the episode, .html, written again each time; none when "
                        "only --gif is given)")
    p.add_argument("--gif", default=None, help="also (or only) write an animated GIF here")
    p.add_argument("--overwrite", action="store_true", help="replace the files -o and --gif name if they exist")
    p.add_argument("--fps", type=float, default=10.0, help="playback speed in frames per second (default: %(default)s)")
    p.add_argument("--title", default=None, help="page title (default: task, episode and how it ended)")
    p.add_argument("--start", type=int, default=0, help="GIF: first frame (default: 0)")
    p.add_argument("--stop", type=int, default=None, help="GIF: one past the last frame (default: the end)")
    p.add_argument("--font-size", type=int, default=14,
                   help=f"GIF: font size in pixels, {MIN_FONT_SIZE} to {MAX_FONT_SIZE} (default: %(default)s)")
    p.add_argument("--max-mb", type=float, default=DEFAULT_MAX_MB, metavar="MB",
                   help="refuse to write an HTML player or GIF larger than this (default: %(default)s)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``oni-replay``; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse already printed its one line (or --help)
        return int(stop.code or 0)
    try:
        if not 0 < args.fps <= MAX_HTML_FPS:  # also refuses nan
            raise ReplayError(f"--fps must be in (0, {MAX_HTML_FPS}], got {args.fps}")
        _check_font_size(args.font_size)  # before any output: -o is written before --gif
        if args.start < 0 or (args.stop is not None and args.stop < 1):
            raise ReplayError(f"--start must be >= 0 and --stop >= 1, got {args.start} and {args.stop}")
        if not (math.isfinite(args.max_mb) and args.max_mb > 0):
            raise ReplayError(f"--max-mb must be a positive number, got {args.max_mb}")
        max_bytes = int(min(args.max_mb, 2.0 ** 40) * 2 ** 20)
        html_out = args.output
        if html_out is None and args.gif is None:
            html_out = str(Path(args.episode).with_suffix(".html"))
        for flag, out in (("-o", html_out), ("--gif", args.gif)):
            if overwritten_input(out, [args.episode]):
                raise ReplayError(f"{flag} {out} is the episode file itself; choose another output")
        if overwritten_input(args.gif, [html_out]):
            raise ReplayError(f"--gif {args.gif} is also the HTML output (-o); choose two files")
        # the default player beside the episode is made from it again, the same; a file the user
        # named may be one they keep
        for flag, out in (("-o", args.output), ("--gif", args.gif)):
            if out is not None and not args.overwrite and os.path.isfile(out):
                raise ReplayError(f"{flag} {out} already exists: --overwrite replaces it, or choose another file")
        episode = load_episode(args.episode)
        written = []
        if html_out is not None:
            written.append(write_html(episode, html_out, title=args.title, fps=max(1, int(round(args.fps))),
                                      max_bytes=max_bytes))
        if args.gif is not None:
            written.append(write_gif(episode, args.gif, fps=args.fps, font_size=args.font_size,
                                     start=args.start, stop=args.stop, max_bytes=max_bytes))
    except ReplayError as err:
        return report(PROG, str(err))
    except OSError as err:  # an output folder that cannot be written
        where = f": {err.filename}" if err.filename else ""
        return report(PROG, (err.strerror or str(err)) + where)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
