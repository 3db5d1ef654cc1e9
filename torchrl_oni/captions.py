"""Captions: NetHack's 256-byte ``message`` observation, its stable hash and the key names.

Every module of torchrl_oni agrees on these names and on one way to turn message bytes into a
hash, so a caption can be followed from the env to its label to its reward.

A caption is the raw ``uint8[256]`` NUL-padded message. Its identity is the blake2b-64 digest
of the bytes before the first NUL, read as a signed int64: stable across processes, machines
and runs (unlike Python's ``hash()`` or TorchRL's ``SipHash``, which are salted per process).

Example:
    >>> from torchrl_oni.captions import encode_message, decode_message, caption_hash
    >>> msg = encode_message("You kill the newt!")
    >>> msg.shape, msg.dtype
    ((256,), dtype('uint8'))
    >>> decode_message(msg)
    'You kill the newt!'
    >>> caption_hash(msg) == caption_hash(b"You kill the newt!")
    True
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence, Union

import numpy as np

MESSAGE_LEN = 256

# TensorDict keys shared by the env, the transforms, the store and the trainer.
MESSAGE_KEY = "message"
CAPTION_HASH_KEY = "caption_hash"
MSG_COUNT_KEY = "msg_count"
RUN_COUNT_KEY = "run_msg_count"  # --count-scope run: the trainer's count of a message's sightings in the run
INTRINSIC_REWARD_KEY = "intrinsic_reward"
REWARD_KEY = "reward"
GOAL_EMBEDDING_KEY = "goal_embedding"  # ELLM: the current goals' embedding, an optional policy input

BytesLike = Union[bytes, bytearray, memoryview, np.ndarray, Sequence[int]]


def message_bytes(message: BytesLike) -> bytes:
    """Returns the caption's bytes: everything before the first NUL."""
    if isinstance(message, np.ndarray):
        raw = message.astype(np.uint8, copy=False).tobytes()
    elif isinstance(message, (bytes, bytearray, memoryview)):
        raw = bytes(message)
    elif hasattr(message, "numpy"):  # a torch tensor
        raw = message.detach().cpu().numpy().astype(np.uint8, copy=False).tobytes()
    else:
        raw = bytes(message)
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


def caption_hash(message: BytesLike) -> int:
    """The caption's stable signed 64-bit hash (blake2b, 8-byte digest)."""
    digest = hashlib.blake2b(message_bytes(message), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def hash_bytes(raw: bytes) -> int:
    """:func:`caption_hash` for bytes already cut at the first NUL (the hot path)."""
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


def hash_messages(messages) -> np.ndarray:
    """Hashes a batch of ``uint8[..., 256]`` messages (numpy or torch) into ``int64[...]``."""
    if hasattr(messages, "numpy"):
        messages = messages.detach().cpu().numpy()
    arr = np.asarray(messages, dtype=np.uint8)
    flat = arr.reshape(-1, arr.shape[-1])
    out = np.fromiter((caption_hash(row) for row in flat), dtype=np.int64, count=len(flat))
    return out.reshape(arr.shape[:-1])


def decode_message(message: BytesLike) -> str:
    """Message bytes → text. Drops every NUL byte and decodes latin-1, like ONI's decoder."""
    if isinstance(message, str):
        return message
    if isinstance(message, np.ndarray) or hasattr(message, "numpy"):
        arr = message.detach().cpu().numpy() if hasattr(message, "detach") else message
        raw = np.asarray(arr, dtype=np.uint8).tobytes()
    else:
        raw = bytes(message)
    return raw.replace(b"\0", b"").decode("latin-1")


def decode_messages(messages) -> list:
    """Decodes a batch ``uint8[N, 256]`` into a list of N strings."""
    if hasattr(messages, "numpy"):
        messages = messages.detach().cpu().numpy()
    arr = np.asarray(messages, dtype=np.uint8).reshape(-1, MESSAGE_LEN)
    return [decode_message(row) for row in arr]


def encode_message(text: Union[str, bytes]) -> np.ndarray:
    """Text → ``uint8[256]`` NUL-padded (latin-1; other characters become ``?``; cut at 256)."""
    raw = text if isinstance(text, (bytes, bytearray)) else text.encode("latin-1", "replace")
    raw = bytes(raw)[:MESSAGE_LEN]
    out = np.zeros(MESSAGE_LEN, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def encode_messages(texts: Iterable[Union[str, bytes]]) -> np.ndarray:
    """A list of texts → ``uint8[N, 256]``."""
    rows = [encode_message(t) for t in texts]
    if not rows:
        return np.zeros((0, MESSAGE_LEN), dtype=np.uint8)
    return np.stack(rows)
