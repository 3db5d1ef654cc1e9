"""ELLM's goal conditioning at acting time: the trainer publishes each state's goal embedding to a
:class:`SharedGoalEmbeddings` (files in ``/dev/shm``; a pickled table is its path), and every env
worker's :class:`GoalEmbeddingTransform` writes ``goal_embedding`` into its observations from it.

Why it must happen at acting time: :mod:`torchrl_oni.rewards.ellm` ("Goal conditioning").
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.envs.transforms import Transform

from torchrl_oni.captions import CAPTION_HASH_KEY, GOAL_EMBEDDING_KEY, MESSAGE_KEY
from torchrl_oni.transform_keys import KeyedTransform, KeyRole, alias_property

__all__ = ["GoalEmbeddingTransform", "SharedGoalEmbeddings", "remove_stale_tables"]

log = logging.getLogger(__name__)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


_PREFIX = "oni-goal-embeddings-"
_OWNER = "owner"  # "PID START": the creating process and its start time (PIDs are reused)


def _process_start(pid: int):
    """The process's start time in clock ticks since boot (``/proc``), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]  # field 22 of stat(5), counted after the name
    except (OSError, IndexError):
        return None


def _alive(pid: int, start) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return start is None or _process_start(pid) in (None, start)


def remove_stale_tables(directory: str) -> int:
    """Removes the goal tables in ``directory`` left by processes of this user that are gone
    (``kill -9``, a crash: their finaliser never ran); returns how many. Tables of live processes,
    of other users and folders without an owner file are left alone."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER)) as f:
                pid, start = f.read().split()
        except (OSError, ValueError):
            continue
        if not _alive(int(pid), None if start == "-" else start):
            _remove_tree(path)
            removed += 1
    if removed:
        log.info("removed %d goal table(s) of dead processes from %s", removed, directory)
    return removed


def _default_directory() -> str:
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedGoalEmbeddings:
    """State hash → goal embedding in shared memory: the trainer writes, env workers read.

    An open-addressing hash table (linear probing) over two shared-memory tensors, ``keys
    int64[C]`` (0 = empty) and ``values float16[C, D]``. One writer (the trainer's
    :class:`~torchrl_oni.rewards.ellm.ELLMReward`) inserts each state once, value first, then key; readers
    (:class:`GoalEmbeddingTransform` in collector workers) see either no entry or a complete
    one. The tensors are mapped from files in ``/dev/shm`` (the temp dir where there is none), and
    a pickled table carries the files' path, not the data: TorchRL's collectors send env
    constructors through cloudpickle, which would copy ordinary shared-memory tensors by value,
    and a worker would then read its own empty copy. The process that made the table removes the
    files when the table is garbage-collected or :meth:`close` is called (workers keep their mapping).
    Processes on one machine only: Ray actors on other nodes cannot map the files.

    The files are allocated in full when the table is made (``posix_fallocate``): a full
    ``/dev/shm`` is found then, not as a bus error at the first write beyond its end. Without a
    ``directory``, a ``/dev/shm`` too small falls back to the temp dir on disk, with a warning.
    Tables left by dead processes of the same user (``kill -9``) are removed when a new one is
    made in the same directory.

    Args:
        dim: embedding size (384 for both encoders).
        capacity: slots, a power of two; inserts stop (with one warning) at 70 % load. Shared
            memory used: ``capacity · (8 + 2·dim)`` bytes (50 MB for the default 65 536 slots,
            45 875 states); containers often limit ``/dev/shm`` to 64 MB.
        max_probe: longest probe sequence.
        directory: where the files go (``--ellm-goal-table-dir``); default ``/dev/shm`` (the
            temp dir where there is none, or where it has no room).

    Example:
        >>> table = SharedGoalEmbeddings(dim=4, capacity=16)
        >>> table.put(torch.tensor([7, 23]), torch.eye(4)[:2])  # 7 and 23 share slot 7
        2
        >>> table.get(torch.tensor([23, 5, 7])).tolist()
        [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    """

    def __init__(self, dim: int = 384, capacity: int = 1 << 16, max_probe: int = 64,
                 directory: Optional[str] = None):
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, got {capacity}")
        import tempfile
        import weakref

        self.dim = int(dim)
        self.capacity = int(capacity)
        self.max_probe = int(max_probe)
        chosen = directory or _default_directory()
        try:
            self.path = self._allocate(chosen)
        except OSError as err:
            fallback = tempfile.gettempdir()
            if directory is not None or os.path.realpath(fallback) == os.path.realpath(chosen):
                raise OSError(f"no room for the shared goal table ({self.nbytes / 2**20:.0f} MB) in {chosen}: "
                              f"{err.strerror or err}; choose another place with --ellm-goal-table-dir") from None
            log.warning("no room for the shared goal table (%.0f MB) in %s: its files go to %s instead "
                        "(--ellm-goal-table-dir to choose)", self.nbytes / 2**20, chosen, fallback)
            self.path = self._allocate(fallback)
        self._map()
        self._full_warned = False
        # only the creating process removes the files (a worker's unpickled copy has no finalizer)
        self._finalizer = weakref.finalize(self, _remove_tree, self.path)

    @property
    def nbytes(self) -> int:
        return self.capacity * (8 + 2 * self.dim) + 8

    def _files(self):
        return (("keys", self.capacity * 8), ("values", self.capacity * self.dim * 2), ("size", 8))

    def _allocate(self, directory: str) -> str:
        """A new folder in ``directory`` with the three files at full size (``OSError`` if they
        do not fit; nothing is left behind then)."""
        import tempfile

        if not os.path.isdir(directory):
            raise OSError(f"{directory} is not a directory")
        remove_stale_tables(directory)
        path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=directory)
        try:
            with open(os.path.join(path, _OWNER), "w") as f:
                f.write(f"{os.getpid()} {_process_start(os.getpid()) or '-'}")
            for name, size in self._files():
                fd = os.open(os.path.join(path, name), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
        except OSError:
            _remove_tree(path)
            raise
        return path

    def _map(self) -> None:
        def mapped(name, n, dtype):
            return torch.from_file(os.path.join(self.path, name), shared=True, size=n, dtype=dtype)

        self.keys = mapped("keys", self.capacity, torch.int64)
        self.values = mapped("values", self.capacity * self.dim, torch.float16).view(self.capacity, self.dim)
        self.size = mapped("size", 1, torch.int64)

    def __getstate__(self) -> dict:
        return {"dim": self.dim, "capacity": self.capacity, "max_probe": self.max_probe, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if not os.path.isdir(self.path):
            raise RuntimeError(f"the shared goal table at {self.path} is gone (its trainer closed it, or "
                               "this process runs on another machine: goal-conditioned policies need "
                               "env workers on the trainer's machine)")
        self._map()
        self._full_warned = False
        self._finalizer = None

    def __deepcopy__(self, memo) -> "SharedGoalEmbeddings":
        return self  # copies of a transform (Transform.clone) read the same table

    def close(self) -> None:
        """Removes the files (mappings that exist stay valid); only the creating process does."""
        if self._finalizer is not None:
            self._finalizer()

    @staticmethod
    def _keys(hashes: torch.Tensor) -> torch.Tensor:
        h = hashes.reshape(-1).long().cpu()
        return torch.where(h == 0, torch.ones_like(h), h)  # 0 marks an empty slot (hash 0 reads as 1)

    def put(self, hashes: torch.Tensor, vectors: torch.Tensor) -> int:
        """Inserts new states (existing ones are left as they are); returns how many were added."""
        mask = self.capacity - 1
        added = 0
        values = vectors.detach().to(torch.float16).cpu()
        for h, v in zip(self._keys(hashes).tolist(), values):
            if int(self.size) >= 0.7 * self.capacity:
                if not self._full_warned:
                    log.warning("shared goal table full (%d states): new states get no goal embedding",
                                int(self.size))
                    self._full_warned = True
                break
            slot = h & mask
            for _ in range(self.max_probe):
                key = int(self.keys[slot])
                if key == h:
                    break
                if key == 0:
                    self.values[slot] = v
                    self.keys[slot] = h  # published last: readers never see half a vector
                    self.size += 1
                    added += 1
                    break
                slot = (slot + 1) & mask
        return added

    def get(self, hashes: torch.Tensor) -> torch.Tensor:
        """``float32[N, D]`` embeddings of ``hashes`` (zeros for unknown states); vectorised."""
        # numpy views of the shared tensors: cheaper than torch for the few rows of an env step
        keys, values = self.keys.numpy(), self.values.numpy()
        h = self._keys(hashes).numpy()
        mask = self.capacity - 1
        out = np.zeros((len(h), self.dim), np.float32)
        slot = h & mask
        todo = np.arange(len(h))
        for _ in range(self.max_probe):
            key = keys[slot]
            hit = key == h[todo]
            if hit.any():
                out[todo[hit]] = values[slot[hit]]
            more = ~hit & (key != 0)
            if not more.any():
                break
            todo, slot = todo[more], (slot[more] + 1) & mask
        return torch.from_numpy(out)


class GoalEmbeddingTransform(KeyedTransform, Transform):
    """Writes ``goal_embedding`` (``float32[*B, D]``) at acting time, in the env workers.

    Captions each observation with the same :class:`~torchrl_oni.envs.state_captions.StateCaptioner`
    settings as the trainer's :class:`~torchrl_oni.rewards.ellm.ELLMReward` and reads the state's
    goal embedding from a :class:`SharedGoalEmbeddings` (zeros until the trainer has published
    it). Declared in the observation spec, so a policy built from the env's specs can read it.

    Copies (``copy.deepcopy``, pickle: a ``ParallelEnv`` factory, a collector worker) read the
    same shared table: it pickles as its files' path.

    Args:
        shared: the table the trainer's :class:`~torchrl_oni.rewards.ellm.ELLMReward` publishes to.
        include_message, include_pets: must match the trainer's captioner.
        out_key: alias of ``out_keys[0]``.
        in_keys (list of NestedKey): the message, ``blstats`` and ``crop`` observations (3 keys;
            default ``["message", "blstats", "crop"]``); the caption hash is read from
            ``"caption_hash"`` when present.
        out_keys (list of NestedKey): the one observation key written (default
            ``["goal_embedding"]``).

    Keys can be changed later with :meth:`set_keys` (roles ``message``, ``blstats``, ``crop``,
    ``goal_embedding``).

    Example:
        >>> from torchrl.envs import TransformedEnv
        >>> from torchrl_oni.envs import NLEBatchEnv
        >>> env = TransformedEnv(NLEBatchEnv("score", num_envs=2, seed=0),
        ...                      GoalEmbeddingTransform(SharedGoalEmbeddings(capacity=1024)))
        >>> env.reset()["goal_embedding"].shape
        torch.Size([2, 384])
        >>> env.close()
    """

    _IN_ROLES = (KeyRole("message", MESSAGE_KEY, None),
                 KeyRole("blstats", "blstats", None),
                 KeyRole("crop", "crop", None))
    _OUT_ROLES = (KeyRole("goal_embedding", GOAL_EMBEDDING_KEY, "out_key"),)

    out_key = alias_property("goal_embedding", "out_keys", 0, "``out_keys[0]``: the goal embedding written.")

    def __init__(self, shared: SharedGoalEmbeddings, *, include_message: bool = False,
                 include_pets: bool = False, out_key: Optional[str] = None, in_keys=None, out_keys=None):
        from torchrl_oni.envs.state_captions import StateCaptioner

        in_keys, out_keys = self._resolve_keys(in_keys, out_keys, {"out_key": out_key})
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self.shared = shared
        self.captioner = StateCaptioner(include_message=include_message, include_pets=include_pets)

    def _embed(self, td: TensorDictBase) -> TensorDictBase:
        message_key, blstats_key, crop_key = self.in_keys
        blstats = td.get(blstats_key)
        caps = self.captioner(td.get(message_key), blstats, td.get(crop_key), td.get(CAPTION_HASH_KEY, None))
        value = self.shared.get(caps.hashes).reshape(*blstats.shape[:-1], self.shared.dim)
        td.set(self.out_key, value.to(blstats.device))
        return td

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self._embed(next_tensordict)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._embed(tensordict_reset)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._embed(tensordict)
        nxt = tensordict.get("next", None)
        if isinstance(nxt, TensorDictBase) and self.in_keys[1] in nxt.keys(True):
            self._embed(nxt)
        return tensordict

    def transform_observation_spec(self, observation_spec):
        from torchrl.data import Unbounded

        shape = observation_spec[self.in_keys[1]].shape[:-1] + (self.shared.dim,)
        observation_spec[self.out_key] = Unbounded(shape=shape, dtype=torch.float32,
                                                   device=observation_spec.device)
        return observation_spec
